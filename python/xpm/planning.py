"""Cost formulas, fitted memory models, budgets and plans (the planner core, no torch needed).

Units: bytes for memory, dims in the formula's variable order (e.g. ``bs`` records, ``l`` padded
length). Errors are Python exceptions with the messages of the C++ library and the CLI:
``FormulaError`` (a ``ValueError`` with ``position``, ``column``, ``symbol``) for a bad
formula, ``ValueError`` for bad arguments, ``RuntimeError`` for an unusable fit.

The closed sets of string arguments are ``typing.Literal`` aliases (``PackerName``,
``Aggregation``, ``RecordAggregation``), each with its tuple of values for the run-time check,
whose one-line ``ValueError`` names the argument and the value, as the C++ library's do.

This module holds the budget (``MemoryBudget``) and the plans (``plan``, ``Plan``), and gathers
the rest of the planner core from the modules that hold it: ``choices`` (the closed sets),
``cost_formula`` (``CostFormula``, ``FormulaError``), ``record_dims`` (the checks of dims arrays,
``record_dims_from_lengths``), ``memory_model`` (``MemoryModel``) and ``fitting`` (``fit``,
``FitReport``); every name stays importable from here.

A formula fitted to measured peaks, then records planned into microbatches under a budget:

    >>> import numpy as np, xpm
    >>> formula = xpm.CostFormula("a*bs*l + b*bs + c", ["bs", "l"])
    >>> dims = np.array([[1, 10], [2, 10], [4, 20], [8, 40], [2, 40]], dtype=float)
    >>> peak_bytes = 100 * dims[:, 0] * dims[:, 1] + 30 * dims[:, 0] + 1000   # as measured
    >>> model, report = xpm.fit(formula, dims, peak_bytes)
    >>> report.usable, round(model.predict([4, 30]))
    (True, 13120)
    >>> records = np.array([[1, 30], [1, 10], [1, 20], [1, 40]], dtype=float)   # bs 1 each
    >>> planned = xpm.plan(records, model, usable_bytes=9000)
    >>> [round(b) for b in planned.predicted_bytes]     # three microbatches, each under 9000
    [5030, 7060, 2030]
    >>> [m.tolist() for m in planned.microbatches]      # the records of each
    [[3], [0, 2], [1]]
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import List, Optional, Union

import numpy as np
from numpy.typing import ArrayLike

from . import _planner
from .choices import (AGGREGATIONS, GRADIENT_PHASES, PACKERS, RECORD_AGGREGATIONS, Aggregation, GradientPhase,
                      PackerName, RecordAggregation, _check_choice)
from .cost_formula import CostFormula, FormulaError
from .fitting import DEFAULT_USABLE_MAX_REL_ERROR, FitReport, fit
from .memory_model import MemoryModel, _checked_model
from .record_dims import FAR_BEYOND_PROBED, _record_dims, record_dims_from_lengths

DEFAULT_MEMORY_FRACTION: float = _planner.DEFAULTS["memory_fraction"]
"""The share of the capacity a plan may use unless told (the C++ ``MemoryBudget``'s: 0.9)."""


class MemoryBudget(_planner.MemoryBudget):
    """The budget a microbatch's predicted peak must fit: ``capacity_bytes`` (the device's
    memory or the CPU cap) x ``memory_fraction`` - ``extra_overhead_bytes`` = ``usable_bytes``.
    The fraction is the margin for what the model misses (fit error, allocator rounding).

    Args:
        capacity_bytes: the device's memory or the CPU meter's cap, bytes (a whole number; a
            float with a whole value is taken).
        memory_fraction: the share of the capacity the predictions may fill, in (0, 1].
        extra_overhead_bytes: bytes reserved besides (DDP's gradient buckets, a cache made after
            probing).

    Attributes:
        capacity_bytes: as given, bytes.
        memory_fraction: as given.
        extra_overhead_bytes: as given, bytes.
        usable_bytes: ``capacity_bytes * memory_fraction - extra_overhead_bytes``, bytes: what
            ``plan`` and ``PredictiveBatchSampler`` fill.

    Raises:
        ValueError: a value that is not a whole number of bytes, or out of range (named).

    Example:
        >>> MemoryBudget(2_000_000_000).usable_bytes        # 90 % by default
        1800000000
        >>> MemoryBudget(2_000_000_000, 0.8, extra_overhead_bytes=100_000_000).usable_bytes
        1500000000
    """

    def __init__(self, capacity_bytes: Union[int, float], memory_fraction: float = DEFAULT_MEMORY_FRACTION,
                 extra_overhead_bytes: Union[int, float] = 0) -> None:
        super().__init__(_whole_bytes(capacity_bytes, "MemoryBudget: capacity_bytes"), float(memory_fraction),
                         _whole_bytes(extra_overhead_bytes, "MemoryBudget: extra_overhead_bytes"))


def _whole_bytes(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or \
            not math.isfinite(value) or value != int(value):
        raise ValueError(f"{what} must be a whole number of bytes, got {value!r}")
    if not -(1 << 63) <= int(value) < (1 << 63):
        raise ValueError(f"{what} is out of range: {value!r}")
    return int(value)


@dataclass
class Plan:
    """Microbatches of one list of records (``plan``'s result); ``len(plan)``: the microbatches.

    Attributes:
        indices: the record indices of every microbatch, one after the other (int64 [n]).
        offsets: microbatch k is ``indices[offsets[k]:offsets[k + 1]]`` (int64 [m + 1]).
        dims: each microbatch's aggregated dims ([m, variables], the formula's order).
        predicted_bytes: each microbatch's predicted peak, bytes ([m]).
        over_budget: per microbatch, a record that does not fit even alone (bool [m]).
    """

    indices: np.ndarray
    offsets: np.ndarray
    dims: np.ndarray
    predicted_bytes: np.ndarray
    over_budget: np.ndarray

    def __len__(self) -> int:
        """The number of microbatches."""
        return len(self.offsets) - 1

    @property
    def microbatches(self) -> List[np.ndarray]:
        """The record indices (int64 array) of each microbatch."""
        return [self.indices[self.offsets[k]:self.offsets[k + 1]] for k in range(len(self))]


def plan(record_dims: ArrayLike, model: MemoryModel, usable_bytes: int, *, packer: PackerName = "adaptive",
         sort_by: Optional[str] = None) -> Plan:
    """Splits records into microbatches predicted to fit ``usable_bytes``.

    Args:
        record_dims: [n, variables] (each record's dims in the formula's variable order, its
            batch-size entry 1) as a NumPy array or sequences. A C-contiguous float64 array is
            read in place by the C++ packer, without a copy, while the GIL is released (do not
            write to it from another thread meanwhile); another dtype or layout is converted
            once. For a model of two variables, a 1-D array of lengths
            (``record_dims_from_lengths``).
        model: the fitted memory model.
        usable_bytes: the budget every microbatch's predicted peak must fit, bytes (for a model
            with a ``reserved_gap``, probed under a caching allocator, the budget of the reserved
            bytes: its predictions fill ``(usable_bytes - intercept) / (1 + slope)``).
        packer: ``xpm.PackerName``: "adaptive" (grow while it fits, heaviest first by
            ``sort_by``: the fewest microbatches), "fastest" (the sorted records cut into the
            runs of least predicted time, by the model's time model, which ``xpm.probe`` fits
            from the probes' timings), "ffd" (first fit decreasing) or "uniform" (equal slices).
        sort_by: the variable the adaptive and fastest packers sort by, heaviest first; default
            the first variable that is not the batch size; "" keeps record order.

    Returns:
        The ``Plan``: the same microbatches as the C++ packer (and ``xpm-plan plan``) for the
        same model file. Deterministic: every rank gets the same plan.

    Raises:
        TypeError: ``model`` is not an ``xpm.MemoryModel`` (a path: ``xpm.MemoryModel.load`` reads it).
        ValueError: an unknown packer (``plan: packer must be 'adaptive', 'fastest', 'ffd' or
            'uniform', got 'FFD'``), "fastest" with a model without a time model, dims of the wrong shape, a negative or non-finite dim (named
            with its record's index), a record whose batch-size entry is not 1 (dims in the wrong
            order), ``usable_bytes`` <= 0, or ``sort_by`` not a record variable of the formula.

    Warns:
        RuntimeWarning: a column reaches more than 4 times the largest value its variable was
            probed at (likely columns in the wrong order); records predicted over the budget
            even alone (each planned alone, marked in ``Plan.over_budget``), as the sampler warns.
    """
    _checked_model(model, "plan")
    _check_choice(packer, PACKERS, "plan: packer")
    if isinstance(usable_bytes, bool) or not isinstance(usable_bytes, (int, float, np.integer, np.floating)) \
            or not usable_bytes > 0:
        raise ValueError(f"plan: usable_bytes must be a number of bytes > 0, got {usable_bytes!r}")
    inner = model._native.prediction_budget_bytes(int(usable_bytes))
    planned = _pack(_record_dims(record_dims, model, "record_dims"), model, inner, packer, sort_by)
    over = int(np.count_nonzero(planned.over_budget))  # each such microbatch holds one record
    if over:
        room = f"{int(usable_bytes)} bytes" if inner == int(usable_bytes) else \
            f"{int(usable_bytes)} bytes (its predictions {inner} bytes)"
        warnings.warn(f"xpm: {over} record(s) do not fit the budget of {room} even alone (predicted up to "
                      f"{planned.predicted_bytes[planned.over_budget].max():.0f} bytes, or at a shape a probe ran out "
                      "of memory at); each gets a microbatch of its own (Plan.over_budget marks them)",
                      RuntimeWarning, stacklevel=2)
    return planned


def _pack(array: np.ndarray, model: MemoryModel, usable_bytes: int, packer: PackerName,
          sort_by: Optional[str]) -> Plan:
    """``plan`` of record dims already checked (a float64 [n, variables] array)."""
    return Plan(*_planner.pack(packer, _sort_by_or_default(sort_by, model), array, model._native, int(usable_bytes)))


def _sort_by_or_default(sort_by: Optional[str], model: MemoryModel) -> str:
    """``sort_by``, or by default the formula's first variable other than the batch size."""
    if sort_by is not None:
        return sort_by
    return next((v for v in model.formula.variable_names if v != model.batch_size_variable), "")


__all__ = ["FormulaError", "PackerName", "PACKERS", "Aggregation", "AGGREGATIONS", "RecordAggregation",
           "RECORD_AGGREGATIONS", "GradientPhase", "GRADIENT_PHASES", "DEFAULT_MEMORY_FRACTION",
           "DEFAULT_USABLE_MAX_REL_ERROR", "MemoryBudget", "CostFormula", "record_dims_from_lengths",
           "FAR_BEYOND_PROBED", "MemoryModel", "FitReport", "fit", "Plan", "plan"]
