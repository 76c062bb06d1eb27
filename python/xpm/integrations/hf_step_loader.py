"""The step loader of ``PlannedTrainer``: a ``DataLoader`` with one item per optimizer step (a
``PlannedStep``, the step's collated microbatches), the batch sampler of the steps that draws them
from ``PredictiveBatchSampler.steps()``, and what the trainer reports after each microbatch
(``MicrobatchRecord``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, List, Mapping, Optional, Tuple

import numpy as np
import torch

from ..sampler import PredictiveBatchSampler


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
