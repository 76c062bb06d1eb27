"""The checks of ``PredictiveBatchSampler``'s arguments: whole numbers, the rank and world size
(torch.distributed's when its process group is initialised), the records' dims and units (finite,
>= 0, named with the first bad index) and the budget, each a one-line ``ValueError``; and of what
training reports back (the microbatch a peak is recorded for, the step ended).
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np
import torch
import torch.distributed

from .choices import MicrobatchPosition
from .memory_model import MemoryModel
from .record_dims import _numbers
from .sampler_steps import Microbatch


def _whole_number(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    return int(value)


def _true_or_false(name: str, value: Any) -> bool:
    """A bool option: ``True`` or ``False`` (numpy's too); anything else, whose truth would pick
    the option silently (``"no"`` is true), is a ValueError naming ``name`` and the value."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {value!r:.40}")
    return bool(value)


def _seed_number(name: str, value) -> int:
    """A shuffle's seed or epoch: a whole number >= 0 (numpy's generator takes no negative seed)."""
    number = _whole_number(name, value)
    if number < 0:
        raise ValueError(f"{name} must be a whole number >= 0 (it seeds the shuffle), got {number}")
    return number


def _rank_and_world_size(rank: Optional[int], world_size: Optional[int]) -> Tuple[int, int]:
    """``(rank, world_size)``: the given values, else torch.distributed's when it is initialised,
    else 0 and 1; ValueError when a given value contradicts an initialised process group."""
    rank = None if rank is None else _whole_number("rank", rank)
    world_size = None if world_size is None else _whole_number("world_size", world_size)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        actual_rank, actual_world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        for name, given in (("rank", rank), ("world_size", world_size)):
            if given is not None and given != (actual_rank if name == "rank" else actual_world):
                raise ValueError(f"{name}={given} but torch.distributed says this process is rank {actual_rank} "
                                 f"of {actual_world}; leave {name} out to use torch.distributed's")
        return actual_rank, actual_world
    return (0 if rank is None else rank), (1 if world_size is None else world_size)


def _first_bad(values: np.ndarray) -> Optional[int]:
    """Index of the first row with a NaN, an infinity or a negative value, or None."""
    bad = ~np.isfinite(values) | (values < 0)
    if values.ndim > 1:
        bad = bad.reshape(len(values), -1).any(axis=1)
    hits = np.flatnonzero(bad)
    return int(hits[0]) if len(hits) else None


def _checked_record_dims(record_dims: Any) -> np.ndarray:
    """The records' dims as float64, each finite and >= 0; TypeError for None, ValueError (the
    first bad record named) for anything else that is no dims."""
    if record_dims is None:
        raise TypeError("PredictiveBatchSampler: record_dims must be the records' dims ([n] lengths or "
                        "[n, variables] dims), got None")
    array = _numbers(record_dims, "record_dims must be numbers ([n] lengths or [n, variables] dims)")
    if array.ndim >= 1 and array.shape[0] == 0:
        raise ValueError("record_dims: no records")
    if array.ndim >= 1:
        bad = _first_bad(array)
        if bad is not None:
            value = array[bad].tolist()
            raise ValueError(f"record_dims[{bad}] is {value}: every record's dims must be finite and >= 0")
    return array


def _checked_outer_and_ranks(outer_batch_size: Any, rank: Optional[int],
                             world_size: Optional[int]) -> Tuple[int, int, int]:
    """``(outer_batch_size, rank, world_size)``, checked (see ``_rank_and_world_size``)."""
    outer_batch_size = _whole_number("outer_batch_size", outer_batch_size)
    if outer_batch_size < 1:
        raise ValueError(f"outer_batch_size must be >= 1, got {outer_batch_size}")
    rank, world_size = _rank_and_world_size(rank, world_size)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1 (the number of ranks), got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size), got rank {rank}, world_size {world_size}")
    return outer_batch_size, rank, world_size


def _check_sort_by(sort_by: Any, model: MemoryModel) -> None:
    """None, or one of the formula's variables (the packers sort by it)."""
    variables = list(model.formula.variable_names)
    if sort_by is not None and (not isinstance(sort_by, str) or sort_by not in variables):
        raise ValueError(f"PredictiveBatchSampler: sort_by {sort_by!r:.40} is not a variable of the formula "
                         f"({', '.join(variables)}); give one of them, or None (the first that is not the batch size)")


def _check_usable_bytes(usable_bytes: Any, model: MemoryModel) -> None:
    """A number of bytes > 0, at least the model's ``floor_bytes`` (else no microbatch can fit)."""
    if hasattr(usable_bytes, "usable_bytes") and not isinstance(usable_bytes, (int, float)):
        raise ValueError(f"usable_bytes must be a number of bytes, got a {type(usable_bytes).__name__}: pass its "
                         ".usable_bytes")
    if isinstance(usable_bytes, bool) or not isinstance(usable_bytes, (int, float, np.integer, np.floating)) \
            or not 1 <= usable_bytes < 2 ** 63:  # NaN fails the range; a fraction of a byte is dropped
        raise ValueError(f"usable_bytes must be a number of bytes in [1, 2**63), got {usable_bytes!r:.40}")
    if usable_bytes < model.floor_bytes:
        raise ValueError(f"usable_bytes {int(usable_bytes)} is below the model's floor_bytes "
                         f"{model.floor_bytes:.0f} (its steady state and optimizer step): no microbatch can fit; "
                         "raise the budget")


def _checked_units(units: Any, records: int) -> np.ndarray:
    """[records] loss units, finite and >= 0, not all 0 (default 1 each)."""
    what = f"units must be {records} numbers >= 0 (one per record)"
    array = np.ones(records) if units is None else _numbers(units, what)
    if array.shape != (records,):
        raise ValueError(f"units must be {records} values >= 0 (one per record), got shape {array.shape}")
    bad = _first_bad(array)
    if bad is not None:
        raise ValueError(f"units[{bad}] is {array[bad]}: every record's units must be finite and >= 0")
    if records and not array.any():
        raise ValueError("units are 0 for every record: every microbatch's weight would be 0 and nothing would "
                         "train (units count what a record adds to the loss, e.g. its tokens)")
    return array


def records_over_budget(model: MemoryModel, dims: np.ndarray, usable_bytes: float) -> Tuple[np.ndarray, np.ndarray]:
    """The records predicted over ``usable_bytes`` even alone.

    Args:
        model: the memory model.
        dims: [n, variables] every record's dims.
        usable_bytes: the budget, bytes.

    Returns:
        Their indices (int64, ascending) and every record's prediction alone ([n], bytes).
    """
    alone = np.asarray(model.predict(dims))
    return np.flatnonzero(alone > usable_bytes), alone


def checked_microbatch(microbatch: Any, what: str) -> Microbatch:
    """The ``Microbatch`` a peak is recorded for.

    Args:
        microbatch: what the caller gave.
        what: the method, for the error (``"record_peak"``).

    Returns:
        ``microbatch``.

    Raises:
        TypeError: not a ``Microbatch`` (its ``dims`` and ``predicted_bytes`` are what is recorded).
    """
    if not isinstance(microbatch, Microbatch):
        got = "None" if microbatch is None else f"a {type(microbatch).__name__}: {microbatch!r:.60}"
        raise TypeError(f"{what}: microbatch must be a Microbatch the sampler yielded (iter(sampler), with its dims "
                        f"and predicted_bytes), got {got}; a microbatch known by its records: "
                        "record_microbatch_peak(records, predicted_bytes, meter, position)")
    return microbatch


def checked_records(records: Any, count: int, position: Optional[MicrobatchPosition]) -> np.ndarray:
    """The record indices ``record_microbatch_peak`` is given: indices of the sampler's records,
    or none for an empty microbatch (lockstep's, of weight 0), which has no position in its step.

    Args:
        records: what the caller gave.
        count: the sampler's records.
        position: the microbatch's position given with them.

    Returns:
        The indices ([k] integers; none for an empty microbatch).

    Raises:
        ValueError: not a flat list of indices in [0, count), or none with a position.
    """
    try:
        indices = np.asarray(records) if records is not None and not isinstance(records, (str, bytes)) else None
    except (TypeError, ValueError):  # a ragged list
        indices = None
    if indices is None or indices.ndim != 1 or (len(indices) and (
            indices.dtype.kind not in "iu" or indices.min() < 0 or indices.max() >= count)):
        shown = indices[:8].tolist() if indices is not None and indices.ndim == 1 else records
        raise ValueError(f"record_microbatch_peak: records must be indices of the sampler's {count} records, got "
                         f"{shown!r:.80}")
    if len(indices) == 0 and position is not None:
        raise ValueError(f"record_microbatch_peak: records is empty but position is {position!r}: an empty microbatch "
                         "(lockstep's, weight 0) has no position in its step and no peak of its own; give the "
                         "records of the microbatch measured, or position None for an empty one")
    return indices


def check_step_to_end(step: int, steps_per_epoch: int, last_ended: Optional[int], passing: bool) -> None:
    """Raises unless ``step`` is a step of the epoch that ``end_step`` may end now: after the last
    one it ended in this pass over the epoch, or, with no pass of the sampler under way, 0 (an
    epoch started over: Lightning's ``planned_dataloader`` with worker processes iterates their
    copies of the sampler, so this one ends every epoch's steps without a ``set_epoch``).

    Args:
        step: the step to end (a whole number).
        steps_per_epoch: the epoch's steps.
        last_ended: the last step ended in this pass over the epoch, or None.
        passing: a pass of the sampler (``iter(sampler)``) is under way.

    Raises:
        ValueError: ``step`` is negative or beyond the epoch (or the epoch has no steps), was
            ended already, or comes before the last one ended.
    """
    if step < 0:
        raise ValueError(f"end_step: step must be a whole number >= 0, got {step}")
    if steps_per_epoch == 0:
        raise ValueError(f"end_step: step {step}: the epoch has no steps (drop_last left out its only outer batch, "
                         "shorter than outer_batch_size), so there is none to end")
    if step >= steps_per_epoch:
        raise ValueError(f"end_step: step {step} is beyond the epoch's {steps_per_epoch} steps (0 to "
                         f"{steps_per_epoch - 1})")
    if last_ended is not None and step <= last_ended and (step > 0 or passing):
        done = "was ended already" if step == last_ended else f"comes before the last step ended, {last_ended}"
        raise ValueError(f"end_step: step {step} {done}: each step of an epoch is ended once, in order "
                         "(set_epoch starts another epoch)")
