"""The checks of the sampler's resume state: a ``state_dict`` (the sampler's, in optimizer
steps, or its iterator's, in microbatches) loads only into a sampler of the same settings and
plan, and its positions must be in range; each refusal is a one-line ``ValueError``.
"""
from __future__ import annotations

import hashlib
from typing import Any, Dict, Optional, Tuple

from .memory_model import MemoryModel


def check_settings(state: Any, what: str, settings: Dict[str, Any]) -> None:
    """Raises unless ``state`` holds every one of ``settings`` with the same value.

    Args:
        state: the state loaded.
        what: its name, for the errors.
        settings: this sampler's settings (and plan fingerprint).

    Raises:
        ValueError: not a dict, a setting missing (not a sampler's state) or different (named).
    """
    if not isinstance(state, dict):
        raise ValueError(f"{what} must be a dict, got {type(state).__name__}")
    for key, mine in settings.items():
        if key not in state:
            raise ValueError(f"{what} has no '{key}': not the state_dict() of a PredictiveBatchSampler")
        if state.get(key) != mine:
            raise ValueError(f"{what} {key} {state.get(key)!r} differs from this sampler's {mine!r}")


def plan_fingerprint(rank: int, usable_bytes: int, sort_by: Optional[str], model: MemoryModel) -> Dict[str, Any]:
    """What an iterator's state must have been planned with besides the sampler's settings.

    Args:
        rank: this process's rank.
        usable_bytes: the budget.
        sort_by: the packer's sort variable.
        model: the memory model (16 hex digits of its JSON).

    Returns:
        The fingerprint (plain values).
    """
    digest = hashlib.sha256(model.to_json().encode()).hexdigest()[:16]
    return {"rank": rank, "usable_bytes": usable_bytes, "sort_by": sort_by, "model": digest}


def checked_steps_done(state: Dict[str, Any], steps_per_epoch: int) -> int:
    """A sampler state's ``steps_done``.

    Args:
        state: the sampler's ``state_dict``.
        steps_per_epoch: this sampler's steps per epoch.

    Returns:
        The steps done, in [0, steps_per_epoch].

    Raises:
        ValueError: missing or out of range.
    """
    steps_done = state.get("steps_done")
    if not isinstance(steps_done, int) or not 0 <= steps_done <= steps_per_epoch:
        raise ValueError(f"state_dict steps_done must be in [0, {steps_per_epoch}], got {steps_done!r}")
    return steps_done


def checked_pass_position(state: Dict[str, Any], total: int, epoch: int) -> Tuple[int, int]:
    """An iterator state's ``position`` and ``pass_start``, checked against its epoch's plan.

    Args:
        state: the iterator's ``state_dict``.
        total: the microbatches of the epoch as planned here.
        epoch: the state's epoch.

    Returns:
        ``(position, pass_start)``.

    Raises:
        ValueError: the state's epoch had another number of microbatches, or a position out of range.
    """
    position, pass_start = state.get("position"), state.get("pass_start")
    if state.get("microbatches") != total:
        raise ValueError(f"sampler iterator state_dict microbatches {state.get('microbatches')!r} differs from "
                         f"this sampler's {total} for epoch {epoch}")
    if not isinstance(position, int) or not 0 <= position <= total:
        raise ValueError(f"sampler iterator state_dict position must be in [0, {total}], got {position!r}")
    if not isinstance(pass_start, int) or not 0 <= pass_start <= position:
        raise ValueError(f"sampler iterator state_dict pass_start must be in [0, {position}], got {pass_start!r}")
    return position, pass_start
