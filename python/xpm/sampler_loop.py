"""``microbatch_loop``: a training loop's walk over a loader of ``PredictiveBatchSampler``'s
microbatches, yielding ``(batch, weight, last)``, counting the steps done (for the sampler's
``state_dict``), measuring each microbatch's peak for the calibration and checking the memory
allocated at each step's start (``check_unplanned_memory``).
"""
from __future__ import annotations

import warnings
from typing import Any, Iterable, Iterator, Optional, Tuple

import torch

from .meters import Meter, start_peak
from .predictive_batch_sampler import PredictiveBatchSampler
from .sampler_pass import _MicrobatchIterator
from .sampler_steps import Microbatch
from .unplanned_memory import _unplanned_memory


def _holds_gradients(module: torch.nn.Module) -> bool:
    return any(p.grad is not None for p in module.parameters())


def microbatch_loop(loader: Iterable[Any], sampler: PredictiveBatchSampler, *, meter: Optional[Meter] = None,
                    module: Optional[torch.nn.Module] = None) -> Iterator[Tuple[Any, float, bool]]:
    """Yields ``(batch, weight, last)`` for every microbatch of ``loader``.

    Args:
        loader: a ``DataLoader`` (or torchdata ``StatefulDataLoader``, resumed or not) over
            ``batch_sampler=sampler``, or ``iter(sampler)`` itself.
        sampler: the loader's ``PredictiveBatchSampler``.
        meter: the meter the model was probed under; given, ``check_unplanned_memory`` runs
            before each step's first batch is fetched, and warns at most once per loop, and
            every microbatch's peak is measured (the meter's peak reset before it is handed out,
            read when the loop is resumed) for the sampler's calibration: ``record_meter_peak`` each
            microbatch, ``end_step`` after each step's last (on every rank: one all-reduce).
        module: the trained module, for ``check_unplanned_memory`` (gradients set to None);
            given, a step that starts with gradients allocated (a loop that zeroes them in
            place; the loop's first step is not looked at, since ``xpm.probe`` leaves the
            gradients allocated) while the sampler predicts its first microbatch without them
            switches the sampler to predicting it with them, with a warning.

    Returns:
        An iterator of ``(batch, weight, last)``: ``weight`` multiplies the microbatch's mean
        loss, ``last`` ends the optimizer step (step the optimizer, and under DDP let this
        backward all-reduce). The step counts as done when its last microbatch is handed out,
        so a ``sampler.state_dict()`` taken after that optimizer step resumes at the next step.

    Raises:
        RuntimeError: ``loader`` does not draw its batches from ``sampler``.

    Warns:
        RuntimeWarning: from ``check_unplanned_memory``, once per loop, when ``meter`` is given;
            once, when ``module`` holds gradients at a step's start while the sampler predicted
            the first microbatch without them.
    """
    iterator = iter(loader)
    # A DataLoader's iterator names the sampler it draws from (torch's and torchdata's alike).
    drawn_from = getattr(iterator, "_index_sampler", sampler)
    if drawn_from is not sampler:
        raise RuntimeError(f"microbatch_loop: the loader draws its batches from a {type(drawn_from).__name__}, not "
                           "the sampler; build it with DataLoader(dataset, batch_sampler=sampler)")
    position: Optional[int] = None
    check, step_starts = meter is not None, True
    measuring = meter is not None and sampler.calibration is not None
    handed_out: Optional[Microbatch] = None  # the microbatch being trained on, when measuring
    started_steps = 0                         # steps whose first microbatch this loop handed out
    while True:
        if handed_out is not None:
            sampler.record_meter_peak(handed_out, meter)
            if handed_out.last:
                sampler.end_step(handed_out.step)
            handed_out = None
        if check and step_starts:
            message = _unplanned_memory(meter, sampler._model, sampler._usable_bytes, module)[1]
            if message is not None:
                warnings.warn(message, RuntimeWarning, stacklevel=2)
                check = False  # once per loop
        try:
            batch = next(iterator)
        except StopIteration:
            return
        current = sampler._current
        if current is None:
            raise RuntimeError("microbatch_loop: the loader did not iterate the sampler; build it with "
                               "DataLoader(dataset, batch_sampler=sampler)")
        # A DataLoader iterator counts the batches it has yielded this pass (a resumed
        # StatefulDataLoader's count includes those before the checkpoint); any other iterator
        # yields the sampler's microbatches in order from where the pass began.
        yielded = getattr(iterator, "_num_yielded", None)
        if isinstance(yielded, int) and not isinstance(iterator, _MicrobatchIterator):
            position = current.pass_start + yielded - 1
        else:
            position = current.pass_start if position is None else position + 1
        if position >= current._offsets[-1]:
            raise RuntimeError(f"microbatch_loop: the loader's batch would be microbatch {position + 1} of an epoch "
                               f"of {current._offsets[-1]}; its batches must be the sampler's, in order")
        step, j = current.locate(position)
        if j == 0 and started_steps and module is not None and sampler._first_phase != "with_gradients" and \
                _holds_gradients(module):  # not at the loop's first step: the probe leaves gradients allocated
            sampler._gradients_held_from(step)
        started_steps += j == 0
        microbatches = current._steps[step].microbatches
        last = j == len(microbatches) - 1
        step_starts = last
        if last:
            sampler._step_finished(step, current._generation)
        if measuring:
            handed_out = current.microbatch(position)
            start_peak(meter)
        yield batch, current._steps[step].weights[j], last
