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

- ``get_train_dataloader`` returns a ``DataLoader`` with one item per optimizer step (a
  ``PlannedStep``: the step's collated microbatches). Its length is the sampler's steps per
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
"""
from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import warnings
import weakref
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Literal, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import transformers
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, seed_worker

from ..meters import allocator_settings, planned_bytes_kind, planned_peak_bytes, start_peak
from ..planning import DEFAULT_MEMORY_FRACTION, CostFormula, MemoryBudget, PackerName
from ..probe_options import ProbeOptions
from ..probing import probe
from ..sampler import PredictiveBatchSampler, _unplanned_memory
from .dataset_probes import ProbeRecords, log_allocator_line, packer_for, probes_summary
from .hf_planning import (AutomaticPlanning, PlannedMemory, TrainerSnapshot, environment_parts, label_items,
                          load_agreed, loss_normalisation, model_signature, optimizer_identity, planning_mode,
                          save_cached)

logger = logging.getLogger(__name__)

SAMPLER_STATE_NAME = "xpm_sampler_state.json"
"""File in each checkpoint folder holding the sampler's ``state_dict()``."""

_REFUSED_SAMPLING_STRATEGIES = ("group_by_length", "batch_rebalance", "sequential")


@dataclass(frozen=True)
class _StepKey:
    """What the batch sampler hands the DataLoader for one step (small, picklable for workers)."""

    epoch: int
    index: int
    microbatches: Tuple[Tuple[int, ...], ...]
    weights: Tuple[float, ...]
    placeholder: bool
    predicted_bytes: Tuple[float, ...] = ()
    correction_bytes: Tuple[float, ...] = ()


@dataclass
class PlannedStep:
    """One optimizer step as the Trainer receives it from the loader.

    Attributes:
        epoch: the sampler's epoch.
        index: the step's index in the epoch (0-based).
        microbatches: the collated microbatches (``data_collator`` of their records), in order.
        records: each microbatch's dataset indices.
        weights: each microbatch's sampler weight (used for losses without ``num_items_in_batch``).
        placeholder: True when this rank's share of the outer batch is empty: ``microbatches``
            then holds one batch of record 0 whose loss is multiplied by 0, so the rank still
            joins the step's gradient all-reduce.
        predicted_bytes: each microbatch's predicted peak (``Step.predicted_bytes``; empty for
            a placeholder), for the sampler's calibration.
        correction_bytes: each microbatch's correction, as the calibration planned the step
            (``predicted_bytes[k] + correction_bytes[k]`` is within the budget; empty for a
            placeholder).
    """

    epoch: int
    index: int
    microbatches: List[Any]
    records: List[Tuple[int, ...]]
    weights: List[float]
    placeholder: bool = False
    predicted_bytes: List[float] = field(default_factory=list)
    correction_bytes: List[float] = field(default_factory=list)

    def pin_memory(self) -> "PlannedStep":
        """Pins every microbatch's tensors (called by a DataLoader with ``pin_memory=True``)."""
        from torch.utils.data._utils.pin_memory import pin_memory

        self.microbatches = [pin_memory(batch) for batch in self.microbatches]
        return self


@dataclass(frozen=True)
class MicrobatchRecord:
    """What ``PlannedTrainer`` reports after each microbatch's forward and backward.

    Attributes:
        step: the optimizer step it belongs to (the Trainer's ``global_step`` after that step).
        epoch: the sampler's epoch.
        records: the dataset indices of its records.
        peak_allocated_bytes: the meter's peak over its forward and backward (None without a meter).
        placeholder: True for the zero-weight batch of a rank whose share is empty.
        predicted_bytes: the memory model's prediction of its peak (None for a placeholder).
        correction_bytes: the calibration's correction of its prediction, as its step was planned.
    """

    step: int
    epoch: int
    records: Tuple[int, ...]
    peak_allocated_bytes: Optional[int]
    placeholder: bool
    predicted_bytes: Optional[float] = None
    correction_bytes: float = 0.0


class _StepDataset(torch.utils.data.Dataset):
    """Item ``_StepKey``: the step's microbatches collated (runs in the DataLoader's workers)."""

    def __init__(self, dataset, collate_fn: Callable):
        self.dataset, self.collate_fn = dataset, collate_fn

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: _StepKey) -> PlannedStep:
        batches = [self.collate_fn([self.dataset[i] for i in microbatch]) for microbatch in key.microbatches]
        return PlannedStep(key.epoch, key.index, batches, list(key.microbatches), list(key.weights), key.placeholder,
                           list(key.predicted_bytes), list(key.correction_bytes))


def _only_item(items: List[PlannedStep]) -> PlannedStep:
    return items[0]


class _StepBatchSampler(torch.utils.data.Sampler):
    """Yields ``[_StepKey]`` for each step of the epoch from its first (the Trainer skips the
    steps done itself on resume); ``len``: the steps per epoch. The sampler is asked for when
    iterating starts: a trainer that plans by itself makes it after the model is prepared."""

    def __init__(self, sampler_of: Callable[[], PredictiveBatchSampler], steps_per_epoch: int):
        self.sampler_of, self.steps_per_epoch, self.epoch = sampler_of, steps_per_epoch, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[List[_StepKey]]:
        sampler = self.sampler_of()
        sampler.set_epoch(self.epoch)
        for index, step in enumerate(sampler.steps()):
            microbatches = tuple(tuple(int(i) for i in np.asarray(mb, dtype=np.int64).reshape(-1))
                                 for mb in step.microbatches)
            weights = tuple(float(w) for w in step.weights)
            kept = [(mb, w, float(p), float(c)) for mb, w, p, c in
                    zip(microbatches, weights, step.predicted_bytes, step.correction_bytes) if len(mb) > 0]
            if kept:
                yield [_StepKey(self.epoch, index, tuple(k[0] for k in kept), tuple(k[1] for k in kept), False,
                                tuple(k[2] for k in kept), tuple(k[3] for k in kept))]
            else:  # this rank's share is empty: one zero-weight batch of record 0 joins the all-reduce
                yield [_StepKey(self.epoch, index, ((0,),), (0.0,), True)]


class _StepLoader(torch.utils.data.DataLoader):
    """The DataLoader over steps; ``set_epoch`` reaches the step sampler (the Trainer calls it)."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


def _masked_labels(batch: Mapping) -> dict:
    """``batch`` with every label ignored (-100), for a placeholder's token count of 0."""
    masked = dict(batch)
    for key in ("labels", "shift_labels"):
        if key in masked and torch.is_tensor(masked[key]):
            masked[key] = torch.full_like(masked[key], -100)
    return masked


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
        packer: without ``batch_sampler``: the sampler's packer (``xpm.PackerName``, "fastest").
        **kwargs: as ``transformers.Trainer``; ``data_collator`` collates one microbatch (a
            list of records) into the model's inputs.

    Attributes:
        xpm_report: the start-up line of a trainer that planned by itself (None before).
        xpm_memory: the ``hf_planning.PlannedMemory`` it planned with (set when training starts).

    Raises:
        TypeError: the class is not a ``transformers.Trainer`` (the mixin listed without one; a
            class that lists it after one is refused where it is defined).
        ValueError: ``batch_sampler`` is not a ``PredictiveBatchSampler``, or a setting named in
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
        self._check_settings()
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

    def _steps_per_epoch(self) -> int:
        if self.xpm_sampler is not None:
            return self.xpm_sampler.steps_per_epoch()
        n, outer = len(self.train_dataset), self._outer_batch_size()
        return n // outer if self.args.dataloader_drop_last else -(-n // outer)

    # ---- planning by itself (no batch_sampler)
    def _before_training(self) -> None:
        """Once the Trainer has prepared the model and optimizer, before the first step: plans
        (no sampler given), checks the loss's normalisation, then a resumed checkpoint's sampler."""
        if self.xpm_sampler is None:
            self._plan_automatically()
        self._check_loss_normalisation()
        if planning_mode(self) == "padding_free":
            self._check_records_kept_apart()
        if self._pending_checkpoint is not None:
            checkpoint, self._pending_checkpoint = self._pending_checkpoint, None
            self._check_sampler_checkpoint(checkpoint)

    def _plan_automatically(self) -> None:
        planning, args = self.xpm_planning, self.args
        mode = planning_mode(self)
        meter = self.xpm_meter = planning.meter_of(self, self.xpm_meter)
        dims = planning.record_dims_of(self, mode)
        capacity = int(meter.capacity_bytes)
        budget = MemoryBudget(capacity, planning.memory_fraction)
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's wrapper skips unsynced steps
        path = planning.cache_path(self, self._cache_parts(mode, optimizer, capacity, dims))
        model = load_agreed(path, args.world_size)
        outcome = None
        if model is None:
            per_rank = -(-self._outer_batch_size() // args.world_size)
            outcome = self._probe(mode, dims, budget, per_rank, optimizer, meter)
            model = outcome.model
            if path is not None and args.process_index == 0:
                save_cached(model, path)
        self.xpm_memory = PlannedMemory(model, budget.usable_bytes, capacity, meter, dims, outcome, path)
        self.xpm_sampler = PredictiveBatchSampler(
            dims, model, budget.usable_bytes, outer_batch_size=self._outer_batch_size(), rank=args.process_index,
            world_size=args.world_size, seed=args.seed, drop_last=args.dataloader_drop_last,
            packer=packer_for(planning.packer, model))
        self.xpm_report = self._planning_report(mode)
        logger.info("%s", self.xpm_report)
        log_allocator_line(meter, logger)

    def _cache_parts(self, mode: str, optimizer, capacity: int, dims) -> Dict[str, Any]:
        """What the memory model depends on: its cache key's parts."""
        planning, model = self.xpm_planning, self.model
        formula = planning.formula if planning.formula == "auto" else planning.formula.canonical
        collator = getattr(self.data_collator, "data_collator", self.data_collator)
        return {"formula": formula, "variables": planning.variables(mode), "mode": mode,
                "trainer": type(self).__name__, "model": model_signature(model),
                "config": model.config.to_dict() if hasattr(getattr(model, "config", None), "to_dict") else None,
                "optimizer": optimizer_identity(optimizer), "precision": str(self.accelerator.mixed_precision),
                "gradient_checkpointing": bool(getattr(model, "is_gradient_checkpointing", False)),
                "attention": getattr(getattr(model, "config", None), "_attn_implementation", None),
                "collator": f"{type(collator).__module__}.{type(collator).__qualname__}",
                "world_size": self.args.world_size, "device": self.args.device.type, "capacity_bytes": capacity,
                "memory_fraction": planning.memory_fraction, "dims_max": dims.max(axis=0).tolist(),
                "probe_options": repr(planning.probe_options), "allocator": self._allocator_part(),
                **environment_parts()}

    def _allocator_part(self) -> str:
        """The allocator the peaks come from: plain allocated bytes, or a caching allocator's
        reserved bytes under its settings (the GPU's, or the CPU meter's emulation)."""
        meter = self.xpm_meter
        if meter is None or planned_bytes_kind(meter) == "allocated":
            return "allocated"
        emulated = getattr(meter, "caching", None)
        return f"reserved: {emulated}" if emulated else f"reserved: {sorted(allocator_settings().items())}"

    def _probe(self, mode: str, dims, budget: MemoryBudget, per_rank_records: int, optimizer, meter):
        """Probes the prepared model through this trainer's ``compute_loss`` on the dataset's
        own records, leaving the trainer's state as it was."""
        records = ProbeRecords(self.train_dataset, dims, mode)
        collator = self._get_collator_with_removed_columns(self.data_collator, description="Training")
        model = self.model_wrapped

        def loss_of(rows):
            batch = self._prepare_inputs(collator(records.at(rows)))
            with self.accelerator.autocast(), self.compute_loss_context_manager():
                return self.compute_loss(model, batch)

        options = self.xpm_planning.probe_options_for(mode, dims, budget, per_rank_records, self.args.world_size)
        snapshot = TrainerSnapshot(self)
        model.train()
        try:
            return probe(model, optimizer, loss_of, self.xpm_planning.formula, meter=meter, options=options)
        finally:
            snapshot.restore()
            model.zero_grad(set_to_none=True)

    def _planning_report(self, mode: str) -> str:
        """The start-up line: where the model came from, its formula and fit, the budget, and the
        microbatches per step it expects against the fixed batch it replaces."""
        args, memory, sampler = self.args, self.xpm_memory, self.xpm_sampler
        outcome = memory.outcome
        if outcome is None:
            source = f"memory model from the cache {memory.cache_path} (no probes)"
        else:
            source = probes_summary(outcome)
        counts = [len(sampler.planned_step(i).microbatches) for i in range(min(sampler.steps_per_epoch(), 32))]
        return (f"xpm: {mode} records; {source}; formula {memory.model.formula.canonical}; budget "
                f"{memory.usable_bytes:,} of {memory.capacity_bytes:,} bytes; {self._outer_batch_size()} records per "
                f"optimizer step (per device {args.per_device_train_batch_size} x {self.xpm_accumulation_steps} "
                f"accumulation steps x {args.world_size} rank(s), the fixed batch it replaces) in {min(counts)} to "
                f"{max(counts)} microbatches on this rank (mean {sum(counts) / len(counts):.2f}, first "
                f"{len(counts)} steps)")

    def _check_loss_normalisation(self) -> None:
        """Checks on one real microbatch that a loss given ``num_items_in_batch`` divides by it;
        a model that ignores it (its ``forward`` takes ``**kwargs`` but its loss is a plain mean)
        has ``model_accepts_loss_kwargs`` set False and its microbatch losses weighted instead."""
        if self._loss_divides_by_items is not None:
            return
        if not (self.model_accepts_loss_kwargs or self.compute_loss_func is not None):
            self._loss_divides_by_items = False
            return
        collator = self._get_collator_with_removed_columns(self.data_collator, description="Training")
        batch = self._prepare_inputs(collator(self._small_records()))
        items = label_items(batch, getattr(self, "_loss_shifts_labels", False)) if isinstance(batch, Mapping) else None
        if not items:
            self._loss_divides_by_items = True
            return
        model = self.model

        def loss_of(count: int) -> torch.Tensor:
            with self.accelerator.autocast(), self.compute_loss_context_manager():
                return self.compute_loss(model, dict(batch), num_items_in_batch=torch.tensor(count,
                                                                                               device=self.args.device))

        snapshot = TrainerSnapshot(self)
        try:
            verdict, ratio = loss_normalisation(loss_of, items)
        finally:
            snapshot.restore()
        self._loss_divides_by_items = verdict != "ignores"
        name = type(getattr(model, "module", model)).__name__
        if verdict == "ignores":
            if self.compute_loss_func is None:
                self.model_accepts_loss_kwargs = False
            logger.warning("xpm: %s's loss ignores num_items_in_batch (the same loss at %d and %d items), though the "
                           "Trainer passes it; each microbatch's mean loss is weighted by its share of the outer "
                           "batch's label items instead", name, items, 2 * items)
        elif verdict == "unclear":
            logger.warning("xpm: %s's loss given num_items_in_batch %d and %d changed by a factor %.4f, neither 2 "
                           "(divides) nor 1 (ignores); left as the Trainer passes it", name, items, 2 * items, ratio)

    def _check_records_kept_apart(self) -> None:
        """Warns when the model attends across the records a padding-free collator flattens: the
        logits of one record, alone and after another, through this trainer's ``compute_loss``."""
        dataset = self.train_dataset
        if dataset is None or len(dataset) < 2:
            return
        collator = self._get_collator_with_removed_columns(self.data_collator, description="Training")
        model = self.model
        first, second = self._small_records()
        tokens = len(second["input_ids"])

        def logits_of(records) -> Optional[torch.Tensor]:
            batch = self._prepare_inputs(collator(records))
            with torch.no_grad(), self.accelerator.autocast(), self.compute_loss_context_manager(), \
                    warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # TRL deprecates return_outputs for its own users
                outputs = self.compute_loss(model, batch, return_outputs=True)[1]
            logits = outputs.get("logits") if isinstance(outputs, Mapping) else None
            return None if logits is None else logits.reshape(-1, logits.shape[-1])[-tokens:].float()

        snapshot, training = TrainerSnapshot(self), model.training
        model.eval()
        try:
            alone, after = logits_of([second]), logits_of([first, second])
        finally:
            model.train(training)
            snapshot.restore()
        if alone is None or after is None or alone.shape != after.shape:
            return
        change = float((alone - after).abs().max())
        if change > 1e-3 * max(1e-6, float(alone.abs().max())):
            logger.warning("xpm: %s attends across the records a padding-free collator flattens (a record's logits "
                           "change by up to %.3g after another record): a microbatch's loss then depends on which "
                           "records share it, with or without xpm; under sdpa attention pass use_cache=False (packed "
                           "records are then told apart by their position_ids) or use flash attention",
                           type(getattr(model, "module", model)).__name__, change)

    def _small_records(self) -> List[Dict[str, Any]]:
        """Two short records made from the dataset's shortest (``ProbeRecords.small``; the
        shortest twice where its shape is not one ``ProbeRecords`` knows), for the checks before
        training: they fit the budget wherever anything does."""
        dataset = self.train_dataset
        shortest = int(np.argmin(self.xpm_sampler._dims[:, 1:].sum(axis=1)))
        try:
            return ProbeRecords(dataset, None, planning_mode(self), source_index=shortest).small()
        except (KeyError, ValueError, TypeError):  # records of the user's own shape: two of them as they are
            return [dataset[shortest], dataset[shortest]]

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

    # ---- settings
    def _check_settings(self) -> None:
        args = self.args
        if args.gradient_accumulation_steps != 1:
            raise ValueError(f"PlannedTrainer: gradient_accumulation_steps must be 1 with a batch_sampler of your "
                             f"own (its outer_batch_size sets the step), got {args.gradient_accumulation_steps}; "
                             "without one, the trainer takes it as part of the outer batch")
        if self.is_deepspeed_enabled:
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
        config = getattr(self.accelerator, "parallelism_config", None)
        if config is not None and any(getattr(config, name, 1) > 1 for name in ("tp_size", "cp_size", "sp_size")):
            raise ValueError("PlannedTrainer: tensor, context and sequence parallelism are not supported "
                             "(only data parallelism: one process per device)")
        if args.world_size > 1 and not args.average_tokens_across_devices:
            raise ValueError("PlannedTrainer: average_tokens_across_devices must be True on several ranks (each "
                             "microbatch's loss is normalised by the whole outer batch's label tokens)")

    # ---- data
    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        """One item per optimizer step (a ``PlannedStep``); not passed through
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
        steps = _StepBatchSampler(self._planned_sampler, self._steps_per_epoch())
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
            ValueError: the loader yields something other than a ``PlannedStep``.
        """
        steps: List[PlannedStep] = []
        for _ in range(num_batches):
            try:
                steps.append(next(epoch_iterator))
            except StopIteration:
                break
        for step in steps:
            if not isinstance(step, PlannedStep):
                raise ValueError(f"PlannedTrainer: the train loader must yield xpm PlannedStep items (from "
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
            ValueError: ``inputs`` is not a ``PlannedStep``.
        """
        if not isinstance(inputs, PlannedStep):
            raise ValueError(f"PlannedTrainer.training_step takes a PlannedStep (one optimizer step's "
                             f"microbatches), got {type(inputs).__name__}")
        # One item is a whole optimizer step: the Trainer's division of the loss by the items of a
        # step is by 1; the sampler's weights (or num_items_in_batch) do the accumulation.
        self.current_gradient_accumulation_steps = 1
        if self.xpm_meter is not None and not self._unplanned_warned:
            message = _unplanned_memory(self.xpm_meter, self.xpm_sampler._model, self.xpm_sampler._usable_bytes,
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
            calibration = self.xpm_sampler.calibration
            if peak is not None and calibration is not None and not inputs.placeholder and inputs.predicted_bytes:
                calibration.record_peak(inputs.predicted_bytes[k], planned_peak_bytes(self.xpm_meter))
            if self.on_microbatch is not None:
                predicted = None if inputs.placeholder or not inputs.predicted_bytes else inputs.predicted_bytes[k]
                self.on_microbatch(MicrobatchRecord(self.state.global_step + 1, inputs.epoch, tuple(records), peak,
                                                    inputs.placeholder, predicted,
                                                    inputs.correction_bytes[k] if inputs.correction_bytes else 0.0))
        if self.xpm_meter is not None:  # every rank, once per step: the correction agreed
            line = self.xpm_sampler.end_step(inputs.index)
            if line is not None:
                logger.info("xpm calibration: %s", line)
        state = self.xpm_sampler.state_dict()
        state.update(epoch=inputs.epoch, steps_done=inputs.index + 1)
        self.xpm_sampler.load_state_dict(state)
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
            with open(os.path.join(folder, SAMPLER_STATE_NAME), "w") as out:
                json.dump(self.xpm_sampler.state_dict(), out, indent=1)

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
                self._check_sampler_checkpoint(checkpoint)
            else:  # planned once the model is prepared, checked then; a missing state is refused now
                _sampler_state_path(checkpoint)
                self._pending_checkpoint = checkpoint
        return super().train(resume_from_checkpoint=resume_from_checkpoint or None, trial=trial,
                             ignore_keys_for_eval=ignore_keys_for_eval)

    def _check_sampler_checkpoint(self, checkpoint: str) -> None:
        path = _sampler_state_path(checkpoint)
        with open(path) as source:
            saved = json.load(source)
        try:
            self.xpm_sampler.load_state_dict(saved)  # ValueError for other settings
        except ValueError as error:
            raise ValueError(f"PlannedTrainer: {path} was written by another plan: {error} (the outer batch is "
                             "per_device_train_batch_size x gradient_accumulation_steps x world size; resume with "
                             "the arguments the checkpoint was trained with)") from None
        with open(os.path.join(checkpoint, TRAINER_STATE_NAME)) as source:
            global_step = json.load(source)["global_step"]
        done = saved["epoch"] * self.xpm_sampler.steps_per_epoch() + saved["steps_done"]
        if done != global_step:
            raise ValueError(f"PlannedTrainer: checkpoint '{checkpoint}' is at global step {global_step} but its "
                             f"sampler state is at step {done} (epoch {saved['epoch']}, step {saved['steps_done']})")


def _sampler_state_path(checkpoint: str) -> str:
    """The sampler state file of ``checkpoint``; ValueError in one line when it has none."""
    path = os.path.join(checkpoint, SAMPLER_STATE_NAME)
    if not os.path.isfile(path):
        raise ValueError(f"PlannedTrainer: checkpoint '{checkpoint}' has no {SAMPLER_STATE_NAME} (not written by "
                         "PlannedTrainer); resume from one that is, or start without resume_from_checkpoint")
    return path


class _BeforeTraining(transformers.TrainerCallback):
    """Runs ``PlannedTrainerMixin._before_training`` when training begins (the model and the
    optimizer prepared, no step taken)."""

    def __init__(self, trainer: PlannedTrainerMixin):
        self._trainer = weakref.ref(trainer)

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self._trainer()
        if trainer is not None:
            trainer._before_training()


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
