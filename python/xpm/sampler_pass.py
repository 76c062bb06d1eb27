"""One pass of ``PredictiveBatchSampler`` over the rest of an epoch's microbatches (what
``iter(sampler)`` returns): it yields ``Microbatch``es in order, and its ``state_dict`` /
``load_state_dict`` (which torchdata's ``StatefulDataLoader`` saves and restores) resume it at
the exact microbatch.
"""
from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Tuple

from .sampler_checks import _whole_number
from .sampler_state import check_settings, checked_pass_position
from .sampler_steps import Microbatch

if TYPE_CHECKING:
    from .predictive_batch_sampler import PredictiveBatchSampler


class _MicrobatchIterator(Iterator[List[int]]):
    """One pass over the rest of an epoch's microbatches; ``state_dict``/``load_state_dict``
    make it resumable (torchdata's ``StatefulDataLoader`` saves and restores them)."""

    def __init__(self, sampler: PredictiveBatchSampler, position: int):
        self._sampler = sampler
        self._generation, self._epoch = sampler._generation, sampler._epoch
        self._steps, self._offsets = sampler._plan()
        self.pass_start = self.position = position   # microbatches of the epoch before them

    def __iter__(self) -> "_MicrobatchIterator":
        return self

    def locate(self, position: int) -> Tuple[int, int]:
        """(step, microbatch in the step) of the epoch's microbatch ``position``."""
        k = bisect.bisect_right(self._offsets, position) - 1
        return k, position - self._offsets[k]

    def microbatch(self, position: int) -> Microbatch:
        k, j = self.locate(position)
        step = self._steps[k]
        return Microbatch(step.microbatches[j].tolist(), dims=step.dims[j].copy(),
                          predicted_bytes=step.predicted_bytes[j], weight=step.weights[j],
                          last=j == len(step.microbatches) - 1, step=k,
                          correction_bytes=step.correction_bytes[j],
                          position=step.positions[j])

    def _is_current(self) -> bool:
        return self._sampler._current is self and self._sampler._generation == self._generation

    def __next__(self) -> Microbatch:
        if self.position >= self._offsets[-1]:
            if self._is_current():
                self._sampler._start = (0, 0)   # the pass is over: the next one starts the epoch over
            raise StopIteration
        microbatch = self.microbatch(self.position)
        self.position += 1
        return microbatch

    def state_dict(self) -> Dict[str, Any]:
        """The pass's position: its epoch, the epoch's microbatches before the next one, where the
        pass began, and the settings (the sampler's and the plan's) it must be loaded with."""
        sampler = self._sampler
        return {"epoch": self._epoch, "position": self.position, "pass_start": self.pass_start,
                "microbatches": self._offsets[-1], **sampler._settings(), **sampler._plan_fingerprint(),
                **sampler._calibration_state()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continues at ``state``'s microbatch of ``state``'s epoch. A state whose pass had
        yielded the whole epoch resumes nothing: the sampler is left as it was before the
        ``load_state_dict`` that came with it, so the next pass is the epoch ``set_epoch`` chose.

        Raises:
            ValueError: ``state`` was written for another plan (sampler settings, rank, budget,
                model) or its position is out of range.
        """
        sampler = self._sampler
        check_settings(state, "sampler iterator state_dict", {**sampler._settings(), **sampler._plan_fingerprint()})
        epoch = _whole_number("sampler iterator state_dict epoch", state.get("epoch"))
        before, generation = sampler._before_load, sampler._generation
        sampler._enter_epoch(epoch)
        sampler._load_calibration_state(state, "sampler iterator state_dict")
        self._generation, self._epoch = sampler._generation, epoch
        self._steps, self._offsets = sampler._plan()
        total = self._offsets[-1]
        position, pass_start = checked_pass_position(state, total, epoch)
        self.position, self.pass_start = position, pass_start
        if position == total:  # a finished pass: nothing to resume
            if before is not None and before[0] == generation:
                sampler._enter_epoch(before[1][0])
                sampler._steps_done, sampler._start = before[1][1], before[1][2]
            self._generation = -1  # detached: its end changes nothing
            return
        step, offset = self.locate(position)
        sampler._steps_done, sampler._start, sampler._current = step, (step, offset), self
