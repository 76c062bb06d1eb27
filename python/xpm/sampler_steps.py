"""What ``PredictiveBatchSampler`` hands out: ``Microbatch`` (a microbatch's record indices with
its plan's figures, what ``iter(sampler)`` yields) and ``Step`` (one optimizer step of a rank,
what ``sampler.steps()`` yields), and where each step begins among an epoch's microbatches.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, List, Optional, Sequence, Tuple

import numpy as np

from .choices import MicrobatchPosition, microbatch_position


class Microbatch(list):
    """The record indices of one microbatch (a ``list`` of ``int``, what
    ``DataLoader(batch_sampler=...)`` expects), with the plan's figures as attributes.

    Attributes:
        dims: the formula's variables for the padded microbatch (``np.ndarray`` [variables],
            in the formula's order; zeros for an empty microbatch).
        predicted_bytes: ``model.predict(dims)``, the predicted peak in bytes (a step's first
            microbatch: the model's "without_gradients" phase, with the sampler's
            ``gradients_set_to_none``, without the floor when the step has several microbatches
            (no optimizer step runs in it); its last, with it too: the "synchronised" phase where the
            model has one, FSDP2's accumulation probed in lockstep).
        weight: the factor of the microbatch's mean loss (``world_size * units(microbatch) /
            units(outer batch)``; 0 for an empty microbatch).
        last: whether the microbatch ends its optimizer step.
        step: the index of its optimizer step in the epoch.
        correction_bytes: the calibration's correction of its prediction, as its step was
            planned (``predicted_bytes + correction_bytes <= usable_bytes``; 0 without
            calibration): its position's line (``xpm.Correction``).
        position: its ``MicrobatchPosition`` among its step's microbatches with records
            ("first", "middle", "last" or "alone"; None for an empty one).

    Args:
        indices: the record indices.
        dims: see Attributes.
        predicted_bytes: see Attributes.
        weight: see Attributes.
        last: see Attributes.
        step: see Attributes.
        correction_bytes: see Attributes.
        position: see Attributes.
    """

    dims: np.ndarray
    predicted_bytes: float
    weight: float
    last: bool
    step: int
    correction_bytes: float
    position: Optional[MicrobatchPosition]

    def __init__(self, indices: Iterable[int], *, dims: np.ndarray, predicted_bytes: float, weight: float,
                 last: bool, step: int, correction_bytes: float = 0.0,
                 position: Optional[MicrobatchPosition] = None) -> None:
        super().__init__(indices)
        self.dims, self.predicted_bytes = dims, predicted_bytes
        self.weight, self.last, self.step = weight, last, step
        self.correction_bytes, self.position = correction_bytes, position

    def __repr__(self) -> str:
        """The indices and the plan's figures, one line."""
        return (f"Microbatch({list.__repr__(self)}, step={self.step}, weight={self.weight:.6g}, last={self.last}, "
                f"dims={self.dims.tolist()}, predicted_bytes={self.predicted_bytes:.0f})")


@dataclass
class Step:
    """One optimizer step of this rank.

    Attributes:
        microbatches: record index arrays (int64) into the dataset, one per microbatch.
        weights: the weight of each microbatch's mean loss (``Microbatch.weight``).
        units: the whole outer batch's units (all ranks).
        dims: each microbatch's planned dims (``np.ndarray`` [variables]).
        predicted_bytes: each microbatch's predicted peak bytes (``Microbatch.predicted_bytes``:
            ``model.predict(dims)``, the first and last microbatch in their gradient phases).
        correction_bytes: each microbatch's correction, as the step was planned with the
            calibration (``predicted_bytes + correction_bytes <= usable_bytes``).
        positions: each microbatch's ``MicrobatchPosition`` among those with records (None
            for an empty one; ``positions_with_records``), worked out once when not given.
    """

    microbatches: List[np.ndarray]
    weights: List[float]
    units: float
    dims: List[np.ndarray] = field(default_factory=list)
    predicted_bytes: List[float] = field(default_factory=list)
    correction_bytes: List[float] = field(default_factory=list)
    positions: List[Optional[MicrobatchPosition]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.positions:
            self.positions = positions_with_records(self.microbatches)

    def nonempty_microbatches(self) -> Tuple[List[Tuple[int, ...]], List[float], List[float], List[float]]:
        """The microbatches that hold records (lockstep pads a share with empty ones), as the
        step loaders hand them out (``xpm.PlannedStep``'s fields).

        Returns:
            ``(records, weights, predicted_bytes, correction_bytes)``: each such microbatch's
            record indices (a tuple of ints), weight, prediction and correction, in order.
        """
        kept = [(tuple(int(i) for i in np.asarray(mb, dtype=np.int64).reshape(-1)), float(w), float(p), float(c))
                for mb, w, p, c in zip(self.microbatches, self.weights, self.predicted_bytes, self.correction_bytes)
                if len(mb) > 0]
        return ([k[0] for k in kept], [k[1] for k in kept], [k[2] for k in kept], [k[3] for k in kept])



def positions_with_records(microbatches: Sequence[Sequence[int]]) -> List[Optional[MicrobatchPosition]]:
    """Each microbatch's position among those with records (what the calibration's lines are
    drawn by; lockstep's empty microbatches have none).

    Args:
        microbatches: a step's microbatches (record indices), in order.

    Returns:
        Per microbatch its ``MicrobatchPosition``, or None for an empty one.
    """
    kept = [j for j, mb in enumerate(microbatches) if len(mb) > 0]
    positions: List[Optional[MicrobatchPosition]] = [None] * len(microbatches)
    for k, j in enumerate(kept):
        positions[j] = microbatch_position(k, len(kept))
    return positions


def step_offsets(steps: List[Step]) -> List[int]:
    """Where each step begins among the epoch's microbatches.

    Args:
        steps: the epoch's steps, in order.

    Returns:
        ``offsets``: ``offsets[k]``, the microbatches before step k; ``offsets[-1]``, the epoch's.
    """
    return np.concatenate([[0], np.cumsum([len(s.microbatches) for s in steps], dtype=np.int64)]).astype(int).tolist()
