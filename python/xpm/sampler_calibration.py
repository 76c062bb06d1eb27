"""The sampler's calibration glue: the ``xpm.Calibration`` it starts with, the correction each
step of an epoch is planned with (a list of ``(first step, correction)``), the budget that leaves
its predictions, the first step a changed correction can still replan, and the corrections'
part of the sampler's ``state_dict``.
"""
from __future__ import annotations

import math

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from .calibration import Calibration, Correction
from .choices import MICROBATCH_POSITIONS
from .memory_model import MemoryModel

if TYPE_CHECKING:
    from .sampler_pass import _MicrobatchIterator

Corrections = List[Tuple[int, Correction]]
"""The corrections an epoch's steps are planned with: ``(first step, correction)``, in order."""


def new_calibration(usable_bytes: int, model: MemoryModel, calibrate: bool) -> Optional[Calibration]:
    """The sampler's calibration, from the model's ``reserved_gap`` where it was probed under a
    caching allocator (plans start from its reserved bytes).

    Args:
        usable_bytes: the budget.
        model: the memory model.
        calibrate: whether to calibrate.

    Returns:
        The calibration, or None when ``calibrate`` is False.
    """
    gap = model.reserved_gap
    if not calibrate:
        return None
    # Reserved bytes move by whole segments from step to step: lowered only once settled.
    return Calibration(usable_bytes, initial=None if gap is None else Correction(*gap), lower_early=gap is None)


def correction_in_force(corrections: Corrections, step: int) -> Correction:
    """The correction step ``step`` is planned with.

    Args:
        corrections: the epoch's corrections.
        step: the step's index in the epoch.

    Returns:
        The last correction whose first step is at most ``step``.
    """
    return [c for first, c in corrections if first <= step][-1]


def planning_bytes(correction: Correction, usable_bytes: int) -> int:
    """What a step's predictions must fit: the budget less its correction (at least 1 byte).

    Args:
        correction: the step's correction.
        usable_bytes: the budget.

    Returns:
        Bytes.
    """
    return max(1, int(correction.planning_bytes(usable_bytes)))


def corrections_from(corrections: Corrections, first: int, correction: Correction) -> Corrections:
    """The corrections with steps ``first`` on planned with ``correction``.

    Args:
        corrections: the epoch's corrections.
        first: the first step of the new correction.
        correction: the new correction.

    Returns:
        The new list.
    """
    return [c for c in corrections if c[0] < first] + [(first, correction)]


def first_step_not_handed_out(step: int, offsets: List[int], current: Optional[_MicrobatchIterator]) -> int:
    """The first step after ``step`` whose microbatches the sampler's pass under way has not yet
    handed out any of.

    Args:
        step: the step just ended.
        offsets: the epoch's step offsets (``sampler_steps.step_offsets``).
        current: the sampler's latest pass, or None.

    Returns:
        The step's index in the epoch.
    """
    first = step + 1
    if current is not None and current._is_current() and current.position < offsets[-1]:
        k, j = current.locate(current.position)
        first = max(first, k if j == 0 else k + 1)
    return first


def calibration_state(corrections: Corrections, calibration: Optional[Calibration]) -> Dict[str, Any]:
    """The corrections' part of a ``state_dict`` (plain values).

    Args:
        corrections: the epoch's corrections.
        calibration: the sampler's calibration, or None.

    Returns:
        ``{"corrections": [[step, intercept_bytes, slope, {position: [intercept_bytes, slope,
        low_bytes, high_bytes]}], ...], "calibration": its state or None}``.
    """
    return {"corrections": [[first, c.intercept_bytes, c.slope, {p[0]: list(p[1:]) for p in c.positions}]
                            for first, c in corrections],
            "calibration": None if calibration is None else calibration.state_dict()}


def loaded_corrections(state: Dict[str, Any], what: str, calibration: Optional[Calibration],
                       steps_per_epoch: int) -> Corrections:
    """The corrections each step was planned with, read from ``state``, and the calibration's
    window loaded into ``calibration`` (states written before calibration existed have neither:
    the plan of the model alone).

    Args:
        state: a ``state_dict`` of the sampler or of its iterator.
        what: the state's name, for the errors.
        calibration: the sampler's calibration, or None.
        steps_per_epoch: the epoch's steps (a correction drawn at the last step is planned from
            the step after it: at most this).

    Returns:
        The corrections.

    Raises:
        ValueError: malformed corrections, or their first steps not whole numbers from 0,
            increasing, at most ``steps_per_epoch``.
    """
    corrections = state.get("corrections", [[0, 0.0, 0.0]])
    try:  # [step, intercept bytes, slope, {position: line}], [step, intercept bytes, slope], or [step, bytes]
        loaded = [(entry[0], _correction_of(entry[1:])) for entry in corrections]
    except (TypeError, ValueError, KeyError, IndexError):
        raise ValueError(f"{what} corrections must be [[step, intercept_bytes, slope, {{position: [intercept_bytes, "
                         f"slope, low_bytes, high_bytes]}}], ...], got {corrections!r}") from None
    firsts = [first for first, _ in loaded]
    if not firsts or any(isinstance(f, bool) or not isinstance(f, int) for f in firsts) or firsts[0] != 0 or \
            any(b <= a for a, b in zip(firsts, firsts[1:])) or firsts[-1] > steps_per_epoch:
        raise ValueError(f"{what} corrections' first steps must be whole numbers from 0, increasing, at most the "
                         f"epoch's {steps_per_epoch} steps; got {firsts!r:.120}")
    if calibration is not None and state.get("calibration") is not None:
        calibration.load_state_dict(state["calibration"])
    return loaded


def _correction_of(entry: List[Any]) -> Correction:
    """A ``Correction`` from ``[intercept_bytes, slope, {position: [intercept_bytes, slope,
    low_bytes, high_bytes]}]`` (the positions and the slope optional). Raises ValueError when
    malformed."""
    if not 1 <= len(entry) <= 3:
        raise ValueError
    positions = entry[2] if len(entry) == 3 else {}
    if not isinstance(positions, dict) or any(p not in MICROBATCH_POSITIONS or len(positions[p]) != 4
                                              for p in positions):
        raise ValueError
    lines = tuple((p, *(float(v) for v in positions[p])) for p in MICROBATCH_POSITIONS if p in positions)
    line = (float(entry[0]), float(entry[1]) if len(entry) > 1 else 0.0)
    if not all(math.isfinite(v) for v in line) or not all(math.isfinite(v) for _, *values in lines for v in values):
        raise ValueError  # a NaN or infinite correction plans nothing
    return Correction(*line, lines)  # type: ignore[arg-type]
