"""The ``TrainingArguments`` ``PlannedTrainer`` refuses, since they would break its step
accounting, and the one it adjusts: ``gradient_accumulation_steps`` 1 (each loader item is a whole
optimizer step), the user's count kept for the outer batch when it plans by itself.
"""
from __future__ import annotations

import copy
from typing import Tuple

import transformers

_REFUSED_SAMPLING_STRATEGIES = ("group_by_length", "batch_rebalance", "sequential")


def check_settings(trainer: transformers.Trainer) -> None:
    """Refuses the settings that would break the step accounting (one loader item per optimizer
    step, the sampler's microbatches accumulated inside it).

    Args:
        trainer: the ``PlannedTrainerMixin`` trainer, built.

    Raises:
        ValueError: ``gradient_accumulation_steps`` other than 1 with a sampler of one's own,
            DeepSpeed, DataParallel over several GPUs,
            ``auto_find_batch_size``, a ``train_sampling_strategy`` of ``group_by_length``,
            ``batch_rebalance`` or ``sequential``, tensor/context/sequence parallelism, or
            ``average_tokens_across_devices=False`` on several ranks (one line, named).
    """
    args = trainer.args
    if args.gradient_accumulation_steps != 1:
        raise ValueError(f"PlannedTrainer: gradient_accumulation_steps must be 1 with a batch_sampler of your "
                         f"own (its outer_batch_size sets the step), got {args.gradient_accumulation_steps}; "
                         "without one, the trainer takes it as part of the outer batch")
    if trainer.is_deepspeed_enabled:
        raise ValueError("PlannedTrainer: DeepSpeed is not supported (its backward steps the optimizer itself; "
                         "run without a deepspeed config)")
    if args.n_gpu > 1:
        raise ValueError(f"PlannedTrainer: DataParallel over {args.n_gpu} GPUs is not supported; launch one "
                         "process per GPU (torchrun) for DistributedDataParallel")
    if args.auto_find_batch_size:
        raise ValueError("PlannedTrainer: auto_find_batch_size must be False (the sampler plans the microbatches)")
    if args.train_sampling_strategy in _REFUSED_SAMPLING_STRATEGIES:
        raise ValueError(f"PlannedTrainer: train_sampling_strategy '{args.train_sampling_strategy}' is not used "
                         "by the planned loader; leave it at 'random' (the sampler's shuffle decides the order)")
    config = getattr(trainer.accelerator, "parallelism_config", None)
    if config is not None and any(getattr(config, name, 1) > 1 for name in ("tp_size", "cp_size", "sp_size")):
        raise ValueError("PlannedTrainer: tensor, context and sequence parallelism are not supported "
                         "(only data parallelism: one process per device)")
    if args.world_size > 1 and not args.average_tokens_across_devices:
        raise ValueError("PlannedTrainer: average_tokens_across_devices must be True on several ranks (each "
                         "microbatch's loss is normalised by the whole outer batch's label tokens)")


def _one_item_per_step(args: tuple, kwargs: dict, planned: bool) -> Tuple[tuple, dict, int]:
    """The Trainer's arguments with ``gradient_accumulation_steps`` 1 in a copy of its
    ``TrainingArguments`` (each loader item is a whole optimizer step), and the user's count,
    which sets the outer batch when the trainer plans by itself."""
    training = kwargs.get("args") if "args" in kwargs else (args[1] if len(args) > 1 else None)
    steps = getattr(training, "gradient_accumulation_steps", 1)
    if not planned or training is None or steps == 1:
        return args, kwargs, 1
    training = copy.copy(training)
    training.gradient_accumulation_steps = 1
    if "args" in kwargs:
        kwargs = {**kwargs, "args": training}
    else:
        args = (args[0], training) + tuple(args[2:])
    return args, kwargs, int(steps)
