"""xpm under accelerate as one call: ``xpm.integrations.accelerate.prepare`` replaces
``accelerator.prepare(model, optimizer, loader)``, and the loop takes its microbatches.

    meter = xpm.CpuMeter.install()          # on the CPU: before the model is built; its cap is the budget
    model = MyModel(); meter.capacity_bytes = 200_000_000
    accelerator = accelerate.Accelerator(gradient_accumulation_steps=4)
    loader = DataLoader(records, batch_size=8, shuffle=True, collate_fn=collate)
    model, optimizer, loader = xpm_accelerate.prepare(accelerator, model, optimizer, loader,
                                                      loss_fn=lambda model, batch: model(**batch).loss)
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for microbatch in xpm_accelerate.microbatch_loop(loader):
            with xpm_accelerate.accumulate(accelerator, model, microbatch):
                accelerator.backward(microbatch.weight * loss_fn(model, microbatch.batch))
                optimizer.step()            # acts at the step's last microbatch only
                optimizer.zero_grad()

What it derives, each overridable by a keyword: the outer batch, the loader's ``batch_size x
gradient_accumulation_steps x num_processes`` records per optimizer step (the accelerator's
accumulation count is then set to 1: the microbatch weights accumulate); each record's length
from the dataset (a text, a token list, a tensor, or a mapping's ``input_ids``; for a model whose
config says ``is_encoder_decoder``, the source's and the target's, variables ``bs, ls, lt``); probes of the
prepared (DDP-wrapped) model in lockstep on every process, on the dataset's longest record cut or
repeated through the loader's ``collate_fn``, under ``accelerator.autocast()``, its loss
``loss_fn(model, batch)``; the budget from the device (CUDA's memory, torch's per-process fraction
where set; on the CPU the installed ``xpm.CpuMeter``'s cap) times ``memory_fraction``; formula
``"auto"``. ``microbatch_loop`` then measures every microbatch with that meter and calibrates.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Callable, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler

import accelerate

from ..meters import Meter
from ..planning import DEFAULT_MEMORY_FRACTION, CostFormula, MemoryBudget, PackerName
from ..probe_options import ProbeOptions
from ..probing import probe
from ..sampler import PredictiveBatchSampler
from .accelerate import _round_robin_of, _check_processes, prepare_data_loader
from .dataset_probes import (VARIABLES, PlanningMode, ProbeRecords, log_allocator_line, check_device_meter, checked_custom_dims,
                             dataset_record_dims, device_meter, drop_in_probe_options, packer_for, probes_summary,
                             records_units, refuse_records_over_budget, check_drop_in_arguments, model_planning_mode)

logger = logging.getLogger(__name__)

__all__ = ["prepare", "default_loss"]


def default_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """A Hugging Face model's loss: ``model(**batch).loss`` (or ``["loss"]``, or the output
    itself where it is a scalar tensor) for a mapping with labels, else ``model(batch)`` (a
    module whose forward returns its loss).

    Raises:
        ValueError: the model's output holds no loss (no ``loss`` attribute or key), or is not
            a scalar tensor: ``prepare(..., loss_fn=...)`` says how to get it.
    """
    if isinstance(batch, Mapping):
        output = model(**batch)
        loss = output if torch.is_tensor(output) and output.numel() == 1 else getattr(output, "loss", None)
        if loss is None and isinstance(output, Mapping):
            loss = output.get("loss")
        if loss is None:
            raise ValueError(f"the default loss_fn reads model(**batch).loss, but the model returned a "
                             f"{type(output).__name__} without a loss (labels missing from the batch?): pass "
                             "loss_fn=callable(model, batch) -> the scalar loss")
    else:
        loss = model(batch)
    if not torch.is_tensor(loss) or loss.numel() != 1:
        what = f"a tensor of shape {tuple(loss.shape)}" if torch.is_tensor(loss) else f"a {type(loss).__name__}"
        raise ValueError(f"the default loss_fn takes the model's output as the loss, but it is {what}: pass "
                         "loss_fn=callable(model, batch) -> the scalar loss")
    return loss


class _WithPlaceholder:
    """The loader's ``collate_fn``, given record 0 for the empty list of a process whose share of
    a step is empty (its weight is 0; its backward still joins the step's all-reduce)."""

    def __init__(self, collate_fn: Callable, dataset: Any):
        self.collate_fn, self.dataset = collate_fn, dataset

    def __call__(self, records: list) -> Any:
        return self.collate_fn(records if records else [self.dataset[0]])


_DATASET = "xpm.integrations.accelerate.prepare: loader.dataset"


def _checked_loader(loader: Any) -> DataLoader:
    if isinstance(loader, accelerate.data_loader.DataLoaderAdapter):
        problem = (f"got a {type(loader).__name__}, a loader accelerator.prepare made already: give the loader "
                   "itself, not prepared (prepare plans and prepares it)")
    elif not isinstance(loader, DataLoader):
        problem = f"got a {type(loader).__name__}"
    elif isinstance(loader.dataset, IterableDataset):
        problem = f"its dataset is an IterableDataset ({type(loader.dataset).__name__})"
    elif loader.batch_size is None:
        problem = "it has no batch_size (a batch_sampler of its own)"
    else:
        return loader
    raise ValueError("xpm.integrations.accelerate.prepare: loader must be a DataLoader over a map-style dataset with "
                     "a batch_size (the outer batch is batch_size x gradient_accumulation_steps x num_processes); "
                     f"{problem}")


def prepare(accelerator: "accelerate.Accelerator", model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            loader: DataLoader, *, loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] = default_loss,
            formula: Union[CostFormula, str] = "auto", memory_fraction: float = DEFAULT_MEMORY_FRACTION,
            meter: Optional[Meter] = None,
            record_dims: Optional[Callable[[Any], Sequence[float]]] = None,
            units: Optional[Callable[[Any], float]] = None, probe_options: Optional[ProbeOptions] = None,
            packer: PackerName = "fastest", seed: int = 0) -> Tuple[torch.nn.Module, Any, DataLoader]:
    """``accelerator.prepare(model, optimizer)``, then the probes and the planned loader in place
    of ``loader`` (module docstring). Every process must call it.

    Args:
        accelerator: the run's ``accelerate.Accelerator``; its ``gradient_accumulation_steps`` is
            part of the outer batch and then set to 1.
        model: the model, not yet prepared.
        optimizer: its optimizer, not yet prepared.
        loader: the ``DataLoader`` the loop would have used (map-style dataset, ``batch_size``,
            ``collate_fn``; its ``num_workers`` and ``pin_memory`` carry over to the planned
            loader); not prepared.
        loss_fn: ``loss_fn(model, batch)``: a microbatch's mean loss (default ``default_loss``).
        formula: the cost formula (variables ``bs, l``; for an encoder-decoder, whose config
            says ``is_encoder_decoder``, ``bs, ls, lt``: the source's and the target's lengths,
            ``input_ids`` and ``labels``), or ``"auto"``.
        memory_fraction: the share of the device's memory or the CPU meter's cap (0.9).
        meter: the meter (default: made for ``accelerator.device``).
        record_dims: ``record_dims(record) -> [1, l, ...]`` (default: a record's length, or
            for an encoder-decoder its source's and target's).
        units: ``units(record) -> float``, a record's loss units (tokens for a token-mean
            loss); default 1 each.
        probe_options: ``xpm.ProbeOptions`` to probe with (its ``record_dims``, ``variables`` and
            ``lockstep`` are set here); default ``usable_max_rel_error=0.10``.
        packer: the sampler's packer (``xpm.PackerName``; "fastest", "adaptive" where the probes'
            time model is missing or more than 50 % off their timings).
        seed: the shuffle's seed (the records are shuffled each epoch where the loader
            shuffles: a ``RandomSampler``; else they go in order).

    Returns:
        ``(model, optimizer, loader)``: the prepared model and optimizer, and the planned loader
        (``microbatch_loop`` it). The loader's ``xpm_report`` attribute is the start-up line,
        ``xpm_outcome`` the probes' ``xpm.ProbeOutcome`` (its ``model``: the memory model, with
        its phases) and ``xpm_sampler`` the ``xpm.PredictiveBatchSampler`` (its ``calibration``).

    Raises:
        ValueError: a loader without ``batch_size`` or over an iterable dataset, a
            ``memory_fraction`` outside (0, 1], no meter to be had (on the CPU no
            ``xpm.CpuMeter`` installed or no cap), torch.distributed running more ranks than the
            accelerator knows of (torchrun without GPUs needs ``Accelerator(cpu=True)``), and what
            ``prepare_data_loader`` refuses.
    """
    mode = model_planning_mode(model)
    seed = check_drop_in_arguments("xpm.integrations.accelerate.prepare", formula, record_dims, units, packer, seed,
                                   mode)
    _check_processes(accelerator, "xpm.integrations.accelerate.prepare")
    loader = _checked_loader(loader)
    if isinstance(memory_fraction, bool) or not isinstance(memory_fraction, (int, float)) \
            or not 0 < memory_fraction <= 1:
        raise ValueError(f"xpm.integrations.accelerate.prepare: memory_fraction must be in (0, 1], "
                         f"got {memory_fraction!r}")
    check_device_meter(accelerator.device, meter, "xpm.integrations.accelerate.prepare", "prepare_data_loader(...)")
    accumulation, world = accelerator.gradient_accumulation_steps, accelerator.num_processes
    outer = loader.batch_size * accumulation * world
    accelerator.gradient_state.plugin_kwargs["num_steps"] = 1  # the microbatch weights accumulate
    model, optimizer = accelerator.prepare(model, optimizer)
    meter = device_meter(accelerator.device, meter)
    dataset = loader.dataset
    variables = list(formula.variable_names) if isinstance(formula, CostFormula) else list(VARIABLES[mode])
    if record_dims is not None:
        dims = checked_custom_dims(dataset, record_dims, len(variables), _DATASET)
    else:
        dims = dataset_record_dims(dataset, mode, _DATASET)
    budget = MemoryBudget(int(meter.capacity_bytes), float(memory_fraction))
    record_units = records_units(dataset, units, _DATASET)
    outcome = _probe(accelerator, model, optimizer, loader, loss_fn, formula, meter, dims, budget,
                     probe_options, -(-outer // world), mode, variables)
    memory_model = outcome.model
    refuse_records_over_budget("xpm.integrations.accelerate.prepare", memory_model, dims, budget.usable_bytes, budget.capacity_bytes)
    sampler = PredictiveBatchSampler(
        dims, memory_model, budget.usable_bytes, outer_batch_size=outer, rank=accelerator.process_index,
        world_size=world, seed=seed, packer=packer_for(packer, memory_model), shuffle=isinstance(loader.sampler, RandomSampler),
        units=record_units)
    planned = prepare_data_loader(accelerator, dataset, sampler, collate_fn=_WithPlaceholder(loader.collate_fn, dataset),
                                  num_workers=loader.num_workers, pin_memory=loader.pin_memory)
    _round_robin_of(planned).meter = meter
    planned.xpm_outcome, planned.xpm_sampler = outcome, sampler
    records = "" if mode == "padded" else f"{mode} records; "
    planned.xpm_report = (f"xpm: {records}{probes_summary(outcome)}; formula {memory_model.formula.canonical}; budget {budget.usable_bytes:,} bytes; {outer} records "
                          f"per optimizer step (batch_size {loader.batch_size} x {accumulation} accumulation steps x "
                          f"{world} process(es), the fixed batch it replaces)")
    logger.info("%s", planned.xpm_report)
    log_allocator_line(meter, logger)
    return model, optimizer, planned


def _probe(accelerator, model, optimizer, loader, loss_fn, formula, meter, dims: np.ndarray, budget: MemoryBudget,
           probe_options: Optional[ProbeOptions], per_process_records: int, mode: PlanningMode,
           variables: Sequence[str]):
    records = ProbeRecords(loader.dataset, dims, mode)

    def loss_of(rows):
        batch = accelerate.utils.send_to_device(loader.collate_fn(records.at(rows)), accelerator.device)
        with accelerator.autocast():
            return loss_fn(model, batch)

    options = drop_in_probe_options(probe_options, variables, dims, budget, per_process_records,
                                    accelerator.num_processes)
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper steps only at synced steps
    model.train()
    outcome = probe(model, inner, loss_of, formula, meter=meter, options=options)
    model.zero_grad(set_to_none=True)
    return outcome
