"""``PlannedStep``: one optimizer step of one rank, the item of the step loaders of the HF Trainer
(``xpm.integrations.hf_trainer``) and Lightning (``xpm.integrations.lightning``) integrations.

It imports without torch (``pin_memory`` imports it when a DataLoader calls it).
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

__all__ = ["PlannedStep"]


class PlannedStep:
    """One optimizer step of one rank: its microbatches, collated, with their records and weights.

    The item of ``PlannedTrainer``'s train loader and of Lightning's ``planned_dataloader``. A
    plain object with ``__slots__``, neither a dataclass nor a collection: Lightning's batch
    transfer and accelerate's ``send_to_device`` hand it to the training step as it is, and each
    microbatch is moved to the device just before its forward, so only one microbatch's inputs
    are there at a time. Picklable (DataLoader workers send it to the main process);
    ``pin_memory()`` pins its microbatches (a DataLoader with ``pin_memory=True`` calls it).

    Attributes:
        epoch: the epoch it was planned for (the sampler's).
        index: the step's index in the epoch, 0-based (the same step index on every rank).
        rank: the rank whose share of the outer batch it is.
        world_size: the ranks sharing the outer batch.
        microbatches: the collated microbatches (``collate_fn`` of their records), in order.
        records: each microbatch's dataset indices, a tuple of ints per microbatch.
        weights: each microbatch's loss weight (its share of the outer batch's loss units).
        placeholder: True when this rank's share of the outer batch is empty and ``microbatches``
            holds a stand-in batch (record 0, weight 0) whose loss is multiplied by 0, so the rank
            still joins the step's gradient all-reduce (the HF Trainer's loader). Lightning's
            loader leaves an empty share empty instead: no microbatch, ``placeholder`` False.
        predicted_bytes: each microbatch's predicted peak, for the sampler's calibration (empty
            for a placeholder).
        correction_bytes: each microbatch's correction, as the calibration planned the step
            (``predicted_bytes[k] + correction_bytes[k]`` is within the budget); by default 0
            for each predicted peak.

    Raises:
        ValueError: ``microbatches``, ``records`` and ``weights`` differ in length, or
            ``correction_bytes`` is not as long as ``predicted_bytes``.
    """

    __slots__ = ("epoch", "index", "rank", "world_size", "microbatches", "records", "weights", "placeholder",
                 "predicted_bytes", "correction_bytes")
    epoch: int
    index: int
    rank: int
    world_size: int
    microbatches: List[Any]
    records: List[Tuple[int, ...]]
    weights: List[float]
    placeholder: bool
    predicted_bytes: List[float]
    correction_bytes: List[float]

    def __init__(self, epoch: int, index: int, rank: int, world_size: int, microbatches: Sequence[Any],
                 records: Sequence[Sequence[int]], weights: Sequence[float], placeholder: bool = False,
                 predicted_bytes: Sequence[float] = (), correction_bytes: Optional[Sequence[float]] = None) -> None:
        self.epoch, self.index, self.rank, self.world_size = int(epoch), int(index), int(rank), int(world_size)
        self.microbatches = list(microbatches)
        self.records = [tuple(int(i) for i in r) for r in records]
        self.weights = [float(w) for w in weights]
        self.placeholder = bool(placeholder)
        self.predicted_bytes = [float(b) for b in predicted_bytes]
        self.correction_bytes = ([0.0] * len(self.predicted_bytes) if correction_bytes is None
                                 else [float(b) for b in correction_bytes])
        _check_lengths(self)

    @property
    def batches(self) -> List[Tuple[Any, float]]:
        """``[(microbatch, weight), ...]`` (the Lightning integration's earlier field)."""
        return list(zip(self.microbatches, self.weights))

    @property
    def indices(self) -> List[List[int]]:
        """Each microbatch's dataset indices as a list (``records`` as lists)."""
        return [list(r) for r in self.records]

    @property
    def record_count(self) -> int:
        """Records of this rank's share: 0 for a placeholder."""
        return 0 if self.placeholder else sum(len(r) for r in self.records)

    def __len__(self) -> int:
        """The number of microbatches."""
        return len(self.microbatches)

    def pin_memory(self) -> "PlannedStep":
        """The step, its microbatches' tensors pinned (a DataLoader with ``pin_memory=True`` calls it)."""
        from torch.utils.data._utils.pin_memory import pin_memory

        self.microbatches = [pin_memory(batch) for batch in self.microbatches]
        return self

    def __repr__(self) -> str:
        return (f"PlannedStep(epoch={self.epoch}, index={self.index}, rank={self.rank}/{self.world_size}, "
                f"microbatches={len(self.microbatches)}, records={self.record_count}"
                f"{', placeholder' if self.placeholder else ''})")


def _check_lengths(step: PlannedStep) -> None:
    counts = (len(step.microbatches), len(step.records), len(step.weights))
    if len(set(counts)) != 1:
        raise ValueError(f"PlannedStep: microbatches, records and weights must be as long as each other, got "
                         f"{counts[0]}, {counts[1]} and {counts[2]}")
    if len(step.correction_bytes) != len(step.predicted_bytes):
        raise ValueError(f"PlannedStep: correction_bytes must be as long as predicted_bytes, got "
                         f"{len(step.correction_bytes)} and {len(step.predicted_bytes)}")
