"""Calibration from training: the memory model's predictions corrected by the peaks that
training measures, the same correction on every rank.

    calibration = xpm.Calibration(usable_bytes)
    for step in steps:
        for microbatch in step:
            meter.reset_peak()
            ...forward, backward (and the optimizer step after the last)...
            calibration.record_peak(predicted_bytes, meter.peak_allocated_bytes)
        line = calibration.end_step(step_index)   # every rank: one all-reduce of four numbers
        if line: print(line)                      # "step 40: correction +4.1 % -> +0.3 % ..."

``PredictiveBatchSampler`` holds one (``calibrate=True``, the default) and ``microbatch_loop(...,
meter=...)`` feeds it, so the plans of the steps not yet handed out are made with the corrected
predictions: a microbatch is planned so that ``prediction + correction_bytes <= usable_bytes``.

The correction is additive, in bytes: the largest ``peak - prediction`` of the recent steps'
microbatches, over every rank, plus a headroom of 0.25 % of the budget. An under-prediction
raises it at once (the next step is planned with it); it comes down only when a full window of
steps (``window_steps``) measured less, and never because of the run's first step (no
optimizer state yet, so lower than the rest). It is
bounded to half the budget either way; an under-prediction beyond that is warned about once
(the model is wrong: probe again).
"""
from __future__ import annotations

import collections
import math
import warnings
from typing import Any, Deque, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist


class Calibration:
    """The correction of a memory model's predictions from measured peaks (module docstring).

    Args:
        usable_bytes: the budget the plans fill (``MemoryBudget.usable_bytes``); the log states
            corrections as shares of it.
        window_steps: the steps whose largest difference the correction follows.
        group: the process group whose ranks agree on the correction (None: the default group,
            when torch.distributed is initialised with more than one rank; else no collective).

    Raises:
        ValueError: ``usable_bytes`` or ``window_steps`` is not positive.
    """

    def __init__(self, usable_bytes: int, *, window_steps: int = 32, group: Optional[Any] = None) -> None:
        if int(usable_bytes) <= 0:
            raise ValueError(f"Calibration: usable_bytes must be > 0, got {usable_bytes}")
        if int(window_steps) < 1:
            raise ValueError(f"Calibration: window_steps must be >= 1, got {window_steps}")
        self.usable_bytes = int(usable_bytes)
        self.window_steps = int(window_steps)
        self.group = group
        self.correction_bytes = 0.0
        self.log: List[str] = []                   # one line per change of the correction
        self.measured_microbatches = 0
        self.worst_rel_error = 0.0                 # the most negative (prediction - peak) / peak seen
        self._window: Deque[float] = collections.deque(maxlen=self.window_steps)
        self._step_worst = -math.inf               # this step's largest peak - prediction, this rank
        self._steps_seen = 0
        self._warned = False
        self.replan_from = 0                       # end_step's agreed first step planned anew

    @property
    def headroom_bytes(self) -> float:
        """Added to a new correction (0.25 % of the budget), so that peaks a little above the last
        measured one do not plan the steps anew at every step."""
        return 0.0025 * self.usable_bytes

    @property
    def bound_bytes(self) -> float:
        """The largest correction either way: half the budget."""
        return 0.5 * self.usable_bytes

    def record_peak(self, predicted_bytes: float, peak_allocated_bytes: float) -> None:
        """Records one microbatch's measured peak against the model's prediction of it (this
        rank only; no communication).

        Args:
            predicted_bytes: ``model.predict(dims)`` of the microbatch (``Microbatch.predicted_bytes``).
            peak_allocated_bytes: the meter's peak over its forward and backward (and the
                optimizer step after the last microbatch).
        """
        predicted, peak = float(predicted_bytes), float(peak_allocated_bytes)
        if not (math.isfinite(predicted) and math.isfinite(peak)) or peak <= 0:
            return
        self._step_worst = max(self._step_worst, peak - predicted)
        self.measured_microbatches += 1
        self.worst_rel_error = min(self.worst_rel_error, (predicted + self.correction_bytes - peak) / peak)

    def end_step(self, step: int, *, replan_from: int = 0) -> Optional[str]:
        """Ends an optimizer step: agrees the step's largest difference over the ranks (one
        all-reduce of four numbers under an initialised process group of more than one rank;
        every rank must call it, once per step) and updates the correction.

        Args:
            step: the step's index (for the log line).
            replan_from: the first step this rank could still plan anew; the largest over the
                ranks is left in ``replan_from`` (the step from which every rank plans with the
                new correction).

        Returns:
            The log line when the correction changed ("step 40: correction +4.1 % -> +0.3 % of
            the budget (+25,600 bytes)"), else None.

        Raises:
            ValueError: on every rank, when the ranks' ``usable_bytes`` differ (their plans would).

        Warns:
            RuntimeWarning: once, when the model under-predicts by more than half the budget.
        """
        worst, self.replan_from = self._agreed(self._step_worst, int(replan_from))
        self._step_worst = -math.inf
        self._steps_seen += 1
        if not math.isfinite(worst):
            return None  # nothing measured on any rank
        first = self._steps_seen == 1
        if not first:  # the run's first step has no optimizer state: it may only raise
            self._window.append(worst)
        target = max(self._window) if self._window else worst
        if first:
            target = max(target, self.correction_bytes)
        if target > self.bound_bytes and not self._warned:
            self._warned = True
            warnings.warn(f"xpm: a microbatch peaked {target:.0f} bytes above its prediction, more than half the "
                          f"budget of {self.usable_bytes} bytes: the memory model does not describe this step; "
                          "probe again (with the wrapped model, under the training's settings)",
                          RuntimeWarning, stacklevel=3)
        lower = len(self._window) >= self.window_steps and target + self.headroom_bytes < self.correction_bytes
        if not (target > self.correction_bytes or lower):
            return None
        new = min(max(target + self.headroom_bytes, -self.bound_bytes), self.bound_bytes)
        if new == self.correction_bytes:
            return None
        old, self.correction_bytes = self.correction_bytes, new
        line = (f"step {int(step)}: correction {100 * old / self.usable_bytes:+.1f} % -> "
                f"{100 * new / self.usable_bytes:+.1f} % of the budget ({new:+,.0f} bytes)")
        self.log.append(line)
        return line

    def _agreed(self, worst: float, replan_from: int) -> Tuple[float, int]:
        """The largest of each over the ranks (one all-reduce; none at one rank); raises
        ValueError on every rank when the ranks' budgets differ."""
        group_size = dist.get_world_size(self.group) if dist.is_available() and dist.is_initialized() else 1
        if group_size == 1:
            return worst, replan_from
        device = torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend(self.group) == "nccl" else torch.device("cpu")
        values = torch.tensor([worst if math.isfinite(worst) else -1e300, float(replan_from),
                               float(self.usable_bytes), -float(self.usable_bytes)], dtype=torch.float64, device=device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.group)
        if float(values[2]) != -float(values[3]):
            raise ValueError(f"xpm: the ranks plan under different budgets ({-float(values[3]):.0f} to "
                             f"{float(values[2]):.0f} usable bytes; this rank {self.usable_bytes}): give every rank "
                             "the same usable_bytes, else their plans and corrections differ")
        agreed = float(values[0])
        return (agreed if agreed > -1e299 else -math.inf), int(values[1])

    def state_dict(self) -> Dict[str, Any]:
        """The correction, its window and log (plain values)."""
        return {"correction_bytes": self.correction_bytes, "window": list(self._window),
                "steps_seen": self._steps_seen, "log": list(self.log)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores a ``state_dict()``.

        Args:
            state: a ``state_dict()`` of a calibration.

        Raises:
            ValueError: ``state`` is not a calibration state.
        """
        try:
            correction, window = float(state["correction_bytes"]), [float(v) for v in state["window"]]
            steps_seen, log = int(state["steps_seen"]), [str(line) for line in state["log"]]
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"calibration state_dict: {error!r} (expected correction_bytes, window, steps_seen, "
                             "log)") from None
        self.correction_bytes, self._steps_seen, self.log = correction, steps_seen, log
        self._window = collections.deque(window, maxlen=self.window_steps)
