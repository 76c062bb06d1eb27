"""The step loader of ``PlannedTrainer``: a ``DataLoader`` with one item per optimizer step (an
``xpm.PlannedStep``, the step's collated microbatches), the batch sampler of the steps that draws
them from ``PredictiveBatchSampler.steps()``, and what the trainer reports after each microbatch
(``MicrobatchRecord``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, List, Mapping, Optional, Tuple

import torch

from ..choices import MicrobatchPosition
from ..planned_step import PlannedStep
from ..sampler import PredictiveBatchSampler


@dataclass(frozen=True)
class _StepKey:
    """What the batch sampler hands the DataLoader for one step (small, picklable for workers)."""

    epoch: int
    index: int
    rank: int
    world_size: int
    microbatches: Tuple[Tuple[int, ...], ...]
    weights: Tuple[float, ...]
    placeholder: bool
    predicted_bytes: Tuple[float, ...] = ()
    correction_bytes: Tuple[float, ...] = ()


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
        position: its ``MicrobatchPosition`` in its step ("first", "middle", "last", "alone"),
            whose calibration line ``correction_bytes`` is (None for a placeholder).
    """

    step: int
    epoch: int
    records: Tuple[int, ...]
    peak_allocated_bytes: Optional[int]
    placeholder: bool
    predicted_bytes: Optional[float] = None
    correction_bytes: float = 0.0
    position: Optional[MicrobatchPosition] = None


class _StepDataset(torch.utils.data.Dataset):
    """Item ``_StepKey``: the step's microbatches collated (runs in the DataLoader's workers)."""

    def __init__(self, dataset, collate_fn: Callable):
        self.dataset, self.collate_fn = dataset, collate_fn

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: _StepKey) -> PlannedStep:
        batches = [self.collate_fn([self.dataset[i] for i in microbatch]) for microbatch in key.microbatches]
        return PlannedStep(key.epoch, key.index, key.rank, key.world_size, batches, key.microbatches, key.weights,
                           key.placeholder, key.predicted_bytes, key.correction_bytes)


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
        rank, world = int(sampler.rank), int(sampler.world_size)
        for index, step in enumerate(sampler.steps()):
            records, weights, predicted, corrections = step.nonempty_microbatches()
            if records:
                yield [_StepKey(self.epoch, index, rank, world, tuple(records), tuple(weights), False, tuple(predicted),
                                tuple(corrections))]
            else:  # this rank's share is empty: one zero-weight batch of record 0 joins the all-reduce
                yield [_StepKey(self.epoch, index, rank, world, ((0,),), (0.0,), True)]


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
