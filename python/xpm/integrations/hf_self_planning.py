"""How ``PlannedTrainer`` plans by itself when training starts (no ``batch_sampler`` given):
the memory model from its cache, or probed through the trainer's own ``compute_loss`` on the
dataset's records (``hf_planning`` has the pieces: the planning mode, the cache, the snapshot),
the ``PredictiveBatchSampler`` it plans the steps with, and the start-up line.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Optional

import numpy as np
import transformers

from ..meters import Meter, allocator_settings, planned_bytes_kind
from ..planning import MemoryBudget
from ..probing import ProbeOutcome, probe
from ..sampler import PredictiveBatchSampler
from .dataset_probes import ProbeRecords, log_allocator_line, packer_for, probes_summary, refuse_records_over_budget
from .hf_planning import (PlannedMemory, TrainerSnapshot, environment_parts, load_agreed, model_signature,
                          optimizer_identity, planning_mode, save_cached)


def plan_by_itself(trainer: transformers.Trainer, outer_batch_size: int, logger: logging.Logger) -> None:
    """Plans the trainer's steps when training starts (no sampler given): its meter, the records'
    dims, the memory model (the cached one, or probed through the trainer's own step), the
    sampler and the start-up line, set as the trainer's ``xpm_meter``, ``xpm_memory``,
    ``xpm_sampler`` and ``xpm_report``; the line is logged at INFO.

    Args:
        trainer: the ``PlannedTrainerMixin`` trainer, its model and optimizer prepared.
        outer_batch_size: records per optimizer step, over all ranks.
        logger: where the start-up line and the allocator's line go.
    """
    planning, args = trainer.xpm_planning, trainer.args
    mode = planning_mode(trainer)
    meter = trainer.xpm_meter = planning.meter_of(trainer, trainer.xpm_meter)
    dims = planning.record_dims_of(trainer, mode)
    capacity = int(meter.capacity_bytes)
    budget = MemoryBudget(capacity, planning.memory_fraction)
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper skips unsynced steps
    path = planning.cache_path(trainer, cache_parts(trainer, mode, optimizer, capacity, dims))
    model = load_agreed(path, args.world_size)
    outcome = None
    if model is None:
        per_rank = -(-outer_batch_size // args.world_size)
        outcome = probe_trainer(trainer, mode, dims, budget, per_rank, optimizer, meter)
        model = outcome.model
        if path is not None and args.process_index == 0:
            save_cached(model, path)
    refuse_records_over_budget("PlannedTrainer", model, dims, budget.usable_bytes, capacity)
    trainer.xpm_memory = PlannedMemory(model, budget.usable_bytes, capacity, meter, dims, outcome, path)
    trainer.xpm_sampler = PredictiveBatchSampler(
        dims, model, budget.usable_bytes, outer_batch_size=outer_batch_size, rank=args.process_index,
        world_size=args.world_size, seed=args.seed, drop_last=args.dataloader_drop_last,
        packer=packer_for(planning.packer, model))
    trainer.xpm_report = planning_report(trainer, mode, outer_batch_size)
    logger.info("%s", trainer.xpm_report)
    log_allocator_line(meter, logger)


def cache_parts(trainer: transformers.Trainer, mode: str, optimizer: Any, capacity: int,
                dims: np.ndarray) -> Dict[str, Any]:
    """What the memory model depends on: its cache key's parts.

    Args:
        trainer: the trainer.
        mode: its planning mode.
        optimizer: its optimizer (unwrapped).
        capacity: the meter's capacity, bytes.
        dims: the records' dims.

    Returns:
        The parts (JSON values where they can be).
    """
    planning, model = trainer.xpm_planning, trainer.model
    formula = planning.formula if planning.formula == "auto" else planning.formula.canonical
    collator = getattr(trainer.data_collator, "data_collator", trainer.data_collator)
    return {"formula": formula, "variables": planning.variables(mode), "mode": mode,
            "trainer": type(trainer).__name__, "model": model_signature(model),
            "config": model.config.to_dict() if hasattr(getattr(model, "config", None), "to_dict") else None,
            "optimizer": optimizer_identity(optimizer), "precision": str(trainer.accelerator.mixed_precision),
            "gradient_checkpointing": bool(getattr(model, "is_gradient_checkpointing", False)),
            "attention": getattr(getattr(model, "config", None), "_attn_implementation", None),
            "collator": f"{type(collator).__module__}.{type(collator).__qualname__}",
            "world_size": trainer.args.world_size, "device": trainer.args.device.type, "capacity_bytes": capacity,
            "memory_fraction": planning.memory_fraction, "dims_max": dims.max(axis=0).tolist(),
            "probe_options": repr(planning.probe_options), "allocator": allocator_part(trainer.xpm_meter),
            **environment_parts()}


def allocator_part(meter: Optional[Meter]) -> str:
    """The allocator the peaks come from: plain allocated bytes, or a caching allocator's
    reserved bytes under its settings (the GPU's, or the CPU meter's emulation).

    Args:
        meter: the trainer's meter.

    Returns:
        ``"allocated"`` or ``"reserved: <settings>"``.
    """
    if meter is None or planned_bytes_kind(meter) == "allocated":
        return "allocated"
    emulated = getattr(meter, "caching", None)
    return f"reserved: {emulated}" if emulated else f"reserved: {sorted(allocator_settings().items())}"


def probe_trainer(trainer: transformers.Trainer, mode: str, dims: np.ndarray, budget: MemoryBudget,
                  per_rank_records: int, optimizer: Any, meter: Meter) -> ProbeOutcome:
    """Probes the prepared model through the trainer's ``compute_loss`` on the dataset's own
    records, leaving the trainer's state as it was.

    Args:
        trainer: the trainer, its model and optimizer prepared.
        mode: its planning mode.
        dims: the records' dims.
        budget: the budget the probes run under.
        per_rank_records: the records of a rank's share of an outer batch.
        optimizer: its optimizer (unwrapped).
        meter: the meter.

    Returns:
        ``xpm.probe``'s outcome.
    """
    records = ProbeRecords(trainer.train_dataset, dims, mode)
    collator = trainer._get_collator_with_removed_columns(trainer.data_collator, description="Training")
    model = trainer.model_wrapped

    def loss_of(rows):
        batch = trainer._prepare_inputs(collator(records.at(rows)))
        with trainer.accelerator.autocast(), trainer.compute_loss_context_manager():
            return trainer.compute_loss(model, batch)

    options = trainer.xpm_planning.probe_options_for(mode, dims, budget, per_rank_records, trainer.args.world_size)
    snapshot = TrainerSnapshot(trainer)
    model.train()
    try:
        return probe(model, optimizer, loss_of, trainer.xpm_planning.formula, meter=meter, options=options)
    finally:
        snapshot.restore()
        model.zero_grad(set_to_none=True)


def planning_report(trainer: transformers.Trainer, mode: str, outer_batch_size: int) -> str:
    """The start-up line: where the model came from, its formula and fit, the budget, and the
    microbatches per step it expects against the fixed batch it replaces.

    Args:
        trainer: the trainer, planned.
        mode: its planning mode.
        outer_batch_size: records per optimizer step, over all ranks.

    Returns:
        One line.
    """
    args, memory, sampler = trainer.args, trainer.xpm_memory, trainer.xpm_sampler
    outcome = memory.outcome
    if outcome is None:
        source = f"memory model from the cache {memory.cache_path} (no probes)"
    else:
        source = probes_summary(outcome)
    counts = [len(sampler.planned_step(i).microbatches) for i in range(min(sampler.steps_per_epoch(), 32))]
    return (f"xpm: {mode} records; {source}; formula {memory.model.formula.canonical}; budget "
            f"{memory.usable_bytes:,} of {memory.capacity_bytes:,} bytes; {outer_batch_size} records per "
            f"optimizer step (per device {args.per_device_train_batch_size} x {trainer.xpm_accumulation_steps} "
            f"accumulation steps x {args.world_size} rank(s), the fixed batch it replaces) in {min(counts)} to "
            f"{max(counts)} microbatches on this rank (mean {sum(counts) / len(counts):.2f}, first "
            f"{len(counts)} steps)")
