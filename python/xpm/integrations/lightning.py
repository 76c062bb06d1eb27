"""xpm under Lightning (``lightning.pytorch``), single device or DDP: one dataloader item per
optimizer step, manual optimization, one gradient all-reduce per step.

    import xpm
    from xpm.integrations import lightning as xpm_lightning

    meter = xpm.CpuMeter.install()                 # every rank, before the model is built
    class Module(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False    # the microbatches decide the step, not Lightning
            self.net = Net()
        def on_fit_start(self):                    # DDP has wrapped the model, the optimizer is built
            meter.capacity_bytes = CAP
            memory_model = xpm.probe(self.net, self.trainer.optimizers[0], loss_fn, formula, meter=meter,
                                     variable_max={...}, lockstep=self.trainer.world_size > 1).model
            budget = xpm.MemoryBudget(CAP)         # DDP's buckets are in the probes
            self.sampler = xpm.PredictiveBatchSampler(lengths, memory_model, budget.usable_bytes,
                                                      outer_batch_size=64, rank=self.global_rank,
                                                      world_size=self.trainer.world_size, units=units)
        def train_dataloader(self):
            return xpm_lightning.planned_dataloader(self.trainer, dataset, self.sampler, collate_fn)
        def training_step(self, step, index):
            loss = xpm_lightning.backward_microbatches(self, step, self.mean_loss, sampler=self.sampler, meter=meter)
            optimizer = self.optimizers()
            optimizer.step()
            optimizer.zero_grad()
            self.log("loss", loss, batch_size=max(step.record_count, 1), sync_dist=True)   # the outer batch's mean loss

Why this shape:

- Lightning's ``accumulate_grad_batches`` is a fixed count; the planner gives every step as many
  microbatches as fit, so each dataloader item is a whole step (``xpm.PlannedStep``, also
  importable from here) and the LightningModule runs its microbatches with manual optimization.
  It is a plain object, not a collection: Lightning hands it to ``training_step`` as it is, and
  ``microbatches`` moves each microbatch to the device just before its forward. A rank whose
  share of an outer batch is empty gets a step with no microbatch.
- Under DDP, every rank issues the same collectives per step: ``backward_microbatches`` runs all
  but a rank's last microbatch inside ``strategy.block_backward_sync()`` (DDP's ``no_sync``), so
  each rank all-reduces once per step, at its last backward; a rank whose share of an outer batch
  is empty backwards a zero loss over every parameter, so it still joins that all-reduce. The
  sampler's weights make the all-reduced gradient the outer batch's mean-loss gradient.
- The dataset is an ``IterableDataset`` that is already this rank's share: Lightning injects a
  ``DistributedSampler`` only into map-style loaders, so ``Trainer(use_distributed_sampler=...)``
  may stay at its default. A map-style ``xpm.StepDataset`` loader under DDP would be re-sharded
  by that sampler (each rank taking every other step of its own share); ``backward_microbatches``
  refuses its items with the fix in the message.
- DDP allocates its gradient buckets (a copy of the gradients) when it wraps the model: probe in
  ``on_fit_start`` (after the wrapping, before Lightning asks for the train dataloader), every
  rank in lockstep, and the buckets are in the probes. Probed earlier (``probe_and_share`` in
  ``setup``), reserve ``ddp_bucket_bytes(model)`` in the budget instead.
- The epoch: ``planned_dataloader`` re-plans at every ``iter()`` with ``trainer.current_epoch``
  (Lightning calls ``set_epoch`` only on samplers, and an ``IterableDataset`` loader has none).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

try:
    import lightning.pytorch as pl
except ImportError as _error:  # pragma: no cover - depends on the environment
    raise ImportError("xpm.integrations.lightning needs the lightning package (pip install lightning); "
                      f"importing it failed: {_error}") from None

from ..choices import microbatch_position
from ..meters import start_peak
from ..outside_probes import trainable_gradient_bytes
from ..planned_step import PlannedStep
from ..planning import CostFormula, MemoryModel
from ..sampler import PredictiveBatchSampler

__all__ = ["PlannedStep", "PlannedSteps", "planned_dataloader", "microbatches", "backward_microbatches",
           "probe_and_share", "ddp_bucket_bytes", "PlannedMicrobatches"]


def _sampler_rank_and_world(sampler: PredictiveBatchSampler) -> Tuple[int, int]:
    if not isinstance(sampler, PredictiveBatchSampler):
        raise TypeError(f"xpm: sampler must be an xpm.PredictiveBatchSampler, got {type(sampler).__name__}")
    return int(sampler.rank), int(sampler.world_size)


class PlannedSteps(IterableDataset):
    """This rank's steps of one epoch, one ``xpm.PlannedStep`` per item, planned by ``sampler``.

    An ``IterableDataset``, so Lightning does not re-shard it among the ranks. With
    ``num_workers > 0`` each DataLoader worker collates every ``num_workers``-th step, and the
    DataLoader's round-robin over the workers keeps the steps in order.

    Args:
        dataset: map-style records, ``dataset[i]`` for the sampler's indices.
        sampler: the planner; built with this process's ``rank`` and ``world_size``.
        collate_fn: turns a list of records into a microbatch (called with an empty list never:
            an empty share has no microbatch).
    """

    def __init__(self, dataset: Any, sampler: PredictiveBatchSampler, collate_fn: Callable[[list], Any]):
        super().__init__()
        self.dataset, self.sampler, self.collate_fn = dataset, sampler, collate_fn
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Plans epoch ``epoch`` (its permutation) at the next ``iter()``."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        """Steps per epoch: the same on every rank."""
        return self.sampler.steps_per_epoch()

    def __iter__(self) -> Iterator[PlannedStep]:
        worker = get_worker_info()
        worker_id, workers = (0, 1) if worker is None else (worker.id, worker.num_workers)
        return self._steps(self.epoch, worker_id, workers)

    def _steps(self, epoch: int, worker_id: int, workers: int) -> Iterator[PlannedStep]:
        rank, world = _sampler_rank_and_world(self.sampler)
        self.sampler.set_epoch(epoch)
        # Lazily, step by step: a step planned anew by the calibration (in this process) is
        # collated as planned anew.
        for index, step in enumerate(self.sampler.steps()):
            if index % workers != worker_id:
                continue
            yield self._collated(epoch, index, rank, world, step)

    def _collated(self, epoch: int, index: int, rank: int, world: int, step: Any) -> PlannedStep:
        """``step`` (an ``xpm.Step``) with its non-empty microbatches collated; an empty share has none."""
        records, weights, predicted, corrections = step.nonempty_microbatches()
        batches = [self.collate_fn([self.dataset[i] for i in microbatch]) for microbatch in records]
        return PlannedStep(epoch, index, rank, world, batches, records, weights, predicted_bytes=predicted,
                           correction_bytes=corrections)


class _PlannedStepLoader(DataLoader):
    """A DataLoader over ``PlannedSteps`` that plans the trainer's current epoch at every ``iter()``
    (before any worker starts)."""

    def __init__(self, steps: PlannedSteps, epoch_source: Callable[[], int], **kwargs: Any):
        super().__init__(steps, batch_size=None, **kwargs)
        self._epoch_source = epoch_source

    def __iter__(self):
        self.dataset.set_epoch(self._epoch_source())
        return super().__iter__()


def planned_dataloader(trainer: "pl.Trainer", dataset: Any, sampler: PredictiveBatchSampler,
                       collate_fn: Callable[[list], Any], *, num_workers: int = 0, **dataloader_kwargs: Any) -> DataLoader:
    """The training DataLoader: one ``xpm.PlannedStep`` per optimizer step, re-planned each epoch.

    Return it from ``train_dataloader()`` (or a ``LightningDataModule``'s). Works with any
    ``Trainer(use_distributed_sampler=...)``: the loader is already this rank's share.

    Args:
        trainer: the trainer that iterates it (``self.trainer``); its ``current_epoch`` picks the
            permutation and its ``global_rank``/``world_size`` must be the sampler's.
        dataset: map-style records.
        sampler: the planner, built with ``rank=trainer.global_rank``, ``world_size=trainer.world_size``.
        collate_fn: records to a microbatch.
        num_workers: DataLoader worker processes (each collates every ``num_workers``-th step).
        **dataloader_kwargs: other DataLoader arguments (``pin_memory``: pins each step's
            microbatches, ``prefetch_factor``, ...);
            not ``batch_size``, ``shuffle``, ``sampler``, ``batch_sampler``, ``collate_fn`` (the
            plan decides them) nor ``persistent_workers`` (workers must see each epoch's plan).

    Returns:
        A ``torch.utils.data.DataLoader`` of ``xpm.PlannedStep`` items, ``len()`` steps per epoch.

    Raises:
        ValueError: the sampler's rank or world size is not the trainer's, or an argument the plan
            decides is given.
    """
    taken = sorted(set(dataloader_kwargs) & {"batch_size", "shuffle", "sampler", "batch_sampler", "collate_fn",
                                             "drop_last", "persistent_workers"})
    if taken:
        raise ValueError(f"planned_dataloader: {', '.join(taken)} cannot be given (the plan decides the steps, "
                         "and workers must be restarted each epoch); leave them out")
    rank, world = _sampler_rank_and_world(sampler)
    if (rank, world) != (trainer.global_rank, trainer.world_size):
        raise ValueError(f"planned_dataloader: the sampler is for rank {rank} of world size {world} but this process "
                         f"is rank {trainer.global_rank} of {trainer.world_size}; build it with "
                         "rank=trainer.global_rank, world_size=trainer.world_size")
    return _PlannedStepLoader(PlannedSteps(dataset, sampler, collate_fn), lambda: trainer.current_epoch,
                              num_workers=num_workers, **dataloader_kwargs)


def _check_step(module: "pl.LightningModule", step: Any) -> None:
    if module.automatic_optimization:
        raise ValueError("xpm: set self.automatic_optimization = False in the LightningModule's __init__ "
                         "(each step's microbatches are run and stepped by training_step)")
    if not isinstance(step, PlannedStep):
        raise TypeError(f"xpm: training_step got a {type(step).__name__}, not a PlannedStep: return "
                        "xpm.integrations.lightning.planned_dataloader(...) from train_dataloader() (a map-style "
                        "xpm.StepDataset loader is re-sharded by Lightning's DistributedSampler unless "
                        "Trainer(use_distributed_sampler=False))")
    trainer = module.trainer
    if (step.rank, step.world_size) != (trainer.global_rank, trainer.world_size):
        raise RuntimeError(f"xpm: this step was planned for rank {step.rank} of {step.world_size} but this process is "
                           f"rank {trainer.global_rank} of {trainer.world_size}; build the sampler with "
                           "rank=trainer.global_rank, world_size=trainer.world_size")


def _transfer(module: "pl.LightningModule", batch: Any) -> Any:
    """The module's batch transfer hooks (default: ``move_data_to_device``) on one microbatch."""
    batch = module.on_before_batch_transfer(batch, 0)
    batch = module.transfer_batch_to_device(batch, module.device, 0)
    return module.on_after_batch_transfer(batch, 0)


def _zero_loss(module: "pl.LightningModule") -> torch.Tensor:
    """0 times one element of every trainable parameter: its backward gives every parameter a
    (zero) gradient, so an empty share joins DDP's all-reduce with nothing to add."""
    parameters = [p for p in module.parameters() if p.requires_grad]
    if not parameters:
        raise ValueError("xpm: the LightningModule has no trainable parameters")
    return torch.stack([p.reshape(-1)[0] for p in parameters]).sum() * 0.0


def microbatches(module: "pl.LightningModule", step: PlannedStep, *, sampler: Optional[PredictiveBatchSampler] = None,
                 meter: Any = None) -> Iterator[Tuple[Any, float, bool]]:
    """Yields ``(batch, weight, last)`` for each microbatch of ``step``; call
    ``module.manual_backward(weight * mean_loss(batch))`` for every one, and step the optimizer after.

    All but the last microbatch are yielded inside the strategy's ``block_backward_sync()`` (DDP's
    ``no_sync``), so the gradients are all-reduced once, at the last backward. A step with no
    microbatch (this rank's share of the outer batch is empty) yields nothing but backwards a zero
    loss over every parameter itself, so this rank joins the step's all-reduce. Every yielded
    microbatch must be backwarded (else the ranks' collectives no longer match).

    With ``sampler`` and ``meter`` (the one the model was probed under), every microbatch's peak
    is measured (reset before it is yielded, read when the generator resumes) for the sampler's
    calibration, and the step ends with ``sampler.end_step`` on every rank (one all-reduce), so
    later steps are planned with what training measured (with ``num_workers=0``; worker
    processes collate from their own copy of the sampler, which takes the correction at the next
    epoch).

    Args:
        module: the LightningModule (``automatic_optimization = False``).
        step: the ``training_step`` batch, from ``planned_dataloader``.
        sampler: the ``PredictiveBatchSampler`` the loader plans with, for calibration.
        meter: the meter, for calibration.

    Yields:
        The microbatch (through the module's batch transfer hooks, on its device), the weight of
        its mean loss, and whether it is the step's last.

    Raises:
        ValueError: automatic optimization is on.
        TypeError: ``step`` is not a ``PlannedStep`` (the loader is not ``planned_dataloader``'s).
        RuntimeError: the step was planned for another rank or world size.
    """
    _check_step(module, step)
    calibrating = sampler is not None and meter is not None and sampler.calibration is not None
    if not step.microbatches:
        module.manual_backward(_zero_loss(module))
    block = getattr(module.trainer.strategy, "block_backward_sync", contextlib.nullcontext)
    last = len(step.microbatches) - 1
    for k, (batch, weight) in enumerate(zip(step.microbatches, step.weights)):
        moved = _transfer(module, batch)
        if calibrating:
            start_peak(meter)
        if k < last:
            with block():
                yield moved, weight, False
        else:
            yield moved, weight, True
        if calibrating and k < len(step.predicted_bytes):
            sampler.record_microbatch_peak(step.records[k], step.predicted_bytes[k], meter,
                                           microbatch_position(k, len(step.predicted_bytes)))
    if calibrating:
        sampler.end_step(step.index)


def backward_microbatches(module: "pl.LightningModule", step: PlannedStep,
                          mean_loss: Callable[[Any], torch.Tensor], *, sampler: Optional[PredictiveBatchSampler] = None,
                          meter: Any = None) -> torch.Tensor:
    """Runs ``module.manual_backward(weight * mean_loss(batch))`` over ``step``'s microbatches
    (see ``microbatches``); the optimizer step is the caller's.

    Args:
        module: the LightningModule (``automatic_optimization = False``).
        step: the ``training_step`` batch, from ``planned_dataloader``.
        mean_loss: a microbatch's loss averaged over its units (the sampler's ``units``).
        sampler: the ``PredictiveBatchSampler``, for calibration (see ``microbatches``).
        meter: the meter, for calibration.

    Returns:
        This rank's weighted loss sum, detached: averaged over the ranks (``self.log(...,
        sync_dist=True)``) it is the outer batch's mean loss.

    Raises:
        ValueError, TypeError, RuntimeError: as ``microbatches``.
    """
    total = torch.zeros((), device=module.device)
    for batch, weight, _ in microbatches(module, step, sampler=sampler, meter=meter):
        loss = weight * mean_loss(batch)
        module.manual_backward(loss)
        total += loss.detach()
    return total


def probe_and_share(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    loss_fn: Callable[[List[float]], torch.Tensor], formula: CostFormula, *, meter: Any,
                    src: int = 0, **probe_kwargs: Any) -> MemoryModel:
    """``xpm.probe`` on rank ``src`` only, its fitted model sent to every rank: the plans are then
    identical on every rank. Call it from ``LightningModule.setup()`` (the process group is up
    and the model not yet wrapped in DDP) on every rank; without a process group it just probes.

    Args:
        model, optimizer, loss_fn, formula, meter, **probe_kwargs: as ``xpm.probe``.
        src: the rank that probes.

    Returns:
        The fitted ``MemoryModel`` (the same on every rank).

    Raises:
        ValueError, RuntimeError: the probe's errors, on rank ``src``; on the other ranks a
            RuntimeError with rank ``src``'s message (so no rank waits for a model that never comes).
    """
    from ..probing import probe

    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not distributed:
        return probe(model, optimizer, loss_fn, formula, meter=meter, **probe_kwargs).model
    message: List[Optional[Tuple[str, str]]] = [None]
    error: Optional[BaseException] = None
    if torch.distributed.get_rank() == src:
        try:
            message[0] = ("model", probe(model, optimizer, loss_fn, formula, meter=meter, **probe_kwargs).model.to_json())
        except Exception as caught:  # noqa: BLE001 - re-raised below, after the other ranks are told
            error, message[0] = caught, ("error", f"{type(caught).__name__}: {caught}")
    torch.distributed.broadcast_object_list(message, src=src)
    if error is not None:
        raise error
    kind, text = message[0]
    if kind == "error":
        raise RuntimeError(f"xpm: rank {src} failed to probe the memory model: {text}")
    return MemoryModel.from_json(text)


def ddp_bucket_bytes(model: torch.nn.Module) -> int:
    """Bytes DDP allocates for its gradient buckets when it wraps ``model``: one copy of the
    trainable parameters' gradients (``gradient_as_bucket_view=False``, the default). They are
    allocated after the probe, so the memory model leaves them out: reserve them in the budget,
    ``xpm.MemoryBudget(cap, extra_overhead_bytes=ddp_bucket_bytes(model))``.

    Args:
        model: the module DDP wraps (its trainable parameters are the buckets' contents).

    Returns:
        The trainable parameters' bytes.
    """
    return trainable_gradient_bytes(model)


def __getattr__(attribute: str) -> Any:
    """``PlannedMicrobatches``, the one-callback planning built on this module, read from
    ``lightning_planning`` when first asked for (importing it here at once would make
    ``import xpm.integrations.lightning_planning`` circular)."""
    if attribute == "PlannedMicrobatches":
        from .lightning_planning import PlannedMicrobatches
        return PlannedMicrobatches
    raise AttributeError(f"module {__name__!r} has no attribute {attribute!r}")
