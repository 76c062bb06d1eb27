"""The sampler's refit of its memory model on the peaks training measured: the planner's
``xpm::TrainingRefit`` (``xpm/planner/training_refit.hpp``, the C++ Learner's policy too) with
the ranks' points gathered over ``torch.distributed``.

Where the probes' fit misses shapes by amounts that differ from shape to shape, the
calibration's lines (an offset and a share of the prediction per position in the step) over-
predict most microbatches by what the worst one needs. Every step, every rank's microbatches
(dims, peak, position) are gathered (one ``all_gather_object`` under a process group of more
than one rank); once the window of the last steps holds three points per coefficient, again
each time they grew by half, and every 32 steps seen once they stop growing, the model's formula
(re-chosen among linear formulas when ``"auto"`` chose it) is fitted to the microbatches of a
step's middle and end, and taken when the spread of its leave-one-shape-out errors is at least
1 % of the peak below that of the model in force once the best line in the prediction (what a
calibration line can correct) is taken off. The calibration is then drawn anew over the same
window with the new model's predictions, and the steps not yet handed out are planned with both.
"""
from __future__ import annotations

import copy
import json
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

from . import _planner
from .calibration import Calibration
from .choices import MicrobatchPosition
from .memory_model import MemoryModel

Point = Tuple[List[float], float, Optional[MicrobatchPosition]]
"""One trained microbatch: its dims, its measured peak (bytes) and its position in its step."""


class TrainingRefit:
    """The refit of ``model`` on training's peaks (module docstring).

    Args:
        model: the model the sampler plans with first.
        window_steps: the steps whose microbatches are fitted (the calibration's window).
        group: the process group whose ranks gather their points (None: the default group when
            torch.distributed is initialised with more than one rank).
    """

    def __init__(self, model: MemoryModel, window_steps: int, group: Optional[Any] = None) -> None:
        self._given, self._window_steps = model, int(window_steps)
        self._native = _planner.TrainingRefit(model._native, int(window_steps))
        self._model = model
        self.group = group
        self._pending: List[Point] = []

    def __getstate__(self) -> Dict[str, Any]:
        """What pickling keeps: the model given, the window and the points of the step under way.

        Raises:
            TypeError: the refit gathers over a process group of its own (a handle of this
                process, not data; ``copy.deepcopy`` shares it).
        """
        if self.group is not None:
            raise TypeError("xpm's TrainingRefit with a process group of its own cannot be pickled (the group is a "
                            "handle of this process); copy.deepcopy shares it")
        return self._saved(None)

    def __setstate__(self, saved: Dict[str, Any]) -> None:
        TrainingRefit.__init__(self, saved["given"], saved["window_steps"], saved["group"])
        self.load_state_dict(saved["state"])
        self._pending = [(list(d), float(p), q) for d, p, q in saved["pending"]]

    def __deepcopy__(self, memo: Dict[int, Any]) -> "TrainingRefit":
        copied = TrainingRefit.__new__(TrainingRefit)
        copied.__setstate__({**self._saved(self.group), "given": copy.deepcopy(self._given, memo)})
        return copied

    def _saved(self, group: Optional[Any]) -> Dict[str, Any]:
        return {"given": self._given, "window_steps": self._window_steps, "group": group,
                "state": self.state_dict(), "pending": list(self._pending)}

    @property
    def model(self) -> MemoryModel:
        """The model in force: the one given, or its last refit."""
        return self._model

    @property
    def log(self) -> List[str]:
        """One line per refit taken."""
        return list(self._native.log)

    def record(self, dims: Sequence[float], peak_bytes: float, position: Optional[MicrobatchPosition]) -> None:
        """Records one microbatch of this rank (no communication).

        Args:
            dims: its dims (the model's variables).
            peak_bytes: its peak, as the calibration records it.
            position: its position in its step (None: not known, not fitted).
        """
        self._pending.append(([float(d) for d in dims], float(peak_bytes), position))

    def end_step(self, step: int) -> Optional[str]:
        """Ends an optimizer step: every rank's points gathered (every rank must call it once per
        step), then a refit tried where due.

        Args:
            step: the step's index in the epoch (for the log line).

        Returns:
            The log line when the model changed ("step 12: memory model refitted on 66 training
            peaks: ..."), else None; ``model`` is then the new one.
        """
        points = [p for rank_points in self._gathered() for p in rank_points]
        self._pending = []
        line = self._native.end_step(int(step), [p[0] for p in points], [p[1] for p in points],
                                     [p[2] for p in points])
        if line is not None:
            self._model = MemoryModel(self._native.model)
        return line

    def _gathered(self) -> List[List[Point]]:
        """Every rank's points of the step, in rank order (this rank's alone without a group)."""
        group_size = dist.get_world_size(self.group) if dist.is_available() and dist.is_initialized() else 1
        if group_size == 1:
            return [self._pending]
        gathered: List[Any] = [None] * group_size
        dist.all_gather_object(gathered, self._pending, group=self.group)
        return gathered

    def redraw(self, calibration: Calibration, phases: Dict[str, Any], line: str) -> None:
        """Draws ``calibration``'s correction anew over the window's points as ``model``
        predicts them (no communication: the points are every rank's).

        Args:
            calibration: the sampler's calibration.
            phases: ``plan_step``'s phase models of ``model`` (``StepPacking._phase_models``).
            line: the refit's log line, appended to the calibration's log.
        """
        self._native.redraw(calibration._native, phases.get("first_of_several"), phases.get("first_alone"),
                            phases.get("synchronised"), line)

    def state_dict(self) -> Dict[str, Any]:
        """The window's points, the schedule of the next refit and the refit in force.

        Returns:
            Plain values (JSON).
        """
        return json.loads(self._native.state_json())  # type: ignore[no-any-return]

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores a ``state_dict()`` of a refit of the same model.

        Args:
            state: the state.

        Raises:
            ValueError: ``state`` is malformed.
        """
        self._native.load_state_json(json.dumps(state, allow_nan=False))
        self._model = MemoryModel(self._native.model) if self._native.refitted else self._given
        self._pending = []


ModelEntry = Tuple[int, Optional[str], Optional[Dict[str, float]], Optional[List[List[float]]]]
"""One entry of a state's ``training_refit`` ``models``: the first step planned with it, and its
formula text, coefficients and training ranges (``None, None, None``: the model given)."""

_STATE_FIELDS = ("window", "steps_seen", "next_try_points", "last_try_steps_seen", "formula", "coefficients",
                 "training_ranges", "given", "log")
"""What ``TrainingRefit.state_dict()`` holds."""


def checked_training_refit(entry: Any, what: str, variables: Sequence[str], steps_per_epoch: int) -> List[ModelEntry]:
    """A sampler state's ``training_refit`` checked before any of it is loaded: its ``models``
    (``checked_models``), its refit's ``state`` (``check_refit_state``), and the last of the
    models, the one the latest steps are planned with, the refit that state holds.

    Args:
        entry: the ``training_refit`` entry of a state dict.
        what: where it came from, for the errors (``"state_dict training_refit"``).
        variables: the formula's variables, in order.
        steps_per_epoch: the epoch's steps.

    Returns:
        The models' entries as tuples.

    Raises:
        ValueError: one line naming the field that is malformed, with its value.
    """
    models = checked_models(entry, what, variables, steps_per_epoch)
    state = entry["state"]
    check_refit_state(state, f"{what} state", variables)
    for field, mine, theirs in zip(("formula", "coefficients", "training ranges"), models[-1][1:],
                                   (state["formula"], state["coefficients"], state["training_ranges"])):
        if mine != theirs:
            raise ValueError(f"{what} models[{len(models) - 1}] (the model the latest steps are planned with) must be "
                             f"the refit its state holds, but its {field} {mine!r:.100} and the state's "
                             f"{theirs!r:.100} differ")
    return models


def checked_models(state: Any, what: str, variables: Sequence[str], steps_per_epoch: int) -> List[ModelEntry]:
    """The ``models`` of a sampler state's ``training_refit``: ``[[first step, formula text,
    {coefficient: bytes}, [[min, max] per variable]], ...]`` (``None, None, None``: the model
    given), the first steps from 0, increasing, at most the epoch's steps (a refit at the
    epoch's last step plans the next epoch); each refit's coefficients finite and >= 0, and its
    ranges [min, max] with 0 <= min <= max, one per variable. (The first entry may be a refit:
    a new epoch starts with the model in force.)

    Args:
        state: the ``training_refit`` entry of a state dict.
        what: where it came from, for the error.
        variables: the formula's variables, in order.
        steps_per_epoch: the epoch's steps.

    Returns:
        The entries as tuples.

    Raises:
        ValueError: one line naming what is malformed.
    """
    expected = (f"{what} must be {{'state': ..., 'models': [[first step, formula text or None, "
                "{coefficient: bytes} or None, [[min, max] per variable] or None], ...]}")
    try:
        if "state" not in state:
            raise KeyError("state")
        entries = [(first, formula, coefficients, ranges) for first, formula, coefficients, ranges in state["models"]]
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{expected}, got {str(state)[:120]}") from None
    firsts = [entry[0] for entry in entries]
    if not entries or any(isinstance(f, bool) or not isinstance(f, int) for f in firsts) or firsts[0] != 0 \
            or any(b <= a for a, b in zip(firsts, firsts[1:])):
        raise ValueError(f"{what}: the models' first steps must be whole numbers from 0, increasing; got {firsts}")
    if firsts[-1] > steps_per_epoch:
        raise ValueError(f"{what}: the models' first steps must be at most the epoch's {steps_per_epoch} steps; got "
                         f"{firsts}")
    for k, (_, formula, coefficients, ranges) in enumerate(entries):
        if not (formula is None and coefficients is None and ranges is None or
                _refit_shaped(formula, coefficients, ranges)):
            raise ValueError(f"{expected}, got the entry {[formula, coefficients, ranges]!r:.160}")
        problem = None if formula is None else _refit_values_problem(coefficients, ranges, variables)
        if problem is not None:
            raise ValueError(f"{what} models[{k}]: {problem}")
    return entries


def check_refit_state(state: Any, what: str, variables: Sequence[str]) -> None:
    """Raises unless ``state`` has the shape of a ``TrainingRefit.state_dict()`` (what the
    planner's ``xpm::TrainingRefit`` reads), naming the field that has not.

    Args:
        state: the ``state`` of a ``training_refit`` entry.
        what: where it came from, for the errors.
        variables: the formula's variables, in order.

    Raises:
        ValueError: not a dict, a field missing, or a field's value malformed (named, with it).
    """
    if not isinstance(state, dict):
        raise ValueError(f"{what} must be a dict of {', '.join(_STATE_FIELDS)}, got {state!r:.80}")
    missing = [name for name in _STATE_FIELDS if name not in state]
    if missing:
        raise ValueError(f"{what} has no '{missing[0]}' (a refit's state holds {', '.join(_STATE_FIELDS)})")
    for name, least in (("steps_seen", 0), ("next_try_points", 0), ("last_try_steps_seen", -1)):
        if not _whole_number(state[name]) or state[name] < least:
            raise ValueError(f"{what} {name} must be a whole number >= {least}, got {state[name]!r:.40}")
    if not isinstance(state["given"], str):
        raise ValueError(f"{what} given must be the digest of the model given (text), got {state['given']!r:.40}")
    if not isinstance(state["log"], list) or not all(isinstance(line, str) for line in state["log"]):
        raise ValueError(f"{what} log must be a list of lines of text, got {state['log']!r:.80}")
    _check_window(state["window"], f"{what} window", len(variables))
    refit = (state["formula"], state["coefficients"], state["training_ranges"])
    if refit != (None, None, None) and not _refit_shaped(*refit):
        raise ValueError(f"{what} formula, coefficients and training_ranges must be None (no refit) or a formula's "
                         f"text, {{coefficient: bytes}} and [[min, max] per variable], got {list(refit)!r:.160}")
    problem = None if refit[0] is None else _refit_values_problem(refit[1], refit[2], variables)
    if problem is not None:
        raise ValueError(f"{what}: {problem}")


def _check_window(window: Any, what: str, variables: int) -> None:
    """Raises unless ``window`` is ``[{'step': k, 'run_first': bool, 'points': [[dims...,
    peak_bytes, position], ...]}, ...]``, every dim and peak finite and >= 0, every position -1
    (none) or 0 to 3."""
    if not isinstance(window, list):
        raise ValueError(f"{what} must be a list of steps, got {window!r:.80}")
    for k, step in enumerate(window):
        if not isinstance(step, dict) or not {"step", "run_first", "points"} <= set(step) or \
                not _whole_number(step["step"]) or step["step"] < 0 or not isinstance(step["run_first"], bool) or \
                not isinstance(step["points"], list):
            raise ValueError(f"{what}[{k}] must be {{'step': whole number >= 0, 'run_first': bool, 'points': [...]}}, "
                             f"got {step!r:.120}")
        for j, row in enumerate(step["points"]):
            if not isinstance(row, list) or len(row) != variables + 2 or \
                    not all(_plain_number(v) and math.isfinite(v) and v >= 0 for v in row[:-1]) or \
                    row[-1] not in (-1, 0, 1, 2, 3) or isinstance(row[-1], bool):
                raise ValueError(f"{what}[{k}] points[{j}] must be {variables + 2} numbers: {variables} dims and the "
                                 f"peak bytes (finite, >= 0), then the position (-1: none, 0 to 3), got {row!r:.120}")


def _refit_shaped(formula: Any, coefficients: Any, ranges: Any) -> bool:
    """Whether ``(formula, coefficients, ranges)`` have the types of a refit's."""
    return isinstance(formula, str) and isinstance(coefficients, dict) and all(
        isinstance(name, str) and _plain_number(value) for name, value in coefficients.items()) and \
        isinstance(ranges, list) and all(isinstance(r, list) and len(r) == 2 and all(map(_plain_number, r))
                                         for r in ranges)


def _refit_values_problem(coefficients: Dict[str, float], ranges: List[List[float]],
                          variables: Sequence[str]) -> Optional[str]:
    """What is wrong with a refit's coefficients (each finite and >= 0) and training ranges (one
    per variable, each [min, max] with 0 <= min <= max: dims are >= 0), or None."""
    for name, value in coefficients.items():
        if not (math.isfinite(value) and value >= 0):
            return f"coefficient '{name}' must be a finite number >= 0, got {value!r}"
    if len(ranges) != len(variables):
        return f"{len(ranges)} refit region ranges for {len(variables)} variables {list(variables)}"
    for name, (low, high) in zip(variables, ranges):
        if not (math.isfinite(low) and math.isfinite(high) and 0 <= low <= high):
            return f"the training range of '{name}' is {[low, high]}: it must be [min, max] with 0 <= min <= max"
    return None


def _plain_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _whole_number(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
