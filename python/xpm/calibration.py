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
lower over the whole range measured is taken once ``settle_steps`` steps (8) are in the window,
every point of the window under it, and never because of the run's first step (no optimizer
state yet, so lower than the rest).
The correction at the budget is bounded to half the budget either way; an under-prediction
beyond that is warned about once (the model is wrong: probe again).
"""
from __future__ import annotations

import collections
import math
import warnings
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

SLOPES = np.round(np.linspace(-0.05, 0.20, 101), 6)
"""The slopes a correction may take: -5 % to +20 % of the prediction, 0.25 % apart (0 included)."""
ZERO_SLOPE = int(np.flatnonzero(SLOPES == 0.0)[0])
HEADROOM_SLOPE = 0.0025
"""The headroom added to a new correction: the grid's next slope, 0.25 % of the prediction."""

@dataclass(frozen=True)
class Correction:
    """Bytes added to a memory model's prediction: ``intercept_bytes + slope * prediction``.

    Attributes:
        intercept_bytes: the constant part, bytes (may be negative).
        slope: the part proportional to the prediction (0.01: 1 % of it).
    """

    intercept_bytes: float = 0.0
    slope: float = 0.0

    def bytes_for(self, predicted_bytes: float) -> float:
        """The correction of one prediction.

        Args:
            predicted_bytes: the model's prediction, bytes.

        Returns:
            The bytes to add to it.
        """
        return self.intercept_bytes + self.slope * float(predicted_bytes)

    def planning_bytes(self, usable_bytes: float) -> float:
        """The largest prediction whose corrected value fits ``usable_bytes``.

        Args:
            usable_bytes: the budget, bytes.

        Returns:
            ``(usable_bytes - intercept_bytes) / (1 + slope)``, bytes.
        """
        return (float(usable_bytes) - self.intercept_bytes) / (1.0 + self.slope)


class Calibration:
    """The correction of a memory model's predictions from measured peaks (module docstring).

    Args:
        usable_bytes: the budget the plans fill (``MemoryBudget.usable_bytes``); the log states
            corrections as shares of it.
        window_steps: the steps whose measurements the correction covers.
        settle_steps: the steps measured (besides the run's first) before a lower correction is
            taken (a higher one is taken at once). Fewer lower an over-prediction sooner, at the
            risk of under-predicting steps whose peaks vary from one step to the next (measured:
            after 2, an FSDP2 step 4 % of the budget above its plan).
        group: the process group whose ranks agree on the correction (None: the default group,
            when torch.distributed is initialised with more than one rank; else no collective).
        initial: the correction in force before anything is measured (default none); a model
            probed under a caching allocator starts from its ``reserved_gap``.

    Raises:
        ValueError: ``usable_bytes`` is not positive, or ``window_steps`` or ``settle_steps`` is
            not a whole number >= 1.
    """

    def __init__(self, usable_bytes: int, *, window_steps: int = 32, settle_steps: int = 8,
                 group: Optional[Any] = None, initial: Optional[Correction] = None) -> None:
        if int(usable_bytes) <= 0:
            raise ValueError(f"Calibration: usable_bytes must be > 0, got {usable_bytes}")
        for name, value in (("window_steps", window_steps), ("settle_steps", settle_steps)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"Calibration: {name} must be a whole number >= 1, got {value!r}")
        self.settle_steps = int(settle_steps)
        self.usable_bytes = int(usable_bytes)
        self.window_steps = int(window_steps)
        self.group = group
        self.correction = Correction() if initial is None else initial
        self.log: List[str] = []                   # one line per change of the correction
        self.measured_microbatches = 0
        self.worst_rel_error = 0.0                 # the most negative (corrected - peak) / peak seen
        # Per step: the least intercept per slope of SLOPES, then the smallest and the largest
        # prediction measured.
        self._window: Deque[np.ndarray] = collections.deque(maxlen=self.window_steps)
        self._step = self._empty_step()            # this step's, this rank
        self._steps_seen = 0
        self._warned = False
        self.replan_from = 0                       # end_step's agreed first step planned anew

    @staticmethod
    def _empty_step() -> np.ndarray:
        return np.concatenate([np.full(len(SLOPES), -math.inf), [math.inf, -math.inf]])

    @property
    def correction_bytes(self) -> float:
        """How much the correction in force shrinks the plans' budget, bytes (``usable_bytes``
        less ``correction.planning_bytes(usable_bytes)``)."""
        return self.usable_bytes - self.correction.planning_bytes(self.usable_bytes)

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

    def record_peak(self, predicted_bytes: float, peak_allocated_bytes: float) -> None:
        """Records one microbatch's measured peak against the model's prediction of it (this
        rank only; no communication).

        Args:
            predicted_bytes: the sampler's prediction of the microbatch (``Microbatch.predicted_bytes``).
            peak_allocated_bytes: the meter's peak over its forward and backward (and the
                optimizer step after the last microbatch).

        Raises:
            ValueError: either value is not a number, not finite or negative (0, an empty
                microbatch's prediction or a peak not measured, is skipped).
        """
        predicted, peak = float(predicted_bytes), float(peak_allocated_bytes)
        for name, value in (("predicted_bytes", predicted), ("peak_allocated_bytes", peak)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"Calibration.record_peak: {name} must be a finite number of bytes >= 0, "
                                 f"got {value}")
        if peak == 0 or predicted == 0:
            return
        row, slopes = self._step, len(SLOPES)
        np.maximum(row[:slopes], peak - predicted * (1.0 + SLOPES), out=row[:slopes])
        row[slopes], row[slopes + 1] = min(row[slopes], predicted), max(row[slopes + 1], predicted)
        self.measured_microbatches += 1
        corrected = predicted + self.correction.bytes_for(predicted)
        self.worst_rel_error = min(self.worst_rel_error, (corrected - peak) / peak)

    def end_step(self, step: int, *, replan_from: int = 0) -> Optional[str]:
        """Ends an optimizer step: agrees the step's measurements over the ranks (one all-reduce
        of 106 numbers under an initialised process group of more than one rank; every rank
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
            ValueError: on every rank, when the ranks' ``usable_bytes`` differ (their plans would).

        Warns:
            RuntimeWarning: once, when the model under-predicts by more than half the budget.
        """
        measured, self.replan_from = self._agreed(self._step, int(replan_from))
        self._step = self._empty_step()
        self._steps_seen += 1
        first = self._steps_seen == 1
        if not first:  # the run's first step has no optimizer state: it may only raise
            self._window.append(measured)
        window = np.array(self._window) if self._window and not first else measured[None, :]
        target = self._updated(measured, window)
        if target == self.correction:
            return None
        old, self.correction = self.correction, target
        self._warn_beyond_bound()
        before = 100 * (self.usable_bytes - old.planning_bytes(self.usable_bytes)) / self.usable_bytes
        after = 100 * self.correction_bytes / self.usable_bytes
        sign = "+" if target.slope >= 0 else "-"
        line = (f"step {int(step)}: correction {before:+.1f} % -> {after:+.1f} % of the budget "
                f"({target.intercept_bytes:+,.0f} bytes {sign} {100 * abs(target.slope):.2f} % of the prediction)")
        self.log.append(line)
        return line

    def _updated(self, measured: np.ndarray, window: np.ndarray) -> Correction:
        """The correction after a step that measured ``measured`` (a row), the window's rows
        given: the best line over the window when a point lies above the line in force, or when
        ``settle_steps`` steps of the window lie under a lower one; else as it is."""
        current = self.correction
        seen = window[np.isfinite(window[:, -1])]
        if not len(seen):
            return current
        target = self._best_line(seen)
        index = int(np.argmin(np.abs(SLOPES - current.slope)))
        above = np.isfinite(measured[-1]) and measured[index] > current.intercept_bytes
        span = (float(seen[:, -2].min()), float(seen[:, -1].max()))
        lower = (len(self._window) >= min(self.settle_steps, self.window_steps) and
                 all(target.bytes_for(p) < current.bytes_for(p) for p in span))
        return target if above or lower else current

    def _best_line(self, rows: np.ndarray) -> Correction:
        """``best_line(rows, usable_bytes)``."""
        return best_line(rows, self.usable_bytes)

    def _warn_beyond_bound(self) -> None:
        if self.correction_bytes >= self.bound_bytes and not self._warned:
            self._warned = True
            warnings.warn(f"xpm: microbatches peaked more than half the budget of {self.usable_bytes} bytes above "
                          "their predictions: the memory model does not describe this step; probe again (with the "
                          "wrapped model, under the training's settings)", RuntimeWarning, stacklevel=4)

    def _agreed(self, measured: np.ndarray, replan_from: int) -> Tuple[np.ndarray, int]:
        """The step's measurements and ``replan_from`` agreed over the ranks (the largest
        intercepts and predictions, the smallest predictions; one all-reduce, none at one rank);
        raises ValueError on every rank when the ranks' budgets differ."""
        group_size = dist.get_world_size(self.group) if dist.is_available() and dist.is_initialized() else 1
        if group_size == 1:
            return measured, replan_from
        device = torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend(self.group) == "nccl" else torch.device("cpu")
        row = measured.copy()
        row[-2] = -row[-2]  # the smallest prediction, as a maximum
        mine = np.concatenate([row, [float(replan_from), float(self.usable_bytes), -float(self.usable_bytes)]])
        mine[~np.isfinite(mine)] = -1e300
        values = torch.tensor(mine, dtype=torch.float64, device=device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.group)
        agreed = values.cpu().numpy()
        if agreed[-2] != -agreed[-1]:
            raise ValueError(f"xpm: the ranks plan under different budgets ({-agreed[-1]:.0f} to {agreed[-2]:.0f} "
                             f"usable bytes; this rank {self.usable_bytes}): give every rank the same usable_bytes, "
                             "else their plans and corrections differ")
        result = agreed[:-3].copy()
        result[result < -1e299] = -math.inf
        result[-2] = -result[-2]
        return result, int(agreed[-3])

    def state_dict(self) -> Dict[str, Any]:
        """The correction, its window and log (plain values)."""
        return {"correction": [self.correction.intercept_bytes, self.correction.slope],
                "window": [rows.tolist() for rows in self._window], "steps_seen": self._steps_seen,
                "log": list(self.log)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores a ``state_dict()`` (also one of a calibration with a constant correction:
        that correction kept as the intercept, its window dropped).

        Args:
            state: a ``state_dict()`` of a calibration.

        Raises:
            ValueError: ``state`` is not a calibration state.
        """
        try:
            if "correction" in state:
                intercept, slope = (float(v) for v in state["correction"])
                correction = Correction(intercept, slope)
                window = [np.asarray(row, dtype=np.float64) for row in state["window"]]
                if any(row.shape != self._empty_step().shape for row in window):
                    raise ValueError("window rows of another shape")
            else:
                correction, window = Correction(float(state["correction_bytes"])), []
            steps_seen, log = int(state["steps_seen"]), [str(line) for line in state["log"]]
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"calibration state_dict: {error!r} (expected correction, window, steps_seen, "
                             "log)") from None
        self.correction, self._steps_seen, self.log = correction, steps_seen, log
        self._window = collections.deque(window, maxlen=self.window_steps)


def best_line(rows: np.ndarray, usable_bytes: float) -> Correction:
    """Of the lines over every point of ``rows`` (intercepts per slope, smallest and largest
    prediction) whose intercept is not below the constant line's (or 0), the one with the
    smallest sum of its corrections relative to the prediction at both ends of the predictions'
    range (a tie to the smallest slope), with the headroom added, and bounded to half the budget
    at the budget.

    Args:
        rows: measured steps, one row each: the least intercept per slope of ``SLOPES``, then
            the smallest and the largest prediction.
        usable_bytes: the budget, bytes.

    Returns:
        The line.
    """
    intercepts = rows[:, :len(SLOPES)].max(axis=0)
    # No line below the constant one at a prediction of 0: a steep line through large
    # microbatches alone would under-correct the small ones it has not seen.
    intercepts = np.maximum(intercepts, min(0.0, float(intercepts[ZERO_SLOPE])))
    low, high = float(rows[:, -2].min()), float(rows[:, -1].max())
    relative = (intercepts + SLOPES * low) / low + (intercepts + SLOPES * high) / high
    k = int(np.lexsort((np.abs(SLOPES), np.round(relative, 9)))[0])
    intercept = float(intercepts[k])
    if k + 1 < len(SLOPES):  # the headroom: the grid's next slope (0.25 % of the prediction)
        k += 1
    else:
        intercept += HEADROOM_SLOPE * usable_bytes
    at_budget = intercept + SLOPES[k] * usable_bytes
    if abs(at_budget) > 0.5 * usable_bytes:
        intercept -= at_budget - math.copysign(0.5 * usable_bytes, at_budget)
    return Correction(intercept, float(SLOPES[k]))


def covering_correction(predicted_bytes: List[float], peak_bytes: List[float], usable_bytes: float) -> Correction:
    """The line ``best_line`` draws over one set of points (prediction, measured peak), with no
    collective: e.g. the gap between a model of allocated bytes and the reserved peaks of its
    probes.

    Args:
        predicted_bytes: the model's predictions, bytes.
        peak_bytes: the peaks measured at them, bytes.
        usable_bytes: the budget, bytes.

    Returns:
        The correction (none when no prediction is positive).
    """
    row = np.concatenate([np.full(len(SLOPES), -math.inf), [math.inf, -math.inf]])
    for predicted, peak in zip(predicted_bytes, peak_bytes):
        if predicted > 0 and peak > 0:
            np.maximum(row[:len(SLOPES)], peak - predicted * (1.0 + SLOPES), out=row[:len(SLOPES)])
            row[-2], row[-1] = min(row[-2], predicted), max(row[-1], predicted)
    return best_line(row[None, :], usable_bytes) if math.isfinite(row[-1]) else Correction()
