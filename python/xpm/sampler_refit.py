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


def checked_models(state: Any, what: str) -> List[Tuple[int, Optional[str], Optional[Dict[str, float]],
                                                        Optional[List[List[float]]]]]:
    """The ``models`` of a sampler state's ``training_refit``: ``[[first step, formula text,
    {coefficient: bytes}, [[min, max] per variable]], ...]`` (``None, None, None``: the model
    given), the first steps from 0, increasing.

    Args:
        state: the ``training_refit`` entry of a state dict.
        what: where it came from, for the error.

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
    for _, formula, coefficients, ranges in entries:
        given = formula is None and coefficients is None and ranges is None
        refitted = isinstance(formula, str) and isinstance(coefficients, dict) and all(
            isinstance(name, str) and _plain_number(value) for name, value in coefficients.items()) and \
            isinstance(ranges, list) and all(isinstance(r, list) and len(r) == 2 and all(map(_plain_number, r))
                                             for r in ranges)
        if not (given or refitted):
            raise ValueError(f"{expected}, got the entry {[formula, coefficients, ranges]!r:.160}")
    return entries


def _plain_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
