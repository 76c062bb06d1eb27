"""The closed sets of string arguments of the planner (``PackerName``, ``Aggregation``,
``RecordAggregation``, ``GradientPhase``, ``MicrobatchPosition``): each a ``typing.Literal``
alias for type checkers and a tuple of its values for the run-time check, and that check, whose
one-line ``ValueError`` names the argument and the value, as the C++ library's messages do.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, Optional, Sequence, Tuple

from . import _planner

PackerName = Literal["adaptive", "fastest", "ffd", "uniform"]
"""A packer of ``plan`` and ``PredictiveBatchSampler``: "adaptive", "fastest", "ffd" or "uniform"."""
PACKERS: Tuple[PackerName, ...] = tuple(sorted(_planner.packer_names()))  # type: ignore[assignment]
"""The C++ library's packers (its table in packer_kind.cpp), by name; ``PackerName`` is their
``Literal`` for type checkers (a test keeps the two equal)."""

Aggregation = Literal["count", "max", "sum"]
"""How a variable combines over a microbatch's records in a fitted model (``fit``): "count"
(the number of records: the batch size's rule), "max" (padded) or "sum"."""
AGGREGATIONS: Tuple[Aggregation, ...] = ("count", "max", "sum")

RecordAggregation = Literal["max", "sum"]
"""How a variable other than the batch size combines over a probe's records (``probe``): "max"
(padded to the longest) or "sum" (real tokens)."""
RECORD_AGGREGATIONS: Tuple[RecordAggregation, ...] = ("max", "sum")

GradientPhase = Literal["with_gradients", "without_gradients", "synchronised"]
"""Which state of a step a microbatch's forward and backward run in
(``MemoryModel.predict(phase=...)``): "with_gradients", a step's later microbatches (and every
microbatch of a loop that zeroes gradients in place); "without_gradients", the first microbatch
of a step after ``zero_grad(set_to_none=True)``, the default of torch 2.x, the HF Trainer,
Lightning and accelerate, whose backward allocates the gradients as it goes; "synchronised", the
last microbatch of a step under FSDP2's accumulation (``set_requires_gradient_sync(False)`` on
the earlier ones), whose backward reduce-scatters and frees each layer's accumulated unsharded
gradient as it goes."""
GRADIENT_PHASES: Tuple[GradientPhase, ...] = ("with_gradients", "without_gradients", "synchronised")

MicrobatchPosition = Literal["first", "middle", "last", "alone"]
"""Where a microbatch runs in its rank's optimizer step (``xpm.Correction`` has a line per
position): "first" of several (after ``zero_grad(set_to_none=True)`` its backward allocates the
gradients among its activations), "middle", "last" of several (the gradients' synchronisation,
and the optimizer step where the peak measured includes it), or "alone" (a step of one)."""
MICROBATCH_POSITIONS: Tuple[MicrobatchPosition, ...] = ("first", "middle", "last", "alone")


def microbatch_position(index: int, count: int) -> MicrobatchPosition:
    """The position of microbatch ``index`` (0-based) of a step of ``count`` microbatches.

    Args:
        index: the microbatch's index among its rank's microbatches with records in the step.
        count: how many microbatches with records the step has on that rank (lockstep's empty
            ones have no position).

    Returns:
        "alone" when ``count`` is 1, else "first", "last" or "middle".

    Raises:
        ValueError: ``index`` is not below ``count``.
    """
    return _planner.microbatch_position(int(index), int(count))  # type: ignore[no-any-return]


def _name_list(choices: Sequence[str]) -> str:
    """``'a', 'b' or 'c'``, as the C++ library's messages list a closed set."""
    names = [f"'{c}'" for c in choices]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _check_choice(value: Any, choices: Sequence[str], what: str) -> None:
    """ValueError, one line, when ``value`` is not one of ``choices`` (case-sensitive): ``what``
    names where it came from (``"plan: packer"``, ``"probe: aggregation['t']"``), as in
    ``plan: packer must be 'adaptive', 'fastest', 'ffd' or 'uniform', got 'FFD'``."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{what} must be {_name_list(choices)}, got {value!r}")


def _check_aggregation(aggregation: Optional[Mapping[str, str]], choices: Sequence[str], where: str) -> None:
    """Every value of ``aggregation`` one of ``choices`` (ValueError naming its variable)."""
    if aggregation is None:
        return
    if not isinstance(aggregation, Mapping):
        raise ValueError(f"{where}: aggregation must be a dict {{variable: {_name_list(choices)}}}, "
                         f"got {aggregation!r}")
    for name, how in aggregation.items():
        _check_choice(how, choices, f"{where}: aggregation[{name!r}]")
