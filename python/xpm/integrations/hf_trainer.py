"""xpm under the Hugging Face ``transformers.Trainer``: one optimizer step per outer batch, its
microbatches planned to fit the memory budget and accumulated inside one ``training_step``.

The drop-in: change the class; the trainer derives the rest when training starts (the outer
batch from ``per_device_train_batch_size x gradient_accumulation_steps x world size``, the
records' dims from the dataset, probes of its own prepared step on the dataset's records, the
budget from the device, formula ``"auto"``; the fitted model cached in ``output_dir``):

    meter = xpm.CpuMeter.install()                  # on the CPU: before the model; its cap is the budget
    model = LlamaForCausalLM(config)
    meter.capacity_bytes = 24_000_000
    trainer = PlannedTrainer(model=model, args=TrainingArguments(..., per_device_train_batch_size=8,
                             gradient_accumulation_steps=4), train_dataset=records, data_collator=pad_collate)
    trainer.train()                                 # trainer.xpm_report: the start-up line

Or a sampler of one's own (``batch_sampler=``), probed and built by hand:

    probed = xpm.probe(model, optimizer, loss_fn, formula, meter=meter, variable_max=...)
    sampler = xpm.PredictiveBatchSampler(lengths, probed.model, budget.usable_bytes,
                                         outer_batch_size=32, seed=1, units=lengths - 1)
    trainer = PlannedTrainer(model=model, args=TrainingArguments(..., gradient_accumulation_steps=1),
                             train_dataset=records, data_collator=pad_collate,
                             optimizers=(optimizer, None), batch_sampler=sampler, meter=meter)

How it fits the Trainer's loop (transformers 5.17):

- ``get_train_dataloader`` returns a ``DataLoader`` with one item per optimizer step (an
  ``xpm.PlannedStep``: the step's collated microbatches). Its length is the sampler's steps per
  epoch, so the Trainer's epoch arithmetic, its prefetch of ``gradient_accumulation_steps``
  items (1) and ``skip_first_batches`` on resume work on whole steps. The loader is not passed
  through ``accelerator.prepare``: the sampler already gives every rank its own share of every
  outer batch, and accelerate would shard the steps again among the ranks.
- ``get_batch_samples`` counts the outer batch's label tokens (the Trainer's own count over all
  the step's microbatches, summed over ranks when ``average_tokens_across_devices``) as
  ``num_items_in_batch``; each microbatch's loss is then its summed token loss over that count,
  and the microbatch losses add up to the outer batch's mean token loss. A model whose loss
  takes no ``num_items_in_batch`` (or ignores it: checked on one real microbatch before the
  first step, ``model_accepts_loss_kwargs`` then set False) gets each microbatch's mean loss
  times its share of the outer batch's label items, counted the same way; a loss without labels
  gets the sampler's weight.
- ``training_step`` runs the Trainer's own ``training_step`` (``compute_loss``, backward) once
  per microbatch, under ``accelerator.no_sync`` for all but the last (DDP all-reduces once per
  step); the Trainer then clips, steps the optimizer and the scheduler once.
- Checkpoints hold the sampler's ``state_dict`` (``xpm_sampler_state.json``); ``train(
  resume_from_checkpoint=...)`` checks it against this sampler (same seed, outer batch size,
  world size, records, ...) and the Trainer's step count, and the run continues at the next
  outer batch of the same plan.

Settings that would break the step accounting are refused with ``ValueError`` when the trainer
is built: ``gradient_accumulation_steps`` other than 1 with a sampler of one's own, DeepSpeed, DataParallel over several
GPUs, tensor/context/sequence parallelism, ``auto_find_batch_size``, a
``train_sampling_strategy`` of ``group_by_length``, ``batch_rebalance`` or ``sequential`` (the
sampler decides the order), a sampler planned for another world size, and
``average_tokens_across_devices=False`` on several ranks. ``per_device_train_batch_size`` and
``dataloader_drop_last`` are not used (the sampler's ``outer_batch_size`` and ``drop_last``
decide) with a sampler of one's own. Importing this module imports ``transformers``.

This module holds the mixin and the classes made with it; its parts are in ``hf_step_loader``
(the step loader, whose items are ``xpm.PlannedStep``, and ``MicrobatchRecord``),
``hf_settings`` (the settings refused), ``hf_self_planning`` (planning by itself),
``hf_model_checks`` (the model's checks before the first step) and ``hf_checkpoints`` (the
sampler's state, ``SAMPLER_STATE_NAME``); every name stays importable from here (``PlannedStep``
too, the same class as ``xpm.PlannedStep``).
"""
from __future__ import annotations

import contextlib
import logging
import os
import warnings
import weakref
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Literal, Mapping, Optional, Sequence, Tuple, Union

import torch
import transformers
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, seed_worker

from ..choices import microbatch_position
from ..meters import start_peak
from ..planned_step import PlannedStep
from ..planning import DEFAULT_MEMORY_FRACTION, CostFormula, PackerName
from ..probe_options import ProbeOptions
from ..sampler import PredictiveBatchSampler
from ..unplanned_memory import _unplanned_memory
from .hf_checkpoints import SAMPLER_STATE_NAME, _sampler_state_path, check_sampler_checkpoint, save_sampler_state
from .hf_model_checks import check_records_kept_apart, loss_divides_by_items
from .hf_planning import AutomaticPlanning, PlannedMemory, label_items, planning_mode
from .hf_self_planning import plan_by_itself
from .hf_settings import _REFUSED_SAMPLING_STRATEGIES, _one_item_per_step, check_settings
from .hf_step_loader import (MicrobatchRecord, _masked_labels, _only_item, _StepBatchSampler, _StepDataset, _StepKey,
                             _StepLoader)

logger = logging.getLogger(__name__)

_MIXIN_ORDER = ("{name}: PlannedTrainerMixin goes before a transformers.Trainer class in the bases, e.g. "
                "class MyTrainer(PlannedTrainerMixin, Seq2SeqTrainer)")


class PlannedTrainerMixin:
    """Makes a ``transformers.Trainer`` (or any subclass: ``Seq2SeqTrainer``, TRL's trainers, your
    own) run every optimizer step as one outer batch of ``batch_sampler``, the sampler's
    microbatches with exact gradient accumulation (module docstring). List it first:
    ``class PlannedSeq2SeqTrainer(PlannedTrainerMixin, Seq2SeqTrainer): pass``, or
    ``planned_trainer_class(Seq2SeqTrainer)``; ``PlannedTrainer`` is the plain Trainer's.

    Args:
        *args: as ``transformers.Trainer``.
        batch_sampler: the ``xpm.PredictiveBatchSampler`` over ``train_dataset`` (one record per
            dataset index; its ``world_size`` must be the run's); or None: planned when training
            starts (module docstring; ``xpm.integrations.hf_planning``), unless
            ``set_batch_sampler`` gave one before ``train()`` (e.g. after probing through
            ``probe_loss``).
        meter: optional ``xpm.CpuMeter`` / ``xpm.CudaMeter``: its peak is reset before each
            microbatch and reported in ``MicrobatchRecord.peak_allocated_bytes``; at each step's
            start ``xpm.check_unplanned_memory`` compares what is allocated with what the probes
            saw and warns once (e.g. an optimizer the Trainer made instead of the probed one);
            and each microbatch's peak feeds the sampler's calibration (``record_peak``, then
            ``end_step`` once per step on every rank: the plans of later steps are corrected by
            what the Trainer's own step measured; each change logged by ``logging`` at INFO).
        on_microbatch: optional callable given a ``MicrobatchRecord`` after each microbatch's
            backward (on every rank).
        formula: without ``batch_sampler``: the cost formula, or ``"auto"`` (the default).
        memory_fraction: without ``batch_sampler``: the share of the device's memory (CUDA) or
            of the CPU meter's cap that microbatches are planned within (0.9).
        record_dims: without ``batch_sampler``: ``record_dims(record)`` gives a record's dims
            (batch-size entry 1, then the formula's variables); default read from the dataset.
        cache_dir: without ``batch_sampler``: the folder of cached memory models (None:
            ``<output_dir>/xpm-memory-models``; False: no cache).
        probe_options: without ``batch_sampler``: ``xpm.ProbeOptions`` to probe with (its
            ``record_dims``, ``variables`` and ``lockstep`` are set by the trainer).
        packer: without ``batch_sampler``: the sampler's packer (``xpm.PackerName``, "fastest";
            "adaptive" where the probes' time model is missing or more than 50 % off their timings).
        **kwargs: as ``transformers.Trainer``; ``data_collator`` collates one microbatch (a
            list of records) into the model's inputs.

    Attributes:
        xpm_report: the start-up line of a trainer that planned by itself (None before).
        xpm_memory: the ``hf_planning.PlannedMemory`` it planned with (set when training starts).

    Raises:
        TypeError: the class is not a ``transformers.Trainer`` (the mixin listed without one; a
            class that lists it after one is refused where it is defined).
        ValueError: ``on_microbatch`` is not callable; ``batch_sampler`` is not a
            ``PredictiveBatchSampler``, or a setting named in
            the module docstring would break the step accounting; without ``batch_sampler``, a
            bad planning keyword or what cannot be planned (``AutomaticPlanning.check`` and
            ``refuse_unplannable``: on the CPU no ``xpm.CpuMeter`` installed or no cap, ...).
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        if transformers.Trainer in mro and mro.index(PlannedTrainerMixin) > mro.index(transformers.Trainer):
            raise TypeError(_MIXIN_ORDER.format(name=cls.__name__))

    def __init__(self, *args, batch_sampler: Optional[PredictiveBatchSampler] = None, meter=None,
                 on_microbatch: Optional[Callable[[MicrobatchRecord], None]] = None,
                 formula: Union[CostFormula, Literal["auto"]] = "auto", memory_fraction: float = DEFAULT_MEMORY_FRACTION,
                 record_dims: Optional[Callable[[Any], Sequence[float]]] = None,
                 cache_dir: Union[str, os.PathLike, None, Literal[False]] = None,
                 probe_options: Optional[ProbeOptions] = None, packer: PackerName = "fastest", **kwargs):
        if not isinstance(self, transformers.Trainer):
            raise TypeError(_MIXIN_ORDER.format(name=type(self).__name__))
        if on_microbatch is not None and not callable(on_microbatch):
            raise ValueError(f"PlannedTrainer: on_microbatch must be a function given each MicrobatchRecord (e.g. "
                             f"a_list.append), or None, got {on_microbatch!r:.60}")
        args, kwargs, accumulation_steps = _one_item_per_step(args, kwargs, planned=batch_sampler is None)
        super().__init__(*args, **kwargs)
        self.xpm_sampler: Optional[PredictiveBatchSampler] = None
        self.xpm_meter = meter
        self.on_microbatch = on_microbatch
        self.xpm_accumulation_steps = accumulation_steps
        self.xpm_planning = AutomaticPlanning(formula=formula, memory_fraction=memory_fraction,
                                              record_dims=record_dims, cache_dir=cache_dir,
                                              probe_options=probe_options, packer=packer)
        self.xpm_planning.check(self)
        self.xpm_report: Optional[str] = None
        self.xpm_memory: Optional[PlannedMemory] = None
        self._microbatch_loss_scale = 1.0
        self._loss_divides_by_items: Optional[bool] = None
        self._unplanned_warned = False
        self._pending_checkpoint: Optional[str] = None
        check_settings(self)
        if batch_sampler is not None:
            self.set_batch_sampler(batch_sampler)
        else:
            self.xpm_planning.refuse_unplannable(self, meter)
        self.add_callback(_BeforeTraining(self))

    def set_batch_sampler(self, batch_sampler: PredictiveBatchSampler) -> None:
        """The sampler whose outer batches the training steps are (the ``batch_sampler`` keyword,
        given later: after probing through this trainer's own step with ``probe_loss``).

        Args:
            batch_sampler: an ``xpm.PredictiveBatchSampler`` over ``train_dataset``, planned for
                this run's world size.

        Raises:
            ValueError: not a ``PredictiveBatchSampler``, or planned for another world size.
        """
        if not isinstance(batch_sampler, PredictiveBatchSampler):
            raise ValueError(f"PlannedTrainer: batch_sampler must be an xpm.PredictiveBatchSampler, "
                             f"got {type(batch_sampler).__name__}")
        args = self.args
        sampler_world = batch_sampler.state_dict()["world_size"]
        if sampler_world != args.world_size:
            raise ValueError(f"PlannedTrainer: the batch sampler plans for world size {sampler_world} but this run "
                             f"has {args.world_size} process(es); build it with world_size={args.world_size} "
                             f"and rank={args.process_index}")
        outer = batch_sampler.state_dict()["outer_batch_size"]
        if self.xpm_accumulation_steps != 1 and outer != self._outer_batch_size():
            raise ValueError(f"PlannedTrainer: the batch sampler's outer batch is {outer} records but the arguments "
                             f"say {self._outer_batch_size()} (per device {args.per_device_train_batch_size} x "
                             f"{self.xpm_accumulation_steps} accumulation steps x {args.world_size} rank(s)); "
                             "give a sampler of that outer batch or gradient_accumulation_steps=1")
        self.xpm_sampler = batch_sampler

    def _planned_sampler(self) -> PredictiveBatchSampler:
        if self.xpm_sampler is None:
            raise ValueError("PlannedTrainer: no batch sampler: it is planned when train() starts, or pass "
                             "batch_sampler=... (set_batch_sampler)")
        return self.xpm_sampler

    def _outer_batch_size(self) -> int:
        """Records per optimizer step: per device x accumulation steps x world size."""
        args = self.args
        return args.per_device_train_batch_size * self.xpm_accumulation_steps * args.world_size

    def _sampler_outer_batch_size(self) -> int:
        """Records per optimizer step: the sampler's where one is given or planned, else the Trainer's."""
        if self.xpm_sampler is not None:
            return int(self.xpm_sampler.state_dict()["outer_batch_size"])
        return self._outer_batch_size()

    def _steps_per_epoch(self) -> int:
        if self.xpm_sampler is not None:
            return self.xpm_sampler.steps_per_epoch()
        n, outer = len(self.train_dataset), self._outer_batch_size()
        return n // outer if self.args.dataloader_drop_last else -(-n // outer)

    # ---- before the first step (hf_self_planning, hf_model_checks, hf_checkpoints)
    def _before_training(self) -> None:
        """Once the Trainer has prepared the model and optimizer, before the first step: plans
        (no sampler given), checks the loss's normalisation, then a resumed checkpoint's sampler."""
        if self.xpm_sampler is None:  # hf_self_planning
            plan_by_itself(self, self._outer_batch_size(), logger)
        if self._loss_divides_by_items is None:  # hf_model_checks
            self._loss_divides_by_items = loss_divides_by_items(self, logger)
        if planning_mode(self) == "padding_free":
            check_records_kept_apart(self, logger)
        if self._pending_checkpoint is not None:
            checkpoint, self._pending_checkpoint = self._pending_checkpoint, None
            check_sampler_checkpoint(self.xpm_sampler, checkpoint)

    # ---- the losses
    def _trainer_scales_by_processes(self) -> bool:
        """Whether the Trainer's ``compute_loss`` multiplies the loss by the number of processes."""
        return bool(self.args.average_tokens_across_devices and
                    (self.model_accepts_loss_kwargs or self.compute_loss_func is not None))

    def _microbatch_scale(self, batch, weight: float, num_items_in_batch) -> float:
        """The factor of one microbatch's loss: 1 for a loss that divides by the outer batch's
        ``num_items_in_batch``, else its share of those items (the sampler's weight without labels)."""
        if num_items_in_batch is None:
            return weight
        if self._loss_divides_by_items is not False and \
                (self.model_accepts_loss_kwargs or self.compute_loss_func is not None):
            return 1.0
        items = label_items(batch, getattr(self, "_loss_shifts_labels", False)) if isinstance(batch, Mapping) else None
        if items is None:
            return weight
        processes = 1 if self._trainer_scales_by_processes() else self.accelerator.num_processes
        return items * processes / float(num_items_in_batch)

    def probe_loss(self, records: Sequence[Any]) -> torch.Tensor:
        """The loss of one microbatch of ``records`` as this trainer's training step computes it:
        collated by its ``data_collator``, moved to its device, through its ``compute_loss``
        (a subclass's own: TRL's SFTTrainer computes its loss in chunks, with buffers of its own)
        under the mixed precision ``train()`` gives the model (``accelerator.autocast``). For ``xpm.probe``'s ``loss_fn``, so the probes measure the step the
        trainer runs.

        Args:
            records: dataset items (as ``train_dataset`` holds them), e.g. random ones of the
                probe's dims.

        Returns:
            The loss (a scalar tensor with a graph; ``xpm.probe`` calls backward).
        """
        self.model.train()
        inputs = self._prepare_inputs(self.data_collator(list(records)))
        # The mixed precision accelerate gives the model when train() prepares it (SFTConfig's
        # default bf16 halves TRL's loss buffers), then the Trainer's own context.
        with self.accelerator.autocast(), self.compute_loss_context_manager():
            return self.compute_loss(self.model, inputs)

    # ---- data
    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        """One item per optimizer step (an ``xpm.PlannedStep``); not passed through
        ``accelerator.prepare`` (module docstring).

        Returns:
            The step loader (length: the sampler's steps per epoch).

        Raises:
            ValueError: no ``train_dataset``, or it is an ``IterableDataset``.
        """
        dataset = self.train_dataset
        if dataset is None:
            raise ValueError("PlannedTrainer: training requires a train_dataset")
        if isinstance(dataset, torch.utils.data.IterableDataset):
            raise ValueError("PlannedTrainer: train_dataset must be map-style (indexable records), "
                             "got an IterableDataset")
        collator = self.data_collator
        try:
            import datasets  # noqa: PLC0415 - optional, as in the Trainer
        except ImportError:
            datasets = None
        if datasets is not None and isinstance(dataset, datasets.Dataset):
            dataset = self._remove_unused_columns(dataset, description="Training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="Training")
        args = self.args
        options: Dict[str, Any] = {
            "num_workers": args.dataloader_num_workers,
            "pin_memory": args.dataloader_pin_memory,
            "persistent_workers": args.dataloader_persistent_workers,
            "multiprocessing_context": args.dataloader_multiprocessing_context,
            "prefetch_factor": args.dataloader_prefetch_factor,
            "worker_init_fn": partial(seed_worker, num_workers=args.dataloader_num_workers, rank=args.process_index),
        }
        steps_per_epoch = self._steps_per_epoch()
        if steps_per_epoch == 0 and len(dataset) > 0:  # else the Trainer fails on a loader of no length
            own = self.xpm_sampler is not None and not self.args.dataloader_drop_last  # a sampler given with its own
            setting = "the batch sampler's drop_last=True" if own else "dataloader_drop_last=True"
            raise ValueError(f"PlannedTrainer: the {len(dataset)} records of train_dataset make no whole outer batch of "
                             f"{self._sampler_outer_batch_size()} records, which {setting} leaves out: give more "
                             f"records or set {setting.replace('True', 'False')}")
        steps = _StepBatchSampler(self._planned_sampler, steps_per_epoch)
        return _StepLoader(_StepDataset(dataset, collator), batch_sampler=steps, collate_fn=_only_item, **options)

    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int,
                          device: torch.device) -> Tuple[List[PlannedStep], Any]:
        """Takes the next step and counts its label tokens over all its microbatches (and ranks)
        as the Trainer does, so each microbatch's loss is normalised by the outer batch's count.

        Args:
            epoch_iterator: the step loader's iterator.
            num_batches: items to take (1: ``gradient_accumulation_steps``).
            device: where the count goes.

        Returns:
            ``([step], num_items_in_batch)``, or ``([], None)`` at the epoch's end.

        Raises:
            TypeError: the loader yields something other than a ``PlannedStep``.
        """
        steps: List[PlannedStep] = []
        for _ in range(num_batches):
            try:
                steps.append(next(epoch_iterator))
            except StopIteration:
                break
        for step in steps:
            if not isinstance(step, PlannedStep):
                raise TypeError(f"PlannedTrainer: the train loader must yield xpm.PlannedStep items (from "
                                f"get_train_dataloader), got {type(step).__name__}")
        counted = [_masked_labels(batch) if step.placeholder else batch
                   for step in steps for batch in step.microbatches]
        if not counted or not all(isinstance(batch, Mapping) for batch in counted):
            return steps, None
        count = self._get_num_items_in_batch(counted, device)
        if count is None:  # a loss without num_items_in_batch: the count weights its microbatches
            items = [label_items(batch, getattr(self, "_loss_shifts_labels", False)) for batch in counted]
            if all(item is not None for item in items):
                count = torch.tensor(sum(items), device=device)
                if self.args.world_size > 1:
                    count = self.accelerator.gather(count).sum()
        return steps, count

    # ---- the step
    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """The Trainer's loss, times the current microbatch's scale (1, except the sampler's
        weight for a loss without ``num_items_in_batch`` and 0 for a placeholder batch).

        Returns:
            As ``transformers.Trainer.compute_loss``.
        """
        result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                      num_items_in_batch=num_items_in_batch)
        scale = self._microbatch_loss_scale
        if scale == 1.0:
            return result
        if return_outputs:
            loss, outputs = result
            return loss * scale, outputs
        return result * scale

    def training_step(self, model: torch.nn.Module, inputs, num_items_in_batch=None) -> torch.Tensor:
        """Runs the step's microbatches through the Trainer's ``training_step`` (forward,
        ``compute_loss``, backward), all but the last under ``accelerator.no_sync``.

        Args:
            model: the (wrapped) model.
            inputs: a ``PlannedStep``.
            num_items_in_batch: the outer batch's label tokens (``get_batch_samples``), or None.

        Returns:
            The step's loss (the outer batch's mean over this rank's share), detached.

        Raises:
            TypeError: ``inputs`` is not a ``PlannedStep``.
        """
        if not isinstance(inputs, PlannedStep):
            raise TypeError(f"PlannedTrainer.training_step takes a PlannedStep (one optimizer step's "
                            f"microbatches), got {type(inputs).__name__}")
        # One item is a whole optimizer step: the Trainer's division of the loss by the items of a
        # step is by 1; the sampler's weights (or num_items_in_batch) do the accumulation.
        self.current_gradient_accumulation_steps = 1
        if self.xpm_meter is not None and not self._unplanned_warned:
            message = _unplanned_memory(self.xpm_meter, self.xpm_sampler.model, self.xpm_sampler._usable_bytes,
                                        model)[1]
            if message is not None:
                warnings.warn(message, RuntimeWarning, stacklevel=2)
                self._unplanned_warned = True
        losses = []
        last = len(inputs.microbatches) - 1
        for k, (batch, records, weight) in enumerate(zip(inputs.microbatches, inputs.records, inputs.weights)):
            scale = 0.0 if inputs.placeholder else self._microbatch_scale(batch, weight, num_items_in_batch)
            sync = contextlib.nullcontext() if k == last else self.accelerator.no_sync(model)
            if self.xpm_meter is not None:
                start_peak(self.xpm_meter)
            self._microbatch_loss_scale = scale
            try:
                with sync:
                    losses.append(super().training_step(model, batch, num_items_in_batch))
            finally:
                self._microbatch_loss_scale = 1.0
            peak = None if self.xpm_meter is None else int(self.xpm_meter.peak_allocated_bytes)
            planned = not inputs.placeholder and bool(inputs.predicted_bytes)
            position = microbatch_position(k, len(inputs.predicted_bytes)) if planned else None
            if peak is not None and planned:
                self.xpm_sampler.record_microbatch_peak(records, inputs.predicted_bytes[k], self.xpm_meter, position)
            if self.on_microbatch is not None:
                self.on_microbatch(MicrobatchRecord(
                    self.state.global_step + 1, inputs.epoch, tuple(records), peak, inputs.placeholder,
                    inputs.predicted_bytes[k] if planned else None,
                    inputs.correction_bytes[k] if inputs.correction_bytes else 0.0, position))
        if self.xpm_meter is not None:  # every rank, once per step: the correction agreed
            line = self.xpm_sampler.end_step(inputs.index)
            if line is not None:
                logger.info("xpm calibration: %s", line)
        self.xpm_sampler.resume_at(inputs.epoch, inputs.index + 1)  # where a checkpoint of this step resumes
        return torch.stack(losses).sum()

    def floating_point_ops(self, inputs) -> int:
        """The step's floating point operations: the sum over its microbatches."""
        of_batch = super().floating_point_ops
        if isinstance(inputs, PlannedStep):
            return 0 if inputs.placeholder else sum(of_batch(batch) for batch in inputs.microbatches)
        return of_batch(inputs)

    def _track_num_input_tokens(self, inputs) -> None:
        """Input tokens seen, counted over the step's microbatches and gathered once per step."""
        if not isinstance(inputs, PlannedStep):
            return super()._track_num_input_tokens(inputs)
        mode = self.args.include_num_input_tokens_seen
        if mode == "no":
            return None
        name = getattr(self.model, "main_input_name", "input_ids")
        pad = getattr(self.processing_class, "pad_token_id", None) if self.processing_class is not None else None
        total = 0
        for batch in ([] if inputs.placeholder else inputs.microbatches):
            if not isinstance(batch, Mapping) or name not in batch:
                return super()._track_num_input_tokens({})  # the Trainer's own warning
            if mode == "non_padding" and "attention_mask" in batch:
                total += int(batch["attention_mask"].sum())
            elif mode == "non_padding" and pad is not None:
                total += int((batch[name] != pad).sum())
            else:
                total += int(batch[name].numel())
        tokens = torch.as_tensor(total, device=self.args.device, dtype=torch.int64)
        self.state.num_input_tokens_seen += self.accelerator.gather(tokens).sum().item()
        return None

    # ---- checkpoints
    def _save_checkpoint(self, model, trial) -> None:
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            save_sampler_state(folder, self.xpm_sampler)

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None):
        """``transformers.Trainer.train``; on resume, first checks the checkpoint's sampler state.

        Args:
            resume_from_checkpoint: as the Trainer's (a folder, or True for the last in output_dir).
            trial: as the Trainer's.
            ignore_keys_for_eval: as the Trainer's.

        Returns:
            The Trainer's ``TrainOutput``.

        Raises:
            ValueError: the checkpoint has no sampler state, was written by a sampler with other
                settings, or its step count differs from the Trainer's.
        """
        if self.train_dataset is None:
            raise ValueError("PlannedTrainer: training requires a train_dataset")
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"PlannedTrainer: no checkpoint found in output_dir '{self.args.output_dir}'")
        if resume_from_checkpoint:
            checkpoint = str(resume_from_checkpoint)
            if self.xpm_sampler is not None:
                check_sampler_checkpoint(self.xpm_sampler, checkpoint)
            else:  # planned once the model is prepared, checked then; a missing state is refused now
                _sampler_state_path(checkpoint)
                self._pending_checkpoint = checkpoint
        return super().train(resume_from_checkpoint=resume_from_checkpoint or None, trial=trial,
                             ignore_keys_for_eval=ignore_keys_for_eval)

class _BeforeTraining(transformers.TrainerCallback):
    """Runs ``PlannedTrainerMixin._before_training`` when training begins (the model and the
    optimizer prepared, no step taken)."""

    def __init__(self, trainer: PlannedTrainerMixin):
        self._trainer = weakref.ref(trainer)

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self._trainer()
        if trainer is not None:
            trainer._before_training()


class PlannedTrainer(PlannedTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with ``PlannedTrainerMixin``: the planned steps (its Args)."""


def planned_trainer_class(base: type) -> type:
    """A subclass of a Trainer class with ``PlannedTrainerMixin`` first in its bases.

    Args:
        base: ``transformers.Trainer`` or a subclass (``transformers.Seq2SeqTrainer``,
            ``trl.SFTTrainer``, ...).

    Returns:
        ``Planned<base name>``: built as ``base`` with the mixin's ``batch_sampler``, ``meter``
        and ``on_microbatch`` keywords.

    Raises:
        TypeError: ``base`` is not a subclass of ``transformers.Trainer``.
    """
    if not (isinstance(base, type) and issubclass(base, transformers.Trainer)):
        raise TypeError(f"planned_trainer_class: base must be transformers.Trainer or a subclass, got {base!r}")
    return type(f"Planned{base.__name__}", (PlannedTrainerMixin, base), {"__module__": base.__module__})


__all__ = ["PlannedTrainer", "PlannedTrainerMixin", "planned_trainer_class", "PlannedStep", "MicrobatchRecord",
           "SAMPLER_STATE_NAME"]
