"""``PlannedStep``: one optimizer step of one rank, the item of the step loaders of the HF Trainer
(``xpm.integrations.hf_trainer``) and Lightning (``xpm.integrations.lightning``) integrations.

It imports without torch (``pin_memory`` imports it when a DataLoader calls it).
"""
from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any, Dict, List, Optional, Sequence, Tuple

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
        weights: the factor of each microbatch's mean loss, ``world_size * units(microbatch) /
            units(outer batch)`` (the sampler's ``Microbatch.weight``; over every rank's
            microbatches they sum to ``world_size``, as DDP averages the ranks' gradients).
        placeholder: True when this rank's share of the outer batch is empty and ``microbatches``
            holds a stand-in batch (record 0, weight 0) whose loss is multiplied by 0, so the rank
            still joins the step's gradient all-reduce (the HF Trainer's loader). Lightning's
            loader leaves an empty share empty instead: no microbatch, ``placeholder`` False.
        predicted_bytes: each microbatch's predicted peak, for the sampler's calibration (empty
            for a placeholder).
        correction_bytes: each microbatch's correction, as the calibration planned the step
            (``predicted_bytes[k] + correction_bytes[k]`` is within the budget); by default 0
            for each predicted peak.

    The loaders build it; a user's code reads it (treat it as read-only). It is true even with
    no microbatch (an empty share under Lightning).

    Raises:
        TypeError: an argument of the wrong type (named): ``microbatches``, ``records`` or a
            record not a sequence (a dict, a string or a tensor is refused), a record index or a
            count not an int.
        ValueError: a count out of range (``world_size`` < 1, ``rank`` not in [0, world_size),
            a negative ``epoch``, ``index`` or record index), a weight or byte count negative or
            not finite, ``microbatches``, ``records`` and ``weights`` of different lengths,
            ``predicted_bytes`` neither empty nor one per microbatch, ``correction_bytes`` not as
            long as ``predicted_bytes``, or a placeholder with predictions.
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
        self.epoch, self.index = _count(epoch, "epoch"), _count(index, "index")
        self.world_size, self.rank = _count(world_size, "world_size", 1), _count(rank, "rank")
        if self.rank >= self.world_size:
            raise ValueError(f"PlannedStep: rank must be in [0, world_size) = [0, {self.world_size}), got {self.rank}")
        self.microbatches = list(_sequence(microbatches, "microbatches"))
        self.records = [_record(r, f"records[{k}]") for k, r in enumerate(_sequence(records, "records"))]
        self.weights = _amounts(weights, "weights", may_be_negative=False)
        if not isinstance(placeholder, bool):
            raise TypeError(f"PlannedStep: placeholder must be a bool, got {placeholder!r}")
        self.placeholder = placeholder
        self.predicted_bytes = _amounts(predicted_bytes, "predicted_bytes", may_be_negative=False)
        self.correction_bytes = ([0.0] * len(self.predicted_bytes) if correction_bytes is None
                                 else _amounts(correction_bytes, "correction_bytes", may_be_negative=True))
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

    def __bool__(self) -> bool:
        """Always true: a step without microbatches (an empty share) is still a step."""
        return True

    def __getstate__(self) -> Dict[str, Any]:
        """Its fields (pickling with any protocol, copying)."""
        return {name: getattr(self, name) for name in self.__slots__}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self, name, value)

    def pin_memory(self) -> "PlannedStep":
        """The step, its microbatches' tensors pinned (a DataLoader with ``pin_memory=True`` calls it)."""
        from torch.utils.data._utils.pin_memory import pin_memory

        self.microbatches = [pin_memory(batch) for batch in self.microbatches]
        return self

    def __repr__(self) -> str:
        return (f"PlannedStep(epoch={self.epoch}, index={self.index}, rank={self.rank}/{self.world_size}, "
                f"microbatches={len(self.microbatches)}, records={self.record_count}"
                f"{', placeholder' if self.placeholder else ''})")


def _count(value: Any, name: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"PlannedStep: {name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"PlannedStep: {name} must be >= {minimum}, got {value}")
    return int(value)


def _is_list(value: Any) -> bool:
    """A list, tuple or range: not a string, a mapping (a collated dict) nor a tensor."""
    return isinstance(value, (list, tuple, range))


def _sequence(value: Any, name: str) -> Sequence[Any]:
    if not _is_list(value):
        raise TypeError(f"PlannedStep: {name} must be a list or tuple (one entry per microbatch), got "
                        f"{type(value).__name__}")
    return value


def _record(value: Any, name: str) -> Tuple[int, ...]:
    if not _is_list(value):
        raise TypeError(f"PlannedStep: {name} must be a sequence of record indices (ints >= 0), got {value!r}")
    return tuple(_count(i, f"{name}[{k}]") for k, i in enumerate(value))


def _amounts(values: Any, name: str, may_be_negative: bool) -> List[float]:
    out = []
    for k, value in enumerate(_sequence(values, name)):
        if isinstance(value, bool) or not isinstance(value, Real):
            raise TypeError(f"PlannedStep: {name}[{k}] must be a number, got {value!r}")
        if not math.isfinite(value) or (value < 0 and not may_be_negative):
            raise ValueError(f"PlannedStep: {name}[{k}] must be a finite number"
                             f"{'' if may_be_negative else ' >= 0'}, got {value}")
        out.append(float(value))
    return out


def _check_lengths(step: PlannedStep) -> None:
    counts = (len(step.microbatches), len(step.records), len(step.weights))
    if len(set(counts)) != 1:
        raise ValueError(f"PlannedStep: microbatches, records and weights must be as long as each other, got "
                         f"{counts[0]}, {counts[1]} and {counts[2]}")
    if step.predicted_bytes and len(step.predicted_bytes) != counts[0]:
        raise ValueError(f"PlannedStep: predicted_bytes must be empty or one per microbatch ({counts[0]}), got "
                         f"{len(step.predicted_bytes)}")
    if step.placeholder and step.predicted_bytes:
        raise ValueError("PlannedStep: a placeholder has no predicted_bytes (its stand-in batch is not planned)")
    if len(step.correction_bytes) != len(step.predicted_bytes):
        raise ValueError(f"PlannedStep: correction_bytes must be as long as predicted_bytes, got "
                         f"{len(step.correction_bytes)} and {len(step.predicted_bytes)}")
