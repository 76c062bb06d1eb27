"""Calibration from training: the memory model's predictions corrected by the peaks that
training measures, the same correction on every rank.

    calibration = xpm.Calibration(usable_bytes)
    for step in steps:
        for microbatch in step:
            xpm.meters.start_peak(meter)     # reset_peak(), the cache emptied where it reserves
            ...forward, backward (and the optimizer step after the last)...
            calibration.record_peak(predicted_bytes, xpm.meters.planned_peak_bytes(meter))
        line = calibration.end_step(step_index)   # every rank: one all-reduce
        if line: print(line)                      # "step 40: correction +4.1 % -> +0.3 % ..."

``PredictiveBatchSampler`` holds one (``calibrate=True``, the default) and ``microbatch_loop(...,
meter=...)`` feeds it, so the plans of the steps not yet handed out are made with the corrected
predictions: a microbatch is planned so that ``prediction + correction <= usable_bytes``.

The correction is a line in the prediction, ``intercept_bytes + slope * prediction``
(``Correction``): what the probes missed may be a constant (DDP's gradient buckets, a
framework's buffers) or grow with the microbatch (a formula a little off), and one constant set
by the most under-predicted large microbatch over-predicts the small ones. Each step, every
rank's measured points ``(prediction, peak)`` give, for each slope of a fixed grid (-5 % to
+20 %, 0.25 % apart), the least intercept that puts every point on or under the line; the ranks
agree on those in one all-reduce (max). Of the lines that cover the recent steps
(``window_steps``), the one chosen has the smallest sum of its corrections relative to the
prediction at the smallest and at the largest prediction measured (the larger of the two would
tilt the line until both are equal, over-predicting the large microbatches by what the small
ones need), and no intercept below the constant line's;
a headroom of 0.25 % of the prediction is added to its slope. An under-prediction (a point
above the line in force) changes the line at once (the next step is planned with it); a line
lower over the whole range measured is taken after one step with 1 % of the prediction more
headroom (``lower_early``, not for reserved bytes), and as drawn once ``settle_steps`` steps
(8) are in the window, every point of the window under it, and never because of the run's
first step (no optimizer state yet, so lower than the rest).
The correction at the budget is bounded to half the budget either way; an under-prediction
beyond that is warned about once (the model is wrong: probe again).

Points recorded with their ``MicrobatchPosition`` in the step ("first", "middle", "last",
"alone") also draw a line per position, by the same rules from the same initial correction:
a step's first microbatch (gradients allocated among its activations) and its last (the
optimizer step, clipping, synchronisation) miss other amounts than the rest. A position's line
holds for the predictions it has measured; outside them a lowering line takes off no larger a
share of the prediction than at the nearest it measured (above them that alone); else the
larger of it and the common line, the common line below them no higher than at the smallest
it measured (a slope that mixes the positions, extrapolated down, would grow without bound);
plans fit every line
(``Correction.planning_bytes``), and ``Microbatch.correction_bytes`` is its position's.

The policy is the planner's C++ ``xpm::Calibration`` (``xpm/planner/calibration.hpp``), which the
C++ Learner uses too; this module adds the collective (``torch.distributed``) and the warning.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from . import _planner
from .choices import MICROBATCH_POSITIONS, MicrobatchPosition, _check_choice
from .meters import Meter, planned_bytes_kind, planned_peak_bytes
from .record_dims import _finite_number

_POSITION_ORDER = {name: k for k, name in enumerate(MICROBATCH_POSITIONS)}


@dataclass(frozen=True)
class Correction:
    """Bytes added to a memory model's prediction: ``intercept_bytes + slope * prediction``, or
    for a microbatch at a position of its step with a line of its own (``positions``), that line.

    Attributes:
        intercept_bytes: the constant part, bytes (may be negative).
        slope: the part proportional to the prediction (0.01: 1 % of it).
        positions: ``((position, intercept_bytes, slope, low_bytes, high_bytes), ...)``, the
            lines the calibration drew for the microbatches of a ``MicrobatchPosition``
            ("first", "middle", "last", "alone") once it measured them, each holding for the
            predictions from ``low_bytes`` to ``high_bytes`` it measured (outside them a line
            that lowers takes off no larger a share of the prediction than at the nearest end,
            above them that alone; else the larger of it and the line above, which below
            ``low_bytes`` grows no further than at it); a position not listed takes the line
            above. The rule is the
            planner's C++ ``xpm::Correction``, which ``bytes_for`` and ``planning_bytes`` call.

    Raises:
        ValueError: ``intercept_bytes`` or ``slope`` is not a finite number (text, a bool, NaN
            or an infinity: ``Correction: slope must be a finite number, got nan``).
    """

    intercept_bytes: float = 0.0
    slope: float = 0.0
    positions: Tuple[Tuple[MicrobatchPosition, float, float, float, float], ...] = ()

    def __post_init__(self) -> None:
        """Raises ValueError when ``intercept_bytes`` or ``slope`` is not a finite number (text,
        a bool, NaN or an infinity), named with its value."""
        for name, unit in (("intercept_bytes", " of bytes"), ("slope", "")):
            value = getattr(self, name)
            if not _finite_number(value):
                raise ValueError(f"Correction: {name} must be a finite number{unit}, got {value!r:.40}")

    def bytes_for(self, predicted_bytes: float, position: Optional[MicrobatchPosition] = None) -> float:
        """The correction of one prediction.

        Args:
            predicted_bytes: the model's prediction, bytes.
            position: the microbatch's position in its step (``xpm.microbatch_position``), or
                None: the line every position without one of its own takes.

        Returns:
            The bytes to add to it.

        Raises:
            ValueError: ``position`` is not a ``MicrobatchPosition``.
        """
        if position is not None:
            _check_choice(position, MICROBATCH_POSITIONS, "Correction.bytes_for: position")
        return float(_planner.correction_bytes_for(*self._native(), float(predicted_bytes), position))

    def planning_bytes(self, usable_bytes: float) -> float:
        """The largest prediction whose corrected value fits ``usable_bytes`` at every position
        (a step's positions are known once it is packed).

        Args:
            usable_bytes: the budget, bytes.

        Returns:
            The least ``(usable_bytes - intercept_bytes) / (1 + slope)`` over the lines, and for
            a lowering position line ``usable_bytes / (1 + share)`` at an end it is extrapolated
            from, bytes.
        """
        return float(_planner.correction_planning_bytes(*self._native(), float(usable_bytes)))

    def _native(self) -> Tuple[float, float, Dict[str, Tuple[float, float, float, float]]]:
        return (float(self.intercept_bytes), float(self.slope),
                {name: (float(i), float(s), float(low), float(high)) for name, i, s, low, high in self.positions})

    @staticmethod
    def _from_native(native: Tuple[float, float, Dict[str, Tuple[float, float, float, float]]]) -> "Correction":
        intercept, slope, positions = native
        return Correction(intercept, slope, tuple((name, *(float(v) for v in line)) for name, line in
                                                  sorted(positions.items(), key=lambda item: _POSITION_ORDER[item[0]])))


HEADROOM_SLOPE: float = _planner.HEADROOM_SLOPE
"""The headroom added to a new correction: the grid's next slope, 0.25 % of the prediction."""

EARLY_HEADROOM_SLOPE: float = _planner.EARLY_HEADROOM_SLOPE
"""The headroom a lower correction adds besides, before ``settle_steps`` steps: 1 % of the prediction."""


def _bytes_number(value: Any, name: str) -> float:
    """A number of bytes given to ``Calibration.record_peak``: text, booleans and what is not
    finite are refused, and so is 2**63 or more (the native check refuses a negative one)."""
    if not _finite_number(value):
        raise ValueError(f"Calibration.record_peak: {name} must be a finite number of bytes, got {value!r:.40}")
    if abs(value) >= 2 ** 63:
        raise ValueError(f"Calibration.record_peak: {name} must be a number of bytes below 2**63 (8 EiB, the most "
                         f"the planner counts), got {value!r:.40}")
    return float(value)


def _usable_bytes(value: Any) -> int:
    """``Calibration``'s budget: a whole number of bytes > 0 (a float with a whole value is taken;
    text, booleans and fractions are refused)."""
    if not _finite_number(value) or not 0 < value < 2 ** 63 or value != int(value):  # a huge int never reaches int()
        raise ValueError(f"Calibration: usable_bytes must be a whole number of bytes > 0, got {value!r:.40}")
    return int(value)


DEFAULT_SETTLE_STEPS = 8
"""``Calibration``'s ``settle_steps`` when none is given (fewer when the window holds fewer)."""


def _checked_steps(window_steps: Any, settle_steps: Any) -> int:
    """``Calibration``'s ``window_steps`` and ``settle_steps`` checked: whole numbers (the native
    check refuses one < 1), ``settle_steps`` at most ``window_steps`` (else the window could
    never hold that many steps). Returns ``settle_steps``, None becoming min(8, window_steps)."""
    if settle_steps is None and isinstance(window_steps, (int, np.integer)) and not isinstance(window_steps, bool):
        settle_steps = min(DEFAULT_SETTLE_STEPS, int(window_steps))
    for name, value in (("window_steps", window_steps), ("settle_steps", settle_steps)):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"Calibration: {name} must be a whole number >= 1, got {value!r:.40}")
    if settle_steps > window_steps:
        raise ValueError(f"Calibration: settle_steps {settle_steps} is more than window_steps {window_steps} (a "
                         f"lower correction is taken as drawn once settle_steps steps are in the window, which "
                         f"holds window_steps): give settle_steps <= {window_steps}")
    return int(settle_steps)


def _step_number(value: Any, name: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or not 0 <= value < 2 ** 63:
        raise ValueError(f"Calibration.end_step: {name} must be a whole number >= 0, got {value!r:.40}")
    return int(value)


class Calibration:
    """The correction of a memory model's predictions from measured peaks (module docstring).

    Args:
        usable_bytes: the budget the plans fill (``MemoryBudget.usable_bytes``); the log states
            corrections as shares of it.
        window_steps: the steps whose measurements the correction covers.
        settle_steps: the steps measured (besides the run's first) before a lower correction is
            taken as drawn (a higher one is taken at once), at most ``window_steps``; None: 8, or
            ``window_steps`` when that is fewer. Fewer lower
            an over-prediction sooner, at the risk of under-predicting steps whose peaks vary
            from one step to the next.
        lower_early: before ``settle_steps`` steps, take a lower correction after one step with
            1 % of the prediction more headroom (``EARLY_HEADROOM_SLOPE``). For allocated bytes,
            which repeat from step to step (TRL's SFTTrainer over-predicted by 7.7 % to 9.4 %
            was planned -0.37 % to +2.07 % from the third step, not +7.69 % to +9.39 %); False
            for reserved bytes, which move by whole segments with what the cache kept (the
            sampler's choice when its model has a ``reserved_gap``).
        group: the process group whose ranks agree on the correction (None: the default group,
            when torch.distributed is initialised with more than one rank; else no collective).
        initial: the correction in force before anything is measured (default none), a line
            (no ``positions``: each position starts from it); a model probed under a caching
            allocator starts from its ``reserved_gap``.

    Raises:
        ValueError: ``usable_bytes`` is not a whole number of bytes > 0 (named with the value:
            ``Calibration: usable_bytes must be a whole number of bytes > 0, got 1.5``),
            ``window_steps`` or ``settle_steps`` is not a whole number >= 1, ``settle_steps`` is
            more than ``window_steps`` (``Calibration: settle_steps 8 is more than window_steps
            4 ...``), ``initial`` has
            ``positions``, or ``lower_early`` is not a bool.
        TypeError: ``initial`` is neither a ``Correction`` nor None.
    """

    def __init__(self, usable_bytes: int, *, window_steps: int = 32, settle_steps: Optional[int] = None,
                 group: Optional[Any] = None, initial: Optional[Correction] = None, lower_early: bool = True) -> None:
        usable_bytes = _usable_bytes(usable_bytes)
        settle_steps = _checked_steps(window_steps, settle_steps)
        if initial is not None and not isinstance(initial, Correction):
            raise TypeError(f"Calibration: initial must be an xpm.Correction or None, got {type(initial).__name__} "
                            f"{initial!r:.60}")
        start = Correction() if initial is None else initial
        if start.positions:
            raise ValueError("Calibration: initial must be a line (intercept_bytes, slope), without positions; got "
                             f"{start!r}")
        if not isinstance(lower_early, (bool, np.bool_)):
            raise ValueError(f"Calibration: lower_early must be True or False, got {lower_early!r}")
        self._native = _planner.Calibration(int(usable_bytes), int(window_steps), int(settle_steps),
                                            float(start.intercept_bytes), float(start.slope), bool(lower_early))
        self.usable_bytes = int(usable_bytes)
        self.window_steps = int(window_steps)
        self.settle_steps = int(settle_steps)
        self.lower_early = bool(lower_early)
        self._initial = (float(start.intercept_bytes), float(start.slope))
        self.group = group
        self._warned = False

    def __getstate__(self) -> Dict[str, Any]:
        """What pickling keeps: the settings and ``state_dict()`` (the correction, its window,
        the log); the microbatches recorded since the last ``end_step`` are not kept.

        Raises:
            TypeError: the calibration agrees over a process group of its own (a group is a
                handle of this process, not data; ``copy.deepcopy`` shares it).
        """
        if self.group is not None:
            raise TypeError("xpm.Calibration with a process group of its own cannot be pickled (the group is a "
                            "handle of this process); copy.deepcopy shares it")
        return self._settings_and_state(None)

    def __setstate__(self, saved: Dict[str, Any]) -> None:
        Calibration.__init__(self, saved["usable_bytes"], window_steps=saved["window_steps"],
                             settle_steps=saved["settle_steps"], group=saved["group"],
                             lower_early=saved.get("lower_early", True),
                             initial=Correction(*saved.get("initial", (0.0, 0.0))))
        self.load_state_dict(saved["state"])
        self._warned = saved["warned"]

    def __deepcopy__(self, memo: Dict[int, Any]) -> "Calibration":
        copied = Calibration.__new__(Calibration)
        copied.__setstate__(self._settings_and_state(self.group))
        return copied

    def _settings_and_state(self, group: Optional[Any]) -> Dict[str, Any]:
        return {"usable_bytes": self.usable_bytes, "window_steps": self.window_steps,
                "settle_steps": self.settle_steps, "lower_early": self.lower_early, "initial": self._initial,
                "group": group, "state": self.state_dict(), "warned": self._warned}

    @property
    def correction(self) -> Correction:
        """The correction in force (its line, and the positions' lines drawn so far)."""
        return Correction._from_native(self._native.correction)

    @property
    def log(self) -> List[str]:
        """One line per change of the correction."""
        return list(self._native.log)

    @property
    def measured_microbatches(self) -> int:
        """The microbatches recorded on this rank."""
        return int(self._native.measured_microbatches)

    @property
    def worst_rel_error(self) -> float:
        """The most negative ``(corrected - peak) / peak`` recorded on this rank (0 when none under)."""
        return float(self._native.worst_rel_error)

    @property
    def replan_from(self) -> int:
        """After ``end_step``: the agreed first step planned with the new correction."""
        return int(self._native.replan_from)

    @property
    def correction_bytes(self) -> float:
        """How much the correction in force shrinks the plans' budget, bytes (``usable_bytes``
        less ``correction.planning_bytes(usable_bytes)``)."""
        return float(self._native.correction_bytes)

    @property
    def headroom_bytes(self) -> float:
        """What a new correction adds at a prediction of the whole budget (0.25 % of it; 0.25 %
        of every prediction), so that peaks a little above the last measured ones do not plan
        the steps anew at every step."""
        return HEADROOM_SLOPE * self.usable_bytes

    @property
    def bound_bytes(self) -> float:
        """The largest correction at the budget either way: half the budget."""
        return 0.5 * self.usable_bytes

    def record_peak(self, predicted_bytes: float, peak_bytes: float,
                    position: Optional[MicrobatchPosition] = None) -> None:
        """Records one microbatch's measured peak against the model's prediction of it (this
        rank only; no communication).

        Args:
            predicted_bytes: the sampler's prediction of the microbatch (``Microbatch.predicted_bytes``).
            peak_bytes: the meter's peak over its forward and backward (and the optimizer step
                after the last microbatch): allocated bytes, or reserved bytes where the plans
                bound them (``xpm.meters.planned_peak_bytes``).
            position: the microbatch's position in its step (``xpm.microbatch_position``;
                ``Microbatch.position``), which then draws that position's line too ("alone":
                that line only, the gap of a step's only microbatch being its own); None: the
                correction's line alone.

        Raises:
            ValueError: either value is not a number, not finite, negative or 2**63 or more (0,
                an empty microbatch's prediction or a peak not measured, is skipped), or
                ``position`` is not a ``MicrobatchPosition``.
        """
        if position is not None:
            _check_choice(position, MICROBATCH_POSITIONS, "Calibration.record_peak: position")
        self._native.record_peak(_bytes_number(predicted_bytes, "predicted_bytes"),
                                 _bytes_number(peak_bytes, "peak_bytes"), position)

    def record_meter_peak(self, predicted_bytes: float, meter: Meter,
                          position: Optional[MicrobatchPosition] = None) -> None:
        """``record_peak`` with the peak ``meter`` measured since ``xpm.meters.start_peak``:
        reserved bytes where the plans bound them (``xpm.meters.planned_bytes_kind``), and then
        lower corrections only once settled (``lower_only_once_settled``), else allocated bytes.

        Args:
            predicted_bytes: as ``record_peak``'s.
            meter: the meter that measured the microbatch.
            position: as ``record_peak``'s.

        Raises:
            ValueError: as ``record_peak``, or the meter's peak is not a number of bytes in [0,
                2**63) (``xpm.meters.planned_peak_bytes``).
            TypeError: ``meter`` is not a meter.
        """
        self.record_peak(predicted_bytes, planned_peak_bytes(meter), position)  # checked before anything changes
        if self.lower_early and planned_bytes_kind(meter) == "reserved":  # from end_step on
            self.lower_only_once_settled()

    def lower_only_once_settled(self) -> None:
        """From now on, a lower correction is taken only once ``settle_steps`` steps lie under it
        (``lower_early`` off): the peaks recorded are a caching allocator's reserved bytes, which
        move by whole segments with what the cache kept. Every rank must call it before the same
        ``end_step`` (``record_meter_peak`` does where every rank meters alike), else the ranks
        draw different corrections from the rows they agree on."""
        self._native.lower_only_once_settled()
        self.lower_early = False

    def end_step(self, step: int, *, replan_from: int = 0) -> Optional[str]:
        """Ends an optimizer step: agrees the step's measurements over the ranks (one all-reduce
        of 518 numbers under an initialised process group of more than one rank; every rank
        must call it, once per step) and updates the correction.

        Args:
            step: the step's index (for the log line).
            replan_from: the first step this rank could still plan anew; the largest over the
                ranks is left in ``replan_from`` (the step from which every rank plans with the
                new correction).

        Returns:
            The log line when the correction changed ("step 40: correction +4.1 % -> +0.3 % of
            the budget (+25,600 bytes + 0.50 % of the prediction)"), else None.

        Raises:
            ValueError: on every rank, when the ranks' ``usable_bytes`` differ (their plans would);
                ``step`` or ``replan_from`` is not a whole number >= 0.

        Warns:
            RuntimeWarning: once, when the model under-predicts by more than half the budget.
        """
        step, replan_from = _step_number(step, "step"), _step_number(replan_from, "replan_from")
        row = self._agreed(self._native.step_row(replan_from))
        line = self._native.end_step(step, row)
        if line is not None:
            self._warn_beyond_bound()
        return line

    def _warn_beyond_bound(self) -> None:
        if self.correction_bytes >= self.bound_bytes and not self._warned:
            self._warned = True
            warnings.warn(f"xpm: microbatches peaked more than half the budget of {self.usable_bytes} bytes above "
                          "their predictions: the memory model does not describe this step; probe again (with the "
                          "wrapped model, under the training's settings)", RuntimeWarning, stacklevel=4)

    def _agreed(self, row: List[float]) -> List[float]:
        """The step's row (``step_row``) reduced by MAX over the ranks (one all-reduce, none at one rank)."""
        group_size = dist.get_world_size(self.group) if dist.is_available() and dist.is_initialized() else 1
        if group_size == 1:
            return row
        device = torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend(self.group) == "nccl" else torch.device("cpu")
        values = torch.tensor(row, dtype=torch.float64, device=device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.group)
        return values.cpu().tolist()

    def state_dict(self) -> Dict[str, Any]:
        """The correction, its window and log, and each position's line and window.

        Returns:
            Plain values (JSON; a step of the window with no point as None).
        """
        return json.loads(self._native.state_json())  # type: ignore[no-any-return]

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores a ``state_dict()`` (also one written before positions had lines of their
        own, or of a calibration with a constant correction: that correction kept as the
        intercept, its window dropped).

        Args:
            state: a ``state_dict()`` of a calibration.

        Raises:
            ValueError: ``state`` is not a calibration state.
        """
        try:
            if "correction" not in state:
                state = {"correction": [float(state["correction_bytes"]), 0.0], "window": [],
                         "steps_seen": state["steps_seen"], "log": state["log"]}
            self._native.load_state_json(json.dumps(_finite_or_none(state), allow_nan=False))
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"calibration state_dict: {error!r} (expected correction, window, steps_seen, "
                             "log)") from None


def _finite_or_none(value: Any) -> Any:
    """``value`` with every float that is not finite (a window row's empty step, as earlier
    states held it) as None."""
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(v) for v in value]
    if isinstance(value, float) and not np.isfinite(value):
        return None
    return value


def covering_correction(predicted_bytes: List[float], peak_bytes: List[float], usable_bytes: float) -> Correction:
    """The line a calibration draws over one set of points (prediction, measured peak), with no
    collective: e.g. the gap between a model of allocated bytes and the reserved peaks of its
    probes.

    Args:
        predicted_bytes: the model's predictions, bytes.
        peak_bytes: the peaks measured at them, bytes.
        usable_bytes: the budget, bytes.

    Returns:
        The correction (none when no prediction is positive).
    """
    return Correction(*_planner.covering_correction([float(p) for p in predicted_bytes],
                                                    [float(p) for p in peak_bytes], float(usable_bytes)))
