"""xpm's ``PredictiveBatchSampler`` under Hugging Face accelerate's ``Accelerator.prepare``.

accelerate shards a data loader itself: ``Accelerator.prepare`` wraps its batch sampler in a
``BatchSamplerShard`` that deals the batches to the processes round-robin (batch ``i`` to process
``i % num_processes``). xpm's sampler already gives each rank its own microbatches, so a
``DataLoader(batch_sampler=sampler)`` handed to ``prepare`` would be sharded twice: each rank
would train on every other microbatch of its own share, half of the records never seen, and the
step boundaries of the ranks out of line. This module hands accelerate a loader it deals right. The one-call form, ``prepare(accelerator,
model, optimizer, loader)`` in place of ``accelerator.prepare``, derives the sampler itself
(``accelerate_planning``); by hand:

    import xpm
    from xpm.integrations import accelerate as xpm_accelerate

    accelerator = accelerate.Accelerator()                 # gradient_accumulation_steps=1
    sampler = xpm.PredictiveBatchSampler(lengths, memory_model, budget.usable_bytes, outer_batch_size=64,
                                         rank=accelerator.process_index,
                                         world_size=accelerator.num_processes, seed=1, units=lengths - 1)
    loader = xpm_accelerate.prepare_data_loader(accelerator, dataset, sampler, collate_fn=collate)
    model, optimizer = accelerator.prepare(model, optimizer)
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for microbatch in xpm_accelerate.microbatch_loop(loader):
            with xpm_accelerate.accumulate(accelerator, model, microbatch):
                accelerator.backward(microbatch.weight * mean_loss(model, microbatch.batch))
                optimizer.step()          # accelerate steps and zeroes only at microbatch.last
                optimizer.zero_grad()

How: the loader's batch sampler (``RoundRobinMicrobatches``) yields every rank's microbatches of
the epoch in the order ``BatchSamplerShard`` deals them (rank 0's first, rank 1's first, ...,
rank 0's second, ...), the ranks with fewer microbatches padded at the end of the epoch, so each
process is dealt exactly its own share, every microbatch tagged with its rank, weight, step and
whether it ends the step. ``prepare_data_loader`` checks what accelerate built (process index
and count, ``split_batches``, ``dispatch_batches``, the number of microbatches dealt) and
``microbatch_loop`` checks the tag of every microbatch it hands out.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import accelerate
import accelerate.data_loader as accelerate_data_loader
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data._utils.collate import default_collate

from ..meters import Meter, start_peak
from ..choices import MicrobatchPosition
from ..sampler import PredictiveBatchSampler, Step

__all__ = ["PlannedMicrobatch", "RoundRobinMicrobatches", "data_loader", "prepare_data_loader", "check_prepared",
           "microbatch_loop", "accumulate", "prepare"]

_HOW_TO = ("build the loader with xpm.integrations.accelerate.prepare_data_loader(accelerator, dataset, sampler, "
           "collate_fn=...)")


class PlannedMicrobatch(NamedTuple):
    """One microbatch as the prepared loader yields it.

    ``batch``: ``collate_fn`` of its records (None for padding); ``weight``: multiplies its mean
    loss (``world_size * units(microbatch) / units(outer batch)``, 0 for padding); ``last``: it
    ends this rank's optimizer step (its backward all-reduces); ``indices``: its records;
    ``rank``: the rank it was planned for; ``step``: the optimizer step of the epoch it belongs to;
    ``predicted_bytes``: the memory model's peak for it (0 for padding); ``padding``: one of the
    empty microbatches that even out the ranks' counts at the end of an epoch (no forward, no
    backward: ``microbatch_loop`` skips them); ``correction_bytes``: the calibration's correction
    of ``predicted_bytes`` as its step was planned (``predicted_bytes + correction_bytes`` fits
    the budget); ``position``: its ``xpm.MicrobatchPosition`` among the step's microbatches with
    records (None for an empty one).
    """

    batch: Any
    weight: float
    last: bool
    indices: Tuple[int, ...]
    rank: int
    step: int
    predicted_bytes: float
    padding: bool
    correction_bytes: float = 0.0
    position: Optional[MicrobatchPosition] = None


class _PlannedIndices(list):
    """A microbatch's record indices, as the batch sampler yields them, with its plan. A list, so
    ``BatchSamplerShard`` and ``DataLoader`` pass it through unchanged (and pickle it to workers)."""

    def __init__(self, indices: Sequence[int], *, weight: float, last: bool, rank: int, step: int,
                 predicted_bytes: float, padding: bool, correction_bytes: float = 0.0,
                 position: Optional[MicrobatchPosition] = None):
        super().__init__(int(i) for i in indices)
        self.weight, self.last, self.rank, self.step = float(weight), bool(last), int(rank), int(step)
        self.predicted_bytes, self.padding = float(predicted_bytes), bool(padding)
        self.correction_bytes, self.position = float(correction_bytes), position


def _rank_and_world(sampler: PredictiveBatchSampler) -> Tuple[int, int]:
    if not isinstance(sampler, PredictiveBatchSampler):
        raise ValueError(f"sampler must be an xpm.PredictiveBatchSampler, got {type(sampler).__name__}")
    return sampler.rank, sampler.world_size


class RoundRobinMicrobatches:
    """A batch sampler of every rank's microbatches in the order accelerate's ``BatchSamplerShard``
    deals them, so that process ``r`` of ``world_size`` is dealt exactly rank ``r``'s microbatches.

    Slot ``k * world_size + r`` holds rank ``r``'s ``k``-th microbatch of the rest of the epoch;
    ranks with fewer microbatches than the most get padding (empty, weight 0) at the end, so the
    length is a multiple of ``world_size`` and accelerate neither holds back nor repeats any.
    Without a ``batch_size`` (the sizes vary), as ``BatchSamplerShard`` needs. With a lockstep
    sampler (the default at world size > 1: every rank the same count in every step) or at one
    process the slots are made a step at a time, as accelerate reads them, with a padding slot
    per rank between steps (read ahead while a step's last microbatch trains), so steps planned
    anew by the calibration (``microbatch_loop(..., meter=...)``) are dealt as planned anew from
    the next step on; ``taken_step`` is the last step whose slots were read.

    Args:
        sampler: this process's ``xpm.PredictiveBatchSampler``; its epoch and position
            (``state_dict()``) are where the order starts, and ``microbatch_loop`` marks its steps done.

    Raises:
        ValueError: ``sampler`` is not an ``xpm.PredictiveBatchSampler``.
    """

    def __init__(self, sampler: PredictiveBatchSampler):
        self.rank, self.world_size = _rank_and_world(sampler)
        self.predictive_sampler = sampler
        self.meter: Optional[Meter] = None  # the meter ``prepare`` planned with: microbatch_loop's default
        self._cache_key: Optional[tuple] = None
        self._cache: List[List[Step]] = []
        self.taken_step = -1

    def set_epoch(self, epoch: int) -> None:
        """Starts epoch ``epoch`` unless the sampler is in it already (then a resumed position
        stays); accelerate calls it with its count of iterations at every ``iter(loader)``.

        Args:
            epoch: the epoch (the sampler's permutation is ``seed + epoch``).
        """
        if int(epoch) != self.predictive_sampler.state_dict()["epoch"]:
            self.predictive_sampler.set_epoch(int(epoch))

    def steps_of_ranks(self) -> List[List[Step]]:
        """Every rank's remaining steps of the epoch: ``[rank][step]`` (``Step.microbatches``,
        ``Step.weights``); step ``k`` of every rank shares one outer batch.

        Returns:
            one list of ``xpm.Step`` per rank, all of the same length.
        """
        state = self.predictive_sampler.state_dict()
        key = (state["epoch"], state["steps_done"], tuple(map(tuple, state["corrections"])))
        if key != self._cache_key:
            self._cache = [list(self.predictive_sampler.steps(rank=r)) for r in range(self.world_size)]
            self._cache_key = key
        return self._cache

    def _start_step(self) -> int:
        state = self.predictive_sampler.state_dict()
        return state["steps_done"] if state["steps_done"] < self.predictive_sampler.steps_per_epoch() else 0

    @staticmethod
    def _planned(step: Step, rank: int, index: int) -> List[_PlannedIndices]:
        return [_PlannedIndices(microbatch.tolist(), weight=weight, last=j == len(step.microbatches) - 1, rank=rank,
                                step=index, predicted_bytes=step.predicted_bytes[j], padding=False,
                                correction_bytes=step.correction_bytes[j], position=step.positions[j])
                for j, (microbatch, weight) in enumerate(zip(step.microbatches, step.weights))]

    def _lockstep_order(self) -> Iterator[_PlannedIndices]:
        """Step by step, each planned when accelerate reads its first slot (every rank's step
        has the same count: lockstep, or one process), with one padding slot per rank between
        steps: accelerate reads one batch ahead, so it reads that slot while a step's last
        microbatch trains, and the next step's first only once the step has ended."""
        sampler = self.predictive_sampler
        for index in range(self._start_step(), sampler.steps_per_epoch()):
            if self.taken_step >= 0:
                yield from (self._padding(rank) for rank in range(self.world_size))
            self.taken_step = index
            per_rank = [self._planned(step, r, index) for r, step in enumerate(sampler.planned_steps(index))]
            for slot in zip(*per_rank):
                yield from slot

    @staticmethod
    def _padding(rank: int) -> _PlannedIndices:
        return _PlannedIndices([], weight=0.0, last=False, rank=rank, step=-1, predicted_bytes=0.0, padding=True)

    def _step_by_step(self) -> bool:
        """One process, or lockstep: each step planned when read, so corrections reach later steps."""
        return self.predictive_sampler.lockstep or self.world_size == 1

    def _order(self) -> List[_PlannedIndices]:
        start = self._start_step()
        per_rank = [[planned for k, step in enumerate(steps) for planned in self._planned(step, rank, start + k)]
                    for rank, steps in enumerate(self.steps_of_ranks())]
        slots = max(len(mine) for mine in per_rank)
        order = []
        for k in range(slots):
            for rank, mine in enumerate(per_rank):
                order.append(mine[k] if k < len(mine) else self._padding(rank))
        return order

    def __iter__(self) -> Iterator[_PlannedIndices]:
        """Every rank's microbatches of the rest of the epoch, round-robin (then the epoch starts
        over at its first step, as the sampler does)."""
        state = self.predictive_sampler.state_dict()
        if state["steps_done"] >= self.predictive_sampler.steps_per_epoch():
            self.predictive_sampler.set_epoch(state["epoch"])  # done: iterating again starts the epoch over
        self.taken_step = -1
        yield from self._lockstep_order() if self._step_by_step() else self._order()

    def __len__(self) -> int:
        """Slots of the rest of the epoch: ``world_size`` x the most microbatches of any rank,
        and, step by step, the padding slot between steps."""
        steps_of_ranks = self.steps_of_ranks()
        between = max(0, len(steps_of_ranks[0]) - 1) if self._step_by_step() else 0
        return self.world_size * (max(sum(len(step.microbatches) for step in steps) for steps in steps_of_ranks)
                                  + between)

    def microbatches_per_process(self) -> int:
        """Microbatches (padding included) accelerate deals to each process over the rest of the epoch."""
        return len(self) // self.world_size


class _PlannedDataset(torch.utils.data.Dataset):
    """The user's map-style dataset, fetched a whole planned microbatch at a time (``__getitems__``),
    so the plan of the microbatch travels with its records to ``collate_fn``."""

    def __init__(self, dataset, round_robin: RoundRobinMicrobatches):
        self.dataset, self.round_robin = dataset, round_robin

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        return self.dataset[index]

    def __getitems__(self, indices):
        if not isinstance(indices, _PlannedIndices):
            raise ValueError(f"this dataset is fetched by xpm's RoundRobinMicrobatches, got a {type(indices).__name__} "
                             f"of indices: {_HOW_TO}")
        getitems = getattr(self.dataset, "__getitems__", None)
        if indices.padding:
            records = []
        else:
            records = getitems(list(indices)) if getitems else [self.dataset[i] for i in indices]
        return records, indices

    def set_epoch(self, epoch: int) -> None:
        # accelerate's DataLoaderShard calls the dataset's set_epoch with its iteration count.
        self.round_robin.set_epoch(epoch)
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)


class _PlannedCollate:
    """``collate_fn`` of a microbatch's records, wrapped with its plan into a ``PlannedMicrobatch``."""

    def __init__(self, collate_fn: Optional[Callable]):
        self.collate_fn = default_collate if collate_fn is None else collate_fn

    def __call__(self, fetched) -> PlannedMicrobatch:
        records, planned = fetched
        batch = None if planned.padding else self.collate_fn(records)
        return PlannedMicrobatch(batch, planned.weight, planned.last, tuple(planned), planned.rank, planned.step,
                                 planned.predicted_bytes, planned.padding, planned.correction_bytes,
                                 planned.position)


def data_loader(dataset, sampler: PredictiveBatchSampler, collate_fn: Optional[Callable] = None,
                **dataloader_kwargs) -> DataLoader:
    """A ``DataLoader`` of every rank's microbatches that ``Accelerator.prepare`` deals right: each
    process gets exactly its rank's microbatches, as ``PlannedMicrobatch`` items. Check the
    prepared loader with ``check_prepared`` (``prepare_data_loader`` does both).

    Args:
        dataset: a map-style dataset (``dataset[i]`` is record ``i`` of the sampler's records).
        sampler: this process's ``xpm.PredictiveBatchSampler`` (rank and world size of the run).
        collate_fn: makes a batch of a list of records (default: ``default_collate``); a rank left
            without records for a step gets an empty list, weight 0, and must still backward a
            zero loss over the model's parameters so the step's all-reduce matches.
        **dataloader_kwargs: other ``DataLoader`` arguments (``num_workers``, ``pin_memory``, ...).

    Returns:
        the ``DataLoader`` to hand to ``Accelerator.prepare``.

    Raises:
        ValueError: an iterable dataset, or ``dataloader_kwargs`` that choose the batching.
    """
    if isinstance(dataset, IterableDataset):
        raise ValueError("dataset must be map-style (dataset[i]), got an IterableDataset: xpm's plan names records "
                         "by index")
    for key in ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"):
        if key in dataloader_kwargs:
            raise ValueError(f"{key} is set by xpm's sampler: leave it out of data_loader's arguments")
    round_robin = RoundRobinMicrobatches(sampler)
    return DataLoader(_PlannedDataset(dataset, round_robin), batch_sampler=round_robin,
                      collate_fn=_PlannedCollate(collate_fn), **dataloader_kwargs)


def _check_processes(accelerator: "accelerate.Accelerator", where: str) -> None:
    """Raises ValueError, naming ``where``, when torch.distributed runs more ranks than
    ``accelerator`` knows of (torchrun without a GPU and without ``Accelerator(cpu=True)``:
    accelerate then sets up no distributed run and each process would train alone)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    ranks = torch.distributed.get_world_size()
    if ranks != accelerator.num_processes:
        raise ValueError(f"{where}: the accelerator runs {accelerator.num_processes} process(es) but torch.distributed "
                         f"has {ranks} ranks, so accelerate set up no distributed run; without GPUs build it with "
                         f"accelerate.Accelerator(cpu=True)")


def _check_accelerator(accelerator: "accelerate.Accelerator", rank: int, world_size: int) -> None:
    _check_processes(accelerator, "xpm.integrations.accelerate")
    if accelerator.num_processes != world_size:
        raise ValueError(f"the sampler's world_size {world_size} differs from the accelerator's "
                         f"{accelerator.num_processes} processes: build the sampler with "
                         f"world_size=accelerator.num_processes, rank=accelerator.process_index")
    if accelerator.process_index != rank:
        raise ValueError(f"the sampler's rank {rank} differs from the accelerator's process_index "
                         f"{accelerator.process_index}: build the sampler with rank=accelerator.process_index")
    if accelerator.gradient_accumulation_steps != 1:
        raise ValueError(f"Accelerator(gradient_accumulation_steps={accelerator.gradient_accumulation_steps}): xpm's "
                         f"microbatch weights already accumulate an outer batch; use gradient_accumulation_steps=1")
    if accelerator.split_batches:
        raise ValueError("Accelerator split_batches=True would cut every microbatch among the processes: use "
                         "DataLoaderConfiguration(split_batches=False)")
    if accelerator.dispatch_batches:
        raise ValueError("Accelerator dispatch_batches=True would send process 0's batches to every process: use "
                         "DataLoaderConfiguration(dispatch_batches=False)")


def _round_robin_of(loader) -> RoundRobinMicrobatches:
    batch_sampler = getattr(loader, "batch_sampler", None)
    inner = getattr(batch_sampler, "batch_sampler", None)
    for candidate in (batch_sampler, inner):
        if isinstance(candidate, RoundRobinMicrobatches):
            return candidate
    if isinstance(batch_sampler, PredictiveBatchSampler) or isinstance(inner, PredictiveBatchSampler):
        raise ValueError(f"this loader deals xpm.PredictiveBatchSampler's microbatches as plain batches: {_HOW_TO}")
    raise ValueError(f"loader is not one of xpm.integrations.accelerate.data_loader (its batch sampler is a "
                     f"{type(batch_sampler).__name__}): {_HOW_TO}")


def check_prepared(accelerator: "accelerate.Accelerator", loader) -> RoundRobinMicrobatches:
    """Checks that ``loader`` (``Accelerator.prepare`` of ``data_loader(...)``) deals each process
    exactly its rank's microbatches: one process per rank, a ``BatchSamplerShard`` (or, on one
    process, the round-robin sampler itself) with this process's index and count, no split or
    dispatched batches, and as many microbatches per process as the plan.

    Args:
        accelerator: the ``accelerate.Accelerator`` that prepared ``loader``.
        loader: the prepared loader.

    Returns:
        the loader's ``RoundRobinMicrobatches``.

    Raises:
        ValueError: one line naming the setting that would shard twice, drop or repeat records.
    """
    round_robin = _round_robin_of(loader)
    _check_accelerator(accelerator, round_robin.rank, round_robin.world_size)
    if isinstance(loader, accelerate_data_loader.DataLoaderDispatcher):
        raise ValueError("accelerate dispatches this loader's batches from process 0: use "
                         "DataLoaderConfiguration(dispatch_batches=False)")
    shard = loader.batch_sampler
    if isinstance(shard, accelerate_data_loader.BatchSamplerShard):
        if shard.num_processes != round_robin.world_size or shard.process_index != round_robin.rank:
            raise ValueError(f"accelerate deals this loader as process {shard.process_index} of {shard.num_processes}, "
                             f"the sampler plans rank {round_robin.rank} of {round_robin.world_size}: build the "
                             f"sampler with rank=accelerator.process_index, world_size=accelerator.num_processes "
                             f"(no device mesh)")
        if shard.split_batches:
            raise ValueError("accelerate splits this loader's batches among the processes: use "
                             "DataLoaderConfiguration(split_batches=False)")
    elif round_robin.world_size != 1 or shard is not round_robin:
        raise ValueError(f"accelerate did not deal this loader among {round_robin.world_size} processes: pass it "
                         f"through Accelerator.prepare on every process")
    dealt, planned = len(loader), round_robin.microbatches_per_process()
    if dealt != planned:
        raise ValueError(f"accelerate deals {dealt} microbatches to this process, the plan has {planned}: use "
                         f"even_batches=True or False with this loader unchanged (no drop_last, no skip_first_batches)")
    return round_robin


def prepare_data_loader(accelerator: "accelerate.Accelerator", dataset, sampler: PredictiveBatchSampler,
                        collate_fn: Optional[Callable] = None, **dataloader_kwargs) -> DataLoader:
    """``Accelerator.prepare`` of ``data_loader(dataset, sampler, collate_fn, ...)``, checked
    (``check_prepared``): each process is dealt exactly its rank's microbatches.

    Args:
        accelerator: the run's ``accelerate.Accelerator`` (``gradient_accumulation_steps=1``).
        dataset: a map-style dataset of the sampler's records.
        sampler: this process's ``xpm.PredictiveBatchSampler``, built with
            ``rank=accelerator.process_index, world_size=accelerator.num_processes``.
        collate_fn: a batch of a list of records (default ``default_collate``).
        **dataloader_kwargs: other ``DataLoader`` arguments.

    Returns:
        the prepared loader: iterate it with ``microbatch_loop``; ``loader.set_epoch(epoch)``
        starts an epoch (accelerate also counts them itself, one per iteration).

    Raises:
        ValueError: one line naming the setting to change, for a set-up that would shard twice,
            drop or repeat records, or weigh the gradient wrong.
    """
    _check_accelerator(accelerator, *_rank_and_world(sampler))  # before accelerate builds anything
    prepared = accelerator.prepare(data_loader(dataset, sampler, collate_fn, **dataloader_kwargs))
    check_prepared(accelerator, prepared)
    return prepared


def microbatch_loop(loader, *, meter: Optional[Meter] = None) -> Iterator[PlannedMicrobatch]:
    """This process's microbatches of the prepared ``loader``, padding skipped; checks that each
    was planned for this process, and marks the sampler's step done when it hands out the step's
    last microbatch (so the sampler's ``state_dict()`` after that optimizer step resumes at the next).

    Args:
        loader: ``prepare_data_loader``'s loader (or ``Accelerator.prepare`` of ``data_loader``).
        meter: the meter the model was probed under (default: the one ``prepare`` planned
            with, for its loader); given, with the sampler's calibration on
            and its lockstep packing (the default at world size > 1, or one process), every
            microbatch's peak is measured (the meter's peak reset before it is handed out, read
            when the caller asks for the next one, before accelerate reads a batch further
            ahead) and fed to the calibration, which after each step's last
            microbatch agrees the correction over the ranks (one all-reduce; every process) and
            plans the steps accelerate has not yet read anew.

    Yields:
        ``PlannedMicrobatch`` items, in the plan's order.

    Raises:
        ValueError: ``loader`` is not one of this module's loaders; ``meter`` with a sampler
            that packs without lockstep at more than one process (its steps are dealt from a
            plan made at the start of the epoch, which the calibration would change under it).
        RuntimeError: accelerate dealt this process a microbatch planned for another rank; an
            optimizer steps (any ``torch.optim`` optimizer, before its step: the parameters are
            unchanged) after a microbatch that does not end its step, as under
            ``accelerator.accumulate(model)`` in place of ``accumulate``.
    """
    round_robin = _round_robin_of(loader)
    sampler = round_robin.predictive_sampler
    meter = round_robin.meter if meter is None else meter
    measuring = meter is not None and sampler.calibration is not None
    if measuring and not sampler.lockstep and sampler.world_size > 1:
        raise ValueError("microbatch_loop(..., meter=...) calibrates the plans, which needs the sampler's lockstep "
                         "packing at more than one process: build it with lockstep=True (the default) or "
                         "calibrate=False")
    process_index = accelerate.PartialState().process_index
    handed_out: List[PlannedMicrobatch] = []
    guard = register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: _refuse_step_within(handed_out))
    try:
        for microbatch in loader:
            if microbatch.rank != process_index:
                raise RuntimeError(f"process {process_index} was dealt rank {microbatch.rank}'s microbatch (step "
                                   f"{microbatch.step}): the loader was re-sharded after preparation; {_HOW_TO}")
            if microbatch.padding:
                continue
            if microbatch.last:
                sampler.mark_step_done()
            if measuring:
                start_peak(meter)
            handed_out[:] = [microbatch]
            yield microbatch
            if measuring:  # trained: measured before accelerate reads (and moves) the next batch ahead
                _measured(sampler, round_robin, microbatch, meter)
    finally:
        guard.remove()


def _refuse_step_within(handed_out: List[PlannedMicrobatch]) -> None:
    """Before any optimizer steps while ``microbatch_loop`` runs: refused after a microbatch that
    does not end its step (the outer batch would be stepped microbatch by microbatch)."""
    if handed_out and not handed_out[0].last:
        microbatch = handed_out[0]
        raise RuntimeError(f"microbatch_loop: the optimizer stepped after a microbatch of step {microbatch.step} that "
                           "is not its last, so the outer batch would be stepped microbatch by microbatch "
                           "(accelerator.accumulate(model) does that at gradient_accumulation_steps=1): train each "
                           "microbatch under xpm.integrations.accelerate.accumulate(accelerator, model, microbatch), "
                           "or step only after microbatch.last")


def _measured(sampler: PredictiveBatchSampler, round_robin: RoundRobinMicrobatches, microbatch: PlannedMicrobatch,
              meter: Meter) -> None:
    """Feeds a trained microbatch's peak to the calibration; after a step's last, ends the step
    (collective) with the steps accelerate has read kept as they were planned."""
    sampler.record_microbatch_peak(microbatch.indices, microbatch.predicted_bytes, meter, microbatch.position)
    if microbatch.last:
        sampler.end_step(microbatch.step, replan_from=round_robin.taken_step + 1)


@contextlib.contextmanager
def accumulate(accelerator: "accelerate.Accelerator", model: torch.nn.Module, microbatch: PlannedMicrobatch):
    """Gradient accumulation over one optimizer step's microbatches: the backward of a step's last
    microbatch all-reduces, the others run under ``accelerator.no_sync(model)``; sets
    ``accelerator.sync_gradients`` to ``microbatch.last``, so the prepared optimizer's ``step()``
    and ``zero_grad()`` act only at the end of the step (as in ``Accelerator.accumulate``).

    Args:
        accelerator: the run's ``accelerate.Accelerator`` (``gradient_accumulation_steps=1``:
            the microbatch weights do the accumulation).
        model: the prepared model.
        microbatch: the ``PlannedMicrobatch`` whose backward runs inside.

    Raises:
        ValueError: ``gradient_accumulation_steps`` other than 1, or a padding microbatch.
    """
    if accelerator.gradient_accumulation_steps != 1:
        raise ValueError(f"Accelerator(gradient_accumulation_steps={accelerator.gradient_accumulation_steps}) divides "
                         f"every loss again: use gradient_accumulation_steps=1 with xpm's weights")
    if microbatch.padding:
        raise ValueError("a padding microbatch has nothing to train: skip it (microbatch_loop does)")
    accelerator.sync_gradients = bool(microbatch.last)
    with contextlib.nullcontext() if microbatch.last else accelerator.no_sync(model):
        yield


def __getattr__(attribute: str) -> Any:
    """``prepare``, the one-call planning built on this module, read from ``accelerate_planning``
    when first asked for (importing it here at once would make
    ``import xpm.integrations.accelerate_planning`` circular)."""
    if attribute == "prepare":
        from .accelerate_planning import prepare
        return prepare
    raise AttributeError(f"module {__name__!r} has no attribute {attribute!r}")
