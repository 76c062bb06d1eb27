"""Cost formulas, fitted memory models, budgets and plans (the planner core, no torch needed).

Units: bytes for memory, dims in the formula's variable order (e.g. ``bs`` records, ``l`` padded
length). Errors are Python exceptions with the messages of the C++ library and the CLI:
``FormulaError`` (a ``ValueError`` with ``position``, ``column``, ``symbol``) for a bad
formula, ``ValueError`` for bad arguments, ``RuntimeError`` for an unusable fit.

The closed sets of string arguments are ``typing.Literal`` aliases (``PackerName``,
``Aggregation``, ``RecordAggregation``), each with its tuple of values for the run-time check,
whose one-line ``ValueError`` names the argument and the value, as the C++ library's do.

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

import json
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple, Union

import numpy as np
from numpy.typing import ArrayLike

from . import _planner

FormulaError = _planner.FormulaError

# ---- closed sets of string arguments: a Literal for type checkers, a tuple for the runtime check
PackerName = Literal["adaptive", "fastest", "ffd", "uniform"]
"""A packer of ``plan`` and ``PredictiveBatchSampler``: "adaptive", "fastest", "ffd" or "uniform"."""
DEFAULT_MEMORY_FRACTION: float = _planner.DEFAULTS["memory_fraction"]
"""The share of the capacity a plan may use unless told (the C++ ``MemoryBudget``'s: 0.9)."""
DEFAULT_USABLE_MAX_REL_ERROR: float = _planner.DEFAULTS["usable_max_rel_error"]
"""The largest fit and held-out error of a usable fit unless told (the C++ ``FitOptions``': 0.05)."""
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
        super().__init__(_whole_bytes(capacity_bytes, "capacity_bytes"), float(memory_fraction),
                         _whole_bytes(extra_overhead_bytes, "extra_overhead_bytes"))


def _whole_bytes(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or value != int(value):
        raise ValueError(f"{what} must be a whole number of bytes, got {value!r}")
    if not -(1 << 63) <= int(value) < (1 << 63):
        raise ValueError(f"{what} is out of range: {value!r}")
    return int(value)


class CostFormula(_planner.CostFormula):
    """A cost formula for a step's peak memory in bytes, e.g. ``a*bs*l^2 + b*bs*l + c``.

    ``CostFormula("a*bs*l + b*bs + c", ["bs", "l"])`` declares the variables; every other name
    is a coefficient (fitted, bytes per unit of its term), or give ``coefficients=[...]``.

    Args:
        text: the formula (``docs/formula.md`` has its grammar).
        variables: the variable names, in the order of every dims row (a list, not a string).
        coefficients: the coefficient names; default every name of ``text`` that is not a variable.
        allow_nonlinear: admit terms nonlinear in a coefficient, such as ``l^p``.

    Attributes:
        text: the formula as given.
        canonical: one spelling for equivalent formulas.
        identity_hash: 16 hex digits of the canonical formula.
        coefficient_names: the coefficients, in order.
        variable_names: the variables, in order.
        is_linear: whether the formula is linear in its coefficients.

    Raises:
        FormulaError: a formula that does not parse or is not allowed (its ``position``,
            ``column`` and ``symbol``).
        TypeError: ``variables`` or ``coefficients`` not a sequence of strings (a string alone:
            one line naming it).
    """

    def __init__(self, text: str, variables: Sequence[str], coefficients: Optional[Sequence[str]] = None,
                 allow_nonlinear: bool = False) -> None:
        for what, names in (("variables", variables), ("coefficients", coefficients)):
            if isinstance(names, str):
                example = [name.strip() for name in names.split(",")]
                raise TypeError(f"CostFormula: {what} must be a list of names, e.g. {example!r}, got the string "
                                f"{names!r}")
        super().__init__(text, variables, coefficients, allow_nonlinear)


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
    lengths = np.asarray(lengths, dtype=np.float64)
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


class MemoryModel:
    """A fitted memory model: ``predict(dims)`` in bytes, ``max_batch``, JSON ``load``/``save``.

    The files are those ``xpm-plan`` and ``xpm-train`` read and write (memory_model.json). Made
    by ``fit``, ``probe``, ``load`` or ``from_json``, not by hand.

    Args:
        native: the planner core's model.
    """

    def __init__(self, native: _planner.MemoryModel) -> None:
        self._native = native
        self._json: Optional[dict] = None  # to_json() parsed, on first use
        self._phase_natives: Dict[str, _planner.MemoryModel] = {}  # each phase's, built on first use
        self._floor: Optional[_planner.MemoryModel] = None  # the model with its formula at 0, on first use

    def _parsed(self) -> dict:
        if self._json is None:
            self._json = json.loads(self._native.to_json())
        return self._json

    @classmethod
    def load(cls, path: Union[str, os.PathLike]) -> "MemoryModel":
        """Reads a memory model JSON file (``save``'s, ``xpm-plan``'s, ``xpm-train``'s).

        Args:
            path: the file.

        Returns:
            The model.

        Raises:
            FileNotFoundError: no such file, or a directory.
            ValueError, RuntimeError: the file is not a memory model, or its ``metadata.phases``
                is malformed (named).
        """
        path = str(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"memory model '{path}': no such file" +
                                    (" (it is a directory)" if os.path.isdir(path) else ""))
        model = cls(_planner.MemoryModel.load(path))
        model._check_phases(f"memory model '{path}'")
        return model

    @classmethod
    def from_json(cls, text: str) -> "MemoryModel":
        """The model of ``to_json()`` text (e.g. sent from rank 0).

        Args:
            text: ``to_json()``'s JSON.

        Returns:
            The model.

        Raises:
            ValueError: ``text`` is not a memory model's JSON (one line, the parser's reason), or
                its ``metadata.phases`` is malformed (the phase named).
        """
        try:
            model = cls(_planner.MemoryModel.from_json(text))
        except (ValueError, RuntimeError) as error:
            raise ValueError(f"memory model JSON: {error}") from None
        model._check_phases("memory model JSON")
        return model

    def _check_phases(self, source: str) -> None:
        """Raises ValueError naming ``metadata.phases``' first malformed record (``xpm.probe``
        writes them: {phase: {"coefficients": {name: bytes}, ...}})."""
        phases = self._parsed().get("metadata", {}).get("phases", {})
        if not isinstance(phases, dict):
            raise ValueError(f"{source}: metadata.phases must be an object {{phase: record}}, got {phases!r}")
        names = set(self.formula.coefficient_names)
        for phase, record in phases.items():
            if phase not in GRADIENT_PHASES[1:]:
                raise ValueError(f"{source}: metadata.phases has {phase!r}; a phase fitted apart is "
                                 f"{_name_list(GRADIENT_PHASES[1:])}")
            coefficients = record.get("coefficients") if isinstance(record, dict) else None
            if not isinstance(coefficients, dict) or set(coefficients) != names or \
                    not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in coefficients.values()):
                raise ValueError(f"{source}: metadata.phases[{phase!r}] must hold 'coefficients', a number of bytes "
                                 f"for each of {', '.join(sorted(names))}; got {record!r}")

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Writes the model (temporary file, then rename: never half-written).

        Args:
            path: the file, replaced when it exists.

        Raises:
            RuntimeError: the file cannot be written (named).
        """
        self._native.save(str(path))

    def to_json(self) -> str:
        """The model as JSON text (the file ``save`` writes; ``from_json`` reads it back).

        Returns:
            The JSON text.
        """
        return self._native.to_json()

    @property
    def formula(self) -> _planner.CostFormula:
        """The fitted cost formula (bytes)."""
        return self._native.formula

    @property
    def coefficients(self) -> Dict[str, float]:
        """Fitted coefficients by name, bytes per unit of their term."""
        return dict(zip(self.formula.coefficient_names, self._native.coefficients))

    @property
    def floor_bytes(self) -> float:
        """The prediction's floor, bytes: no prediction is below it."""
        return self._native.floor_bytes

    @property
    def batch_size_variable(self) -> str:
        """The variable that counts records (its aggregation is "count")."""
        return self._native.batch_size_variable

    @property
    def single_record_factor(self) -> float:
        """Microbatches of one record peak above the trend of larger ones (another kernel at
        batch 1): the formula's prediction at batch size 1 is scaled by this; 1.0 otherwise."""
        return self._native.single_record_factor

    @property
    def probed_ranges(self) -> Dict[str, Tuple[float, float]]:
        """``{variable: (min, max)}`` over the shapes the model was fitted to (its feasible probes,
        or the dims given to ``fit``); empty for a model file that does not record them."""
        return {name: (float(span[0]), float(span[1])) for name, span in self._parsed().get("probed_ranges", {}).items()}

    @property
    def time_model(self) -> Optional[Dict[str, float]]:
        """How long a microbatch's forward and backward take, fitted to the probes' timings on
        the machine that probed: ``overhead_s`` (every microbatch) + ``seconds_per_byte`` x the
        bytes of activations its records add (the formula at its dims less its value at batch
        size 0), with ``max_rel_error`` and ``fitted_points``; what ``packer="fastest"``
        minimises. None for a model fitted to given measurements (``fit``)."""
        record = self._parsed().get("metadata", {}).get("time_model")
        return None if record is None else dict(record)

    @property
    def static_bytes(self) -> Optional[float]:
        """Bytes allocated when ``xpm.probe`` began probing (weights, every gradient, the
        optimizer's state, whatever else was alive), as its meter counted them; None for a model
        fitted to given measurements (``fit``)."""
        value = self._parsed().get("metadata", {}).get("static_bytes")
        return None if value is None else float(value)

    @property
    def phases(self) -> List[GradientPhase]:
        """The gradient phases the model predicts apart: always "with_gradients" (the
        coefficients above); "without_gradients" and "synchronised" too when ``xpm.probe``
        measured that phase and fitted it (``phase_report``)."""
        return ["with_gradients"] + [p for p in GRADIENT_PHASES[1:] if p in self._phase_records()]

    def _phase_records(self) -> Dict[str, Dict[str, Any]]:
        return self._parsed().get("metadata", {}).get("phases", {})

    def phase_report(self, phase: GradientPhase) -> Dict[str, Any]:
        """What the fit of a phase measured: ``coefficients`` {name: bytes}, ``max_rel_error``
        (signed, over its fitted shapes), ``fitted_points``.

        Args:
            phase: one of ``phases``.

        Returns:
            The phase's record (for "with_gradients": the model's own coefficients and fit).

        Raises:
            ValueError: ``phase`` is not a ``GradientPhase``, or the model has no fit of it.
        """
        _check_choice(phase, GRADIENT_PHASES, "phase")
        if phase == "with_gradients":
            fit_record = self._parsed().get("metadata", {}).get("fit", {})
            return {"coefficients": self.coefficients, "max_rel_error": fit_record.get("max_rel_error"),
                    "fitted_points": fit_record.get("fitted_points")}
        if phase not in self.phases:
            raise ValueError(f"phase: this model has no fit of '{phase}' (its phases: {', '.join(self.phases)})")
        return dict(self._phase_records()[phase])

    def _with_phase(self, phase: GradientPhase, coefficients: Sequence[float], single_record_factor: float,
                    max_rel_error: float, fitted_points: int) -> "MemoryModel":
        """This model with a fit of ``phase``: the same formula and floor, its own coefficients
        (kept in the JSON, so the phase travels with ``to_json`` and ``save``)."""
        parsed = json.loads(self.to_json())
        parsed.setdefault("metadata", {}).setdefault("phases", {})[phase] = {
            "coefficients": dict(zip(self.formula.coefficient_names, map(float, coefficients))),
            "single_record_factor": float(single_record_factor), "max_rel_error": float(max_rel_error),
            "fitted_points": int(fitted_points)}
        return MemoryModel.from_json(json.dumps(parsed))

    @property
    def reserved_gap(self) -> Optional[Tuple[float, float]]:
        """Where the model was probed under a caching allocator (a GPU, or the CPU meter with
        ``caching=True``): the line from its predictions, which are allocated bytes, to the reserved
        peaks the probes measured, ``(intercept_bytes, slope)`` (reserved ~ prediction +
        intercept_bytes + slope x prediction, covering every probe); the sampler's calibration
        starts from it. None: probed without one."""
        gap = self._parsed().get("metadata", {}).get("reserved_gap")
        return None if gap is None else (float(gap["intercept_bytes"]), float(gap["slope"]))

    def _with_reserved_gap(self, intercept_bytes: float, slope: float, points: int) -> "MemoryModel":
        """This model with its ``reserved_gap`` (kept in the JSON's metadata, with the number of
        probe points the line covers: a probe's step and its first microbatch count apart)."""
        parsed = json.loads(self.to_json())
        parsed.setdefault("metadata", {})["reserved_gap"] = {
            "intercept_bytes": float(intercept_bytes), "slope": float(slope), "points": int(points)}
        return MemoryModel.from_json(json.dumps(parsed))

    def _phase_native(self, phase: GradientPhase, floor: bool = True) -> Optional[_planner.MemoryModel]:
        """A phase other than "with_gradients" as a model of its own (this model's JSON with the
        phase's coefficients; without its floor when ``floor`` is False), or None without a fit
        of it."""
        record = self._phase_records().get(phase)
        if record is None:
            return None
        key = phase if floor else f"{phase} without floor"
        if key not in self._phase_natives:
            self._phase_natives[key] = self._native_with(record["coefficients"],
                                                         record.get("single_record_factor", 1.0), floor)
        return self._phase_natives[key]

    def _native_with(self, coefficients: Dict[str, float], single_record_factor: float,
                     floor: bool = True) -> _planner.MemoryModel:
        """This model (formula, floor unless ``floor`` is False, ranges) with other coefficients
        and single-record factor."""
        parsed = dict(self._parsed())
        parsed["coefficients"] = coefficients
        parsed.pop("single_record_factor", None)
        if single_record_factor != 1.0:
            parsed["single_record_factor"] = single_record_factor
        if not floor:
            parsed["floor_bytes"] = 0.0
            parsed.pop("floor_formula", None)
        return _planner.MemoryModel.from_json(json.dumps(parsed))

    def floor_at(self, dims: ArrayLike) -> np.ndarray:
        """The prediction's floor at each row of ``dims`` (the constant floor, or the floor
        formula where the optimizer step's peak grows with the dims), bytes.

        Args:
            dims: [n, variables] rows in the formula's variable order.

        Returns:
            A float64 [n] array.

        Raises:
            ValueError: dims of the wrong width, or a NaN, infinite or negative value.
        """
        if self._floor is None:
            self._floor = self._native_with({name: 0.0 for name in self.formula.coefficient_names}, 1.0)
        return _planner.predict(self._floor, _matrix(dims, len(self.formula.variable_names), "dims"))

    def predict(self, dims: ArrayLike, phase: GradientPhase = "with_gradients", *,
                floor: bool = True) -> Union[float, np.ndarray]:
        """Predicted peak bytes.

        Args:
            dims: one row of the formula's variables (in its order), or one row per microbatch
                ([n, variables]); finite and >= 0.
            phase: ``xpm.GradientPhase``: "with_gradients" (the default, the steady state the
                probes measure), "without_gradients" (a step's first microbatch after
                ``zero_grad(set_to_none=True)``) or "synchronised" (the last microbatch of a
                step under FSDP2's accumulation): the phase's own fit, never above the
                "with_gradients" prediction; the "with_gradients" prediction when the model has
                no fit of it (``phases``).
            floor: False: the phase's fit without the model's floor (``floor_bytes``, the
                optimizer step's peak), for a microbatch with no optimizer step in it (a step's
                first of several); only where the model has a fit of ``phase`` other than
                "with_gradients", else the prediction as with True.

        Returns:
            The predicted peak in bytes: a ``float`` for one row, a float64 [n] array for rows.

        Raises:
            ValueError: dims of the wrong width or shape, or a NaN, infinite or negative value
                (named with its row); a ``phase`` that is not a ``GradientPhase``.
        """
        _check_choice(phase, GRADIENT_PHASES, "phase")
        width = len(self.formula.variable_names)
        array = np.asarray(dims, dtype=np.float64)
        single = array.ndim == 1
        rows = _matrix(array.reshape(1, -1) if single else array, width, "dims")
        out = _planner.predict(self._native, rows)
        phase_native = self._phase_native(phase) if phase != "with_gradients" else None
        if phase_native is not None and not floor:
            phase_native = self._phase_native(phase, floor=False)
        if phase_native is not None:
            out = np.minimum(out, _planner.predict(phase_native, rows))
        return float(out[0]) if single else out

    def max_batch(self, dims: Sequence[float], usable_bytes: int, max_size: int = 1 << 40) -> int:
        """Largest microbatch size that fits ``usable_bytes`` at ``dims``.

        Args:
            dims: the formula's variables for one record (its batch-size entry is ignored).
            usable_bytes: the budget, bytes (> 0); with a ``reserved_gap``, of reserved bytes.
            max_size: the largest size searched.

        Returns:
            The number of records, in [1, ``max_size``].

        Raises:
            ValueError: ``usable_bytes`` <= 0, or even one record does not fit.
        """
        if int(usable_bytes) <= 0:
            raise ValueError(f"max_batch: usable_bytes must be > 0, got {usable_bytes}")
        budget = self._native.prediction_budget_bytes(int(usable_bytes))  # a reserved gap's allocated terms
        return self._native.max_microbatch_size(list(map(float, dims)), budget, int(max_size))

    def __repr__(self) -> str:
        """``MemoryModel('<canonical formula>', floor_bytes=...)``."""
        return f"MemoryModel('{self.formula.canonical}', floor_bytes={self.floor_bytes:.0f})"


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
            arrays of the wrong shape or with a NaN, infinite or negative value), a formula the
            shapes cannot identify.
    """
    automatic = isinstance(formula, str)
    if automatic and formula != "auto":
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
    args.aggregation = dict(aggregation or {})
    args.non_negative = non_negative
    args.usable_max_rel_error = usable_max_rel_error
    if automatic:
        args.automatic_variables = list(variables)
    native, summary, selection = _planner.fit(formula, dims_array, peaks, bounds, bound_bytes, args)
    return MemoryModel(native), _report(summary, selection)


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
        ValueError: an unknown packer (``plan: packer must be 'adaptive', 'fastest', 'ffd' or
            'uniform', got 'FFD'``), "fastest" with a model without a time model, dims of the wrong shape, a negative or non-finite dim (named
            with its record's index), a record whose batch-size entry is not 1 (dims in the wrong
            order), ``usable_bytes`` <= 0, or ``sort_by`` not a record variable of the formula.

    Warns:
        RuntimeWarning: a column reaches more than 4 times the largest value its variable was
            probed at (likely columns in the wrong order).
    """
    _check_choice(packer, PACKERS, "plan: packer")
    if int(usable_bytes) <= 0:
        raise ValueError(f"plan: usable_bytes must be > 0, got {usable_bytes}")
    return _pack(_record_dims(record_dims, model, "record_dims"), model,
                 model._native.prediction_budget_bytes(int(usable_bytes)), packer, sort_by)


def _pack(array: np.ndarray, model: MemoryModel, usable_bytes: int, packer: PackerName,
          sort_by: Optional[str]) -> Plan:
    """``plan`` of record dims already checked (a float64 [n, variables] array)."""
    if sort_by is None:
        sort_by = next((v for v in model.formula.variable_names if v != model.batch_size_variable), "")
    return Plan(*_planner.pack(packer, sort_by, array, model._native, int(usable_bytes)))
