"""xpm under Lightning as one callback: the LightningModule stays as it is (automatic
optimization, ``training_step(batch, batch_idx)`` returning a microbatch's mean loss,
``train_dataloader()`` returning a ``DataLoader`` with a ``batch_size``), and
``PlannedMicrobatches`` plans its train loader.

    meter = xpm.CpuMeter.install()          # on the CPU: before the model is built; its cap is the budget
    module = MyModule(); meter.capacity_bytes = 200_000_000
    trainer = lightning.Trainer(..., accumulate_grad_batches=4,
                                callbacks=[xpm.integrations.lightning.PlannedMicrobatches()])
    trainer.fit(module)                     # every optimizer step: batch_size x 4 x world size records

What it derives when fitting starts (``on_fit_start``: DDP has wrapped the module, the optimizer
is built, no data requested yet), each overridable by a keyword:

- the outer batch: the loader's ``batch_size x accumulate_grad_batches x world size`` records
  per optimizer step (Lightning then accumulates nothing itself: ``accumulate_grad_batches`` is
  set to 1 and each loader item is a whole step);
- each record's dims (``bs, l``): the length of a record that is a sequence (a text, a token
  list, a tensor) or of its ``input_ids`` (``record_dims=`` a callable otherwise);
- the probes: the dataset's longest record cut or repeated to each probe's dims, collated by the
  loader's ``collate_fn``, moved by the module's batch transfer hooks, through
  ``trainer.strategy.training_step`` (the DDP-wrapped module, every rank in lockstep, the
  precision's autocast) and ``xpm.probe``'s backward and optimizer step; ``self.log`` is muted
  during probes;
- the budget: on CUDA the device's memory (torch's per-process fraction, where set), on the CPU
  the installed ``xpm.CpuMeter``'s cap, times ``memory_fraction``; formula ``"auto"``.

Each optimizer step runs its microbatches inside the one ``training_step`` call Lightning makes:
all but the last are forwarded and backwarded there (outside DDP's synchronisation: their
gradients accumulate locally; their ``self.log`` calls muted, since ranks may differ in their
count and ``sync_dist=True`` is a collective), the last is returned, weighted, for Lightning to
backward (DDP all-reduces once) and step: what ``training_step`` logs is that microbatch's. A
rank whose share of an outer batch is empty runs record 0 at weight 0. Each microbatch's mean
loss is weighted by its share of the outer batch's units (``units=``: a record's loss units,
default 1 each: a mean over records). Every microbatch's peak is measured and calibrates the
plans (one all-reduce per step).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch
from torch.utils.data import DataLoader, RandomSampler

import lightning.pytorch as pl

from ..choices import microbatch_position
from ..meters import Meter, start_peak
from ..planned_step import PlannedStep
from ..planning import DEFAULT_MEMORY_FRACTION, CostFormula, MemoryBudget, PackerName
from ..probe_options import ProbeOptions
from ..probing import ProbeOutcome, probe
from ..sampler import PredictiveBatchSampler
from .dataset_probes import (ProbeRecords, log_allocator_line, check_device_meter, checked_custom_dims, dataset_record_dims, device_meter,
                             drop_in_probe_options, packer_for, probes_summary, records_units, refuse_records_over_budget,
                             check_drop_in_arguments)
from .lightning import _transfer, planned_dataloader

logger = logging.getLogger(__name__)

__all__ = ["PlannedMicrobatches"]


_DATASET = "PlannedMicrobatches: the train loader's dataset"


def _loader_problem(loader: Any) -> Optional[str]:
    """What keeps ``loader`` from being planned, in words, or None."""
    if not isinstance(loader, DataLoader):
        return f"got a {type(loader).__name__}"
    if isinstance(loader.dataset, torch.utils.data.IterableDataset):
        return f"its dataset is an IterableDataset ({type(loader.dataset).__name__})"
    if loader.batch_size is None:
        return "it has no batch_size (a batch_sampler of its own)"
    return None


def _loss_of(output: Any) -> torch.Tensor:
    """The loss a ``training_step`` returned (a tensor, or a mapping's ``"loss"``)."""
    if torch.is_tensor(output):
        return output
    if isinstance(output, dict) and torch.is_tensor(output.get("loss")):
        return output["loss"]
    raise ValueError(f"PlannedMicrobatches: training_step must return its loss (a tensor or a dict with 'loss'), "
                     f"got {type(output).__name__}")


class _Muted:
    """``self.log`` and ``self.log_dict`` of a module switched off while the probes run."""

    def __init__(self, module: "pl.LightningModule"):
        self.module = module

    def __enter__(self) -> None:
        self.module.log = lambda *args, **kwargs: None
        self.module.log_dict = lambda *args, **kwargs: None

    def __exit__(self, *exc: Any) -> None:
        del self.module.log, self.module.log_dict


class PlannedMicrobatches(pl.Callback):
    """Plans a LightningModule's train loader: every optimizer step one outer batch, split into
    the microbatches predicted to fit the memory budget (module docstring).

    Args:
        formula: the cost formula (variables ``bs, l``), or ``"auto"``.
        memory_fraction: the share of the device's memory (CUDA) or of the CPU meter's cap the
            microbatches are planned within (0.9).
        meter: the meter (default: made for the trainer's device, see the module docstring).
        record_dims: ``record_dims(record) -> [1, l, ...]``, the formula's variables (default:
            a record's length).
        units: ``units(record) -> float``, a record's loss units (tokens for a token-mean loss);
            default 1 each.
        probe_options: ``xpm.ProbeOptions`` to probe with (its ``record_dims``, ``variables``
            and ``lockstep`` are set here); default ``usable_max_rel_error=0.10``.
        packer: the sampler's packer (``xpm.PackerName``; "fastest", "adaptive" when the model
            has no time model or one more than 50 % off the probes' timings).
        seed: the shuffle's seed (the records are shuffled each epoch where the loader
            shuffles: a ``RandomSampler``; else they go in order).

    Attributes:
        sampler: the ``xpm.PredictiveBatchSampler`` planned (None before fitting starts).
        outcome: the probes' ``xpm.ProbeOutcome``.
        report: the start-up line, also logged at INFO.

    Raises:
        ValueError: at construction, ``formula``, ``record_dims``, ``units``, ``packer`` or
            ``seed`` of another kind (named); when fitting starts: no meter can be had (on the
            CPU no ``xpm.CpuMeter`` installed or no cap), the train loader has no ``batch_size`` (a batch sampler of its
            own) or no map-style dataset, manual optimization, or a ``training_step`` that returns
            no loss.
    """

    def __init__(self, *, formula: Union[CostFormula, str] = "auto", memory_fraction: float = DEFAULT_MEMORY_FRACTION,
                 meter: Optional[Meter] = None, record_dims: Optional[Callable[[Any], Sequence[float]]] = None,
                 units: Optional[Callable[[Any], float]] = None, probe_options: Optional[ProbeOptions] = None,
                 packer: PackerName = "fastest", seed: int = 0) -> None:
        seed = check_drop_in_arguments("PlannedMicrobatches", formula, record_dims, units, packer, seed, "padded")
        if isinstance(memory_fraction, bool) or not isinstance(memory_fraction, (int, float)) \
                or not 0 < memory_fraction <= 1:
            raise ValueError(f"PlannedMicrobatches: memory_fraction must be in (0, 1], got {memory_fraction!r}")
        self.formula, self.memory_fraction, self.meter = formula, float(memory_fraction), meter
        self.record_dims, self.units, self.probe_options = record_dims, units, probe_options
        self.packer, self.seed = packer, seed
        self.sampler: Optional[PredictiveBatchSampler] = None
        self.outcome: Optional[ProbeOutcome] = None
        self.report: Optional[str] = None
        self._pending: Optional[PlannedStep] = None  # the step whose last backward is Lightning's
        self._zeroed = False  # the step's gradients zeroed before its first forward: skip Lightning's call
        self._placeholder: Any = None  # record 0, collated: the batch of a rank whose share is empty

    # ---- when fitting starts
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Probes the prepared step, fits, builds the sampler and puts its loader in place."""
        if not pl_module.automatic_optimization:
            raise ValueError("PlannedMicrobatches: plans automatic optimization (training_step returns the loss); "
                             "with manual optimization use xpm.integrations.lightning.planned_dataloader")
        check_device_meter(pl_module.device, self.meter, "PlannedMicrobatches", "a sampler of your own")
        source = trainer.fit_loop._data_source
        loader = source.dataloader()
        problem = _loader_problem(loader)
        if problem is not None:
            raise ValueError(f"PlannedMicrobatches: train_dataloader() must return a DataLoader over a map-style "
                             f"dataset with a batch_size (the outer batch is batch_size x accumulate_grad_batches x "
                             f"world size); {problem}")
        outer = loader.batch_size * trainer.accumulate_grad_batches * trainer.world_size
        self.meter = device_meter(pl_module.device, self.meter)
        dims = self._record_dims(loader.dataset)
        units = records_units(loader.dataset, self.units, _DATASET)
        memory_model, budget, outcome = self._probe(trainer, pl_module, loader, dims, outer)
        self.outcome = outcome
        refuse_records_over_budget("PlannedMicrobatches", memory_model, dims, budget.usable_bytes,
                                   budget.capacity_bytes)
        self.sampler = PredictiveBatchSampler(dims, memory_model, budget.usable_bytes, outer_batch_size=outer,
                                              rank=trainer.global_rank, world_size=trainer.world_size,
                                              seed=self.seed, units=units,
                                              packer=packer_for(self.packer, memory_model),
                                              shuffle=isinstance(loader.sampler, RandomSampler))
        if loader.num_workers:
            logger.warning("xpm: the planned loader collates in the training process, not in the train loader's %d "
                           "worker(s): workers would plan from a copy of the sampler that the calibration reaches "
                           "only at the next epoch", loader.num_workers)
        source.instance = planned_dataloader(trainer, loader.dataset, self.sampler, loader.collate_fn)
        self._placeholder = loader.collate_fn([loader.dataset[0]])
        accumulation = trainer.accumulate_grad_batches
        trainer.accumulate_grad_batches = 1  # each loader item is a whole optimizer step
        self._wrap_training_step(pl_module)
        self.report = (f"xpm: {probes_summary(outcome)}; formula {memory_model.formula.canonical}; budget {budget.usable_bytes:,} bytes; {outer} records per "
                       f"optimizer step (batch_size {loader.batch_size} x {accumulation} accumulated x "
                       f"{trainer.world_size} rank(s), the fixed batch it replaces)")
        logger.info("%s", self.report)
        log_allocator_line(self.meter, logger)

    def _record_dims(self, dataset: Any) -> np.ndarray:
        if self.record_dims is not None:
            width = len(self.formula.variable_names) if isinstance(self.formula, CostFormula) else 2
            return checked_custom_dims(dataset, self.record_dims, width, _DATASET)
        return dataset_record_dims(dataset, "padded", _DATASET)

    def _probe(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loader: DataLoader, dims: np.ndarray,
               outer: int):
        records = ProbeRecords(loader.dataset, dims, "padded")

        def loss_of(rows):
            batch = _transfer(pl_module, loader.collate_fn(records.at(rows)))
            return _loss_of(trainer.strategy.training_step(batch, 0))

        budget = MemoryBudget(int(self.meter.capacity_bytes), self.memory_fraction)
        variables = list(self.formula.variable_names) if isinstance(self.formula, CostFormula) else ["bs", "l"]
        options = drop_in_probe_options(self.probe_options, variables, dims, budget,
                                        -(-outer // trainer.world_size), trainer.world_size)
        model = trainer.strategy.model
        with _Muted(pl_module):
            outcome = probe(model, trainer.optimizers[0], loss_of, self.formula, meter=self.meter, options=options)
        model.zero_grad(set_to_none=True)
        return outcome.model, budget, outcome

    # ---- every step
    def _wrap_training_step(self, pl_module: "pl.LightningModule") -> None:
        """The module's ``training_step`` as Lightning calls it with a whole step's ``xpm.PlannedStep``,
        and its ``optimizer_zero_grad``, which Lightning calls between ``training_step`` and the
        backward: the step's gradients are zeroed before its first microbatch's forward instead
        (also in a step of one microbatch), and that call keeps what the earlier microbatches
        accumulated."""
        original = type(pl_module).training_step.__get__(pl_module)
        zero_grad = type(pl_module).optimizer_zero_grad.__get__(pl_module)
        callback = self

        def training_step(step: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Any:
            if not isinstance(step, PlannedStep):
                return original(step, batch_idx, *args, **kwargs)
            return callback._run_step(pl_module, original, zero_grad, step, batch_idx)

        def optimizer_zero_grad(epoch: int, batch_idx: int, optimizer: Any) -> None:
            if callback._zeroed:
                callback._zeroed = False
                return
            zero_grad(epoch, batch_idx, optimizer)

        pl_module.training_step = training_step
        pl_module.optimizer_zero_grad = optimizer_zero_grad

    def _run_step(self, pl_module: "pl.LightningModule", original: Callable, zero_grad: Callable, step: PlannedStep,
                  batch_idx: int):
        trainer, meter = pl_module.trainer, self.meter
        # A rank whose share is empty runs record 0 at weight 0: every rank then makes the same
        # calls per step (the backward's all-reduce, a self.log(sync_dist=True)'s collective).
        batches = step.batches or [(self._placeholder, 0.0)]
        last = len(batches) - 1
        # Zeroed before the first forward, also in a step of one microbatch: Lightning's own call
        # comes after the forward, which would then run with the last step's gradients alive, a
        # state no probe measured (a GRU under DDP: 7 % over its "alone" prediction).
        zero_grad(trainer.current_epoch, batch_idx, trainer.optimizers[0])
        self._zeroed = True
        for k, (batch, weight) in enumerate(batches[:last]):  # logging muted: ranks differ in their count
            start_peak(meter)
            with _Muted(pl_module):
                loss = weight * _loss_of(original(_transfer(pl_module, batch), batch_idx))
            trainer.strategy.backward(loss, None)
            self._record(step, k)
        start_peak(meter)
        self._pending = step  # the last backward is Lightning's; measured before the optimizer step
        return batches[last][1] * _loss_of(original(_transfer(pl_module, batches[last][0]), batch_idx))

    def _record(self, step: PlannedStep, k: int) -> None:
        if self.sampler.calibration is not None and k < len(step.predicted_bytes):
            self.sampler.record_microbatch_peak(step.records[k], step.predicted_bytes[k], self.meter,
                                                microbatch_position(k, len(step.predicted_bytes)))

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Refuses a fit resumed from a checkpoint saved in the middle of an epoch: Lightning
        would restart the epoch's planned steps from its first and end the epoch at the count it
        had left, so the steps from there on would never train."""
        done = trainer.fit_loop.epoch_loop.batch_progress.current.ready  # as restored from the checkpoint
        if getattr(trainer.fit_loop, "restarting", False) and 0 < done < trainer.num_training_batches:
            raise ValueError(f"PlannedMicrobatches: resumed from a checkpoint saved after {done} of the "
                             f"{trainer.num_training_batches} steps of epoch {trainer.current_epoch}: resuming in the "
                             "middle of an epoch is not supported (its planned steps would start over and the last "
                             "ones never train); resume from a checkpoint saved at an epoch's end, or start anew")

    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                                 optimizer: torch.optim.Optimizer) -> None:
        """The step's last microbatch measured, then the calibration agreed across ranks."""
        step, self._pending = self._pending, None
        if step is None or self.sampler is None:
            return
        if step.microbatches:
            self._record(step, len(step.microbatches) - 1)
        if self.sampler.calibration is not None:
            line = self.sampler.end_step(step.index)
            if line is not None:
                logger.info("xpm calibration: %s", line)
