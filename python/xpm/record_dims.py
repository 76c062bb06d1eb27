"""Dims arrays as the planner reads them: the check of a [n, variables] matrix (finite, >= 0,
one column per formula variable), record dims from record lengths, and the check of records'
dims against a model (one record each, the columns in the formula's order, not far beyond the
shapes the model was probed at).
"""
from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Any, List, Sequence

import numpy as np
from numpy.typing import ArrayLike

if TYPE_CHECKING:
    from .memory_model import MemoryModel


def _finite_number(value: Any) -> bool:
    """Whether ``value`` is a finite number: an int, or a float neither NaN nor infinite (not a
    bool, text or None)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        return False
    return isinstance(value, (int, np.integer)) or math.isfinite(value)


def _numbers(values: Any, what: str) -> np.ndarray:
    """``values`` as float64, refusing what numpy would convert but is no number of a record (text
    such as "3", booleans, None): ValueError "<what>: <error>"."""
    try:
        array = np.asarray(values)
        if array.dtype.kind not in "iuf":
            kind = "bool" if array.dtype.kind == "b" else "text" if array.dtype.kind in "US" else "non-numbers"
            first = array.flat[0] if array.size else None
            first = first.item() if isinstance(first, np.generic) else first  # an object array holds Python values
            raise TypeError(f"got {kind} such as {first!r}")
        return array.astype(np.float64)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{what}: {error}") from None


def _matrix(values, width: int, what: str) -> np.ndarray:
    """``values`` as a float64 [n, width] array (C order); ValueError naming ``what`` otherwise."""
    array = np.ascontiguousarray(values, dtype=np.float64)
    if array.ndim != 2 or array.shape[1] != width:
        raise ValueError(f"{what} must be an array of shape [n, {width}] (one column per formula variable), "
                         f"got shape {list(array.shape)}")
    # Two reductions, no temporary array (a million records: about a millisecond): the minimum
    # is NaN or negative when a value is, the maximum infinite when one is.
    if array.size and not (array.min() >= 0 and array.max() < np.inf):
        row = int(np.flatnonzero((~np.isfinite(array) | (array < 0)).any(axis=1))[0])
        raise ValueError(f"{what}[{row}] is {array[row].tolist()}: {what} must be finite and >= 0")
    return array


def record_dims_from_lengths(lengths: ArrayLike, variables: Sequence[str] = ("bs", "l"),
                             batch_size_variable: str = "bs") -> np.ndarray:
    """Record dims from record lengths: the batch-size variable 1, every other variable the length.

    For variables ("bs", "l") a record of length 12 is [1, 12]; for ("bs", "l", "t") (the padded
    length, aggregated by max, and the real tokens, summed) it is [1, 12, 12].

    Args:
        lengths: [n] record lengths, finite and >= 0.
        variables: the formula's variables, in its order; one of them ``batch_size_variable``.
        batch_size_variable: the variable that counts records.

    Returns:
        [n, len(variables)] float64 dims, C-contiguous.

    Raises:
        ValueError: fewer than two variables or none named ``batch_size_variable``; lengths not
            a 1-D array of finite values >= 0.
    """
    variables = list(variables)
    if len(variables) < 2 or batch_size_variable not in variables:
        raise ValueError(f"record_dims_from_lengths: two variables or more, one of them '{batch_size_variable}', "
                         f"expected, got {variables}")
    lengths = _numbers(lengths, "record_dims_from_lengths: lengths must be numbers")
    if lengths.ndim != 1:
        raise ValueError(f"record_dims_from_lengths: lengths must be a 1-D array, got shape {list(lengths.shape)}")
    bad = np.flatnonzero(~np.isfinite(lengths) | (lengths < 0))
    if len(bad):
        raise ValueError(f"record_dims_from_lengths: lengths[{int(bad[0])}] is {lengths[bad[0]]}: every length must be "
                         "finite and >= 0")
    columns = [np.ones_like(lengths) if name == batch_size_variable else lengths for name in variables]
    return np.ascontiguousarray(np.stack(columns, axis=1))


# A record dim this many times the largest value the model was probed at is most likely a
# column in the wrong place (or the wrong unit), not a real record.
FAR_BEYOND_PROBED = 4.0


def _record_dims(record_dims, model: "MemoryModel", what: str) -> np.ndarray:
    """[n, variables] record dims, or a 1-D array of lengths for a two-variable model.

    Args:
        record_dims: [n, variables] dims (formula order, the batch-size entry 1) or [n] lengths.
        model: the memory model whose variables the columns are.
        what: the argument's name, for the errors.

    Returns:
        The dims as a float64 [n, variables] array (the given one when it is already that, C order).

    Raises:
        ValueError: a wrong shape; a NaN, infinite or negative value; a record whose batch-size
            entry is not 1 (named with its index, its dims and the formula's variable order).
    Warns:
        RuntimeWarning: a column reaches more than ``FAR_BEYOND_PROBED`` times the largest value
            its variable was probed at (likely swapped columns), once per call.
    """
    variables = list(model.formula.variable_names)
    array = np.asarray(record_dims, dtype=np.float64)
    if array.ndim == 1 and len(variables) == 2:
        array = record_dims_from_lengths(array, variables, model.batch_size_variable)
    else:
        array = _matrix(array, len(variables), what)
        _check_one_record_each(array, variables, model.batch_size_variable, what)
    _warn_far_beyond_probed(array, variables, model, what)
    return array


def _check_one_record_each(array: np.ndarray, variables: List[str], batch_size_variable: str, what: str) -> None:
    if not len(array) or batch_size_variable not in variables:
        return
    column = array[:, variables.index(batch_size_variable)]
    if column.min() == 1 and column.max() == 1:  # two reductions, no temporary: the usual case
        return
    row = int(np.flatnonzero(column != 1)[0])
    raise ValueError(f"{what}[{row}] is {array[row].tolist()}: every record's '{batch_size_variable}' must be 1 "
                     f"(one record); the columns must be the formula's variables in the order {variables}")


def _warn_far_beyond_probed(array: np.ndarray, variables: List[str], model: "MemoryModel", what: str) -> None:
    if not len(array):
        return
    ranges = model.probed_ranges
    for k, name in enumerate(variables):
        if name == model.batch_size_variable or name not in ranges or ranges[name][1] <= 0:
            continue
        largest, probed = float(array[:, k].max()), ranges[name][1]
        if largest > FAR_BEYOND_PROBED * probed:
            warnings.warn(f"xpm: {what} column '{name}' reaches {largest:g}, {largest / probed:.1f}x the largest "
                          f"'{name}' the model was probed at ({probed:g}): are the columns in the formula's order "
                          f"{variables}? (predictions that far out are extrapolations)", RuntimeWarning, stacklevel=4)
            return
