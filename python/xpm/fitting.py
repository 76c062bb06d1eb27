"""``fit``: a cost formula's coefficients fitted to measured peaks (by the planner core), with
the ``FitReport`` of what it measured, and the checks of its arguments.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Literal, Optional, Sequence, Tuple, Union

import numpy as np
from numpy.typing import ArrayLike

from . import _planner
from .choices import AGGREGATIONS, Aggregation, _check_aggregation
from .cost_formula import CostFormula
from .memory_model import MemoryModel
from .record_dims import _matrix

DEFAULT_USABLE_MAX_REL_ERROR: float = _planner.DEFAULTS["usable_max_rel_error"]
"""The largest fit and held-out error of a usable fit unless told (the C++ ``FitOptions``': 0.05)."""


def _vector(values, n: int, what: str) -> np.ndarray:
    array = np.ascontiguousarray(values, dtype=np.float64)
    if array.shape != (n,):
        raise ValueError(f"{what} must hold {n} values (one per row of the dims), got shape {list(array.shape)}")
    return array


def _batch_size_variable(variables: Sequence[str], given: Optional[str]) -> str:
    if given is not None:
        if given not in variables:
            raise ValueError(f"batch_size_variable '{given}' is not one of the formula's variables {list(variables)}")
        return given
    if "bs" in variables:
        return "bs"
    raise ValueError(f"batch_size_variable: the formula's variables {list(variables)} have no 'bs'; name the "
                     "one that counts records")


@dataclass
class FitReport:
    """What ``fit`` measured; ``usable`` rests on the fit error and the held-out error.

    Attributes:
        usable: whether the fit can be planned with (its error and held-out error within
            ``usable_max_rel_error``, among the checks ``reasons`` lists).
        reasons: why it is not usable (empty when it is).
        max_rel_error: the largest relative error, signed, ``(predicted - measured) / measured``.
        mean_rel_error: the mean relative error, signed.
        rel_errors: one relative error per measurement, signed.
        leave_one_out_max_rel_error: the largest held-out error (each distinct shape predicted by
            a refit without it), over the shapes that have a figure; NaN when none has.
        surrounded_held_out_max_rel_error: the same over the shapes inside the others' range
            (interpolation): the figure ``usable`` rests on; NaN when there is none.
        extrapolated_held_out_max_rel_error: the same over the shapes outside the others' range
            (extrapolation, reported apart); NaN when there is none.
        held_out_extrapolated: the measurements whose held-out figure is extrapolation.
        held_out_undetermined: the measurements with no held-out figure: without their shape
            the others do not determine the prediction there (NaN in the errors).
        held_out_note: what those rest on and what they need ("" when every shape has a figure).
        converged: whether the solver converged.
        brief_report: one line.
        full_report: the report, several lines.
        formula_selection: with ``formula="auto"``, the candidates tried and the one chosen; else "".
    """

    usable: bool
    reasons: List[str]
    max_rel_error: float
    mean_rel_error: float
    rel_errors: List[float]
    leave_one_out_max_rel_error: float
    surrounded_held_out_max_rel_error: float
    extrapolated_held_out_max_rel_error: float
    held_out_extrapolated: List[int]
    held_out_undetermined: List[int]
    held_out_note: str
    converged: bool
    brief_report: str
    full_report: str
    formula_selection: str = ""  # with formula="auto": the candidates tried and the one chosen


def _report(summary: dict, formula_selection: str = "") -> FitReport:
    fields = {name: summary[name] for name in FitReport.__dataclass_fields__ if name != "formula_selection"}
    return FitReport(**fields, formula_selection=formula_selection)


def fit(formula: Union[CostFormula, Literal["auto"]], dims: ArrayLike, peak_bytes: ArrayLike, *,
        variables: Optional[Sequence[str]] = None, infeasible_dims: Optional[ArrayLike] = None,
        infeasible_bytes: Optional[ArrayLike] = None, floor_bytes: float = 0.0,
        batch_size_variable: Optional[str] = None, aggregation: Optional[Dict[str, Aggregation]] = None,
        non_negative: bool = True,
        usable_max_rel_error: float = DEFAULT_USABLE_MAX_REL_ERROR) -> Tuple["MemoryModel", FitReport]:
    """Fits ``formula``'s coefficients to measured peaks (Ceres, relative residuals).

    Args:
        formula: the cost formula, or ``"auto"``: chosen from the measurements (candidates from
            ``variables``: the batch size times monomials up to degree 2 in the others, a
            constant, a floor, max() of up to three pieces; the best usable one by held-out
            error with a penalty for size; the report's ``formula_selection`` lists them).
        dims: [n, variables] in the formula's variable order (``variables`` with "auto").
        peak_bytes: [n] measured peak bytes.
        variables: the variable names, for ``formula="auto"`` only.
        infeasible_dims, infeasible_bytes: shapes that ran out of memory and the capacity they
            ran under, lower bounds of the prediction.
        floor_bytes: a constant floor of the prediction.
        batch_size_variable: the variable that counts records (default "bs").
        aggregation: how records combine per variable in a microbatch (``xpm.Aggregation``:
            "count", "max" or "sum"; default "max", the batch size's "count").
        non_negative: coefficients >= 0.
        usable_max_rel_error: the largest fit error and held-out (leave-one-shape-out) error
            that keep the fit usable.

    Returns:
        ``(MemoryModel, FitReport)``; the report says whether the fit is usable.

    Raises:
        ValueError: bad arguments (``variables`` missing with "auto" or given without it; an
            ``aggregation`` value that is not "count", "max" or "sum", named with its variable;
            arrays of the wrong shape or with a NaN, infinite or negative value, a batch size
            that is not a whole number >= 1), a formula the shapes cannot identify.
    """
    automatic = isinstance(formula, str)
    if (automatic and formula != "auto") or not (automatic or isinstance(formula, CostFormula)):
        raise ValueError(f"fit: formula must be a CostFormula or 'auto', got {formula!r}")
    _check_aggregation(aggregation, AGGREGATIONS, "fit")
    if automatic != (variables is not None):
        raise ValueError("fit: give variables=[...] with formula='auto', and only then")
    if automatic:
        formula = CostFormula("xpm_constant", list(variables))  # the variables; the formula is chosen
    width = len(formula.variable_names)
    dims_array = _matrix(dims, width, "dims")
    peaks = _vector(peak_bytes, len(dims_array), "peak_bytes")
    bounds = _matrix(np.zeros((0, width)) if infeasible_dims is None else infeasible_dims, width, "infeasible_dims")
    bound_bytes = _vector(np.zeros(0) if infeasible_bytes is None else infeasible_bytes, len(bounds), "infeasible_bytes")
    args = _planner.FitArguments()
    args.floor_bytes = float(floor_bytes)
    args.batch_size_variable = _batch_size_variable(formula.variable_names, batch_size_variable)
    column = list(formula.variable_names).index(args.batch_size_variable)
    for array, what in ((dims_array, "dims"), (bounds, "infeasible_dims")):
        counts = array[:, column]
        bad = np.flatnonzero((counts < 1) | (counts != np.floor(counts)))
        if len(bad):
            raise ValueError(f"fit: {what}[{int(bad[0])}] is {array[bad[0]].tolist()}: its {args.batch_size_variable} "
                             f"{counts[bad[0]]:g} is not a whole number >= 1 (the batch-size variable counts records)")
    args.aggregation = dict(aggregation or {})
    args.non_negative = non_negative
    args.usable_max_rel_error = usable_max_rel_error
    if automatic:
        args.automatic_variables = list(variables)
    native, summary, selection = _planner.fit(formula, dims_array, peaks, bounds, bound_bytes, args)
    return MemoryModel(native), _report(summary, selection)
