"""``MemoryModel``: a fitted memory model (``predict`` in bytes, per gradient phase; ``max_batch``;
the JSON files ``load``/``save``, which ``xpm-plan`` and ``xpm-train`` read and write too).
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
from numpy.typing import ArrayLike

from . import _planner
from .choices import GRADIENT_PHASES, GradientPhase, _check_choice, _name_list
from .record_dims import _matrix


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
        self._phase_natives: Dict[str, Optional[_planner.MemoryModel]] = {}  # each phase's, built on first use
        self._floor: Optional[_planner.MemoryModel] = None  # the model with its formula at 0, on first use

    def __reduce__(self) -> Tuple[Any, Tuple[str]]:
        """Pickled (and deep-copied) as its ``to_json()`` text, rebuilt by ``from_json``."""
        return MemoryModel.from_json, (self.to_json(),)

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
        for phase, record in phases.items():
            if phase not in GRADIENT_PHASES[1:]:
                raise ValueError(f"{source}: metadata.phases has {phase!r}; a phase fitted apart is "
                                 f"{_name_list(GRADIENT_PHASES[1:])}")
            own = record.get("formula") if isinstance(record, dict) else None  # two regimes, or a refit's other
            if own is not None:
                self._check_phase_formula(source, phase, own)
            names = set(own["coefficient_names"] if own is not None else self.formula.coefficient_names)
            coefficients = record.get("coefficients") if isinstance(record, dict) else None
            if not _names_to_numbers(coefficients, names):
                raise ValueError(f"{source}: metadata.phases[{phase!r}] must hold 'coefficients', a number of bytes "
                                 f"for each of {', '.join(sorted(names))}; got {record!r}")
            lowest = record.get("lowest_peak_bytes", 0.0)
            if isinstance(lowest, bool) or not isinstance(lowest, (int, float)) or not 0 <= lowest < 2 ** 63:
                raise ValueError(f"{source}: metadata.phases[{phase!r}].lowest_peak_bytes must be a number of bytes "
                                 f">= 0, got {lowest!r:.40}")
            single = record.get("single_record_coefficients")
            if single is not None and not _names_to_numbers(single, names):
                raise ValueError(f"{source}: metadata.phases[{phase!r}].single_record_coefficients must hold a "
                                 f"number of bytes for each of {', '.join(sorted(names))}; got {single!r}")

    def _check_phase_formula(self, source: str, phase: str, formula: Any) -> None:
        """Raises ValueError naming ``metadata.phases[phase].formula`` unless it is a formula's
        JSON (``text``, ``coefficient_names``, ``variable_names``) over this model's variables that
        parses."""
        where = f"{source}: metadata.phases[{phase!r}].formula"
        if not isinstance(formula, dict) or not isinstance(formula.get("text"), str) \
                or not isinstance(formula.get("coefficient_names"), list):
            raise ValueError(f"{where} must be a formula's JSON object with 'text' and 'coefficient_names', "
                             f"got {formula!r:.80}")
        variables = list(self.formula.variable_names)
        if formula.get("variable_names") != variables:
            raise ValueError(f"{where} must name the model's variables {variables} in 'variable_names', got "
                             f"{formula.get('variable_names')!r:.80}")
        try:  # as a model file's own formula is read: non-linear terms allowed (already fitted)
            _planner.CostFormula(formula["text"], variables, [str(n) for n in formula["coefficient_names"]], True)
        except (ValueError, RuntimeError) as error:
            first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise ValueError(f"{where} {formula['text']!r:.80} does not parse over {variables}: {first_line}") from None

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
    def single_record_coefficients(self) -> Dict[str, float]:
        """Microbatches of one record peak below the trend of larger ones and follow the formula
        on their own (a padded batch's attention mask is not built for one record): their own
        coefficients ``{name: bytes}``; at batch size 1 the prediction is the smaller of the
        formula's with these and with ``coefficients``. Empty otherwise."""
        return dict(zip(self.formula.coefficient_names, self._native.single_record_coefficients))

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
                    max_rel_error: float, fitted_points: int,
                    single_record_coefficients: Sequence[float] = (), lowest_peak_bytes: float = 0.0,
                    formula: Optional[Dict[str, Any]] = None) -> "MemoryModel":
        """This model with a fit of ``phase``: the same formula (or ``formula``, the JSON of
        another over the same variables) and floor, its own coefficients (kept in the JSON, so
        the phase travels with ``to_json`` and ``save``), and the lowest peak the phase measured,
        the floor of its predictions where the model's floor (the optimizer step's) does not hold
        (a step's first microbatch of several)."""
        parsed = json.loads(self.to_json())
        names = self.formula.coefficient_names if formula is None else formula["coefficient_names"]
        record = {"coefficients": dict(zip(names, map(float, coefficients))),
                  "single_record_factor": float(single_record_factor), "max_rel_error": float(max_rel_error),
                  "fitted_points": int(fitted_points), "lowest_peak_bytes": float(lowest_peak_bytes)}
        if formula is not None:
            record["formula"] = formula
        if len(single_record_coefficients):
            record["single_record_coefficients"] = dict(zip(names, map(float, single_record_coefficients)))
        parsed.setdefault("metadata", {}).setdefault("phases", {})[phase] = record
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
                                                         record.get("single_record_factor", 1.0), floor,
                                                         record.get("single_record_coefficients"),
                                                         record.get("formula"),
                                                         float(record.get("lowest_peak_bytes", 0.0)))
        return self._phase_natives[key]

    def _refit_outside(self) -> Optional[_planner.MemoryModel]:
        """The model this one was refitted from (its refit region's outside model), or None;
        built once (the binding copies it)."""
        if "refit outside" not in self._phase_natives:
            self._phase_natives["refit outside"] = self._native.refit_outside
        return self._phase_natives["refit outside"]

    def _native_with(self, coefficients: Dict[str, float], single_record_factor: float,
                     floor: bool = True, single_record_coefficients: Optional[Dict[str, float]] = None,
                     formula: Optional[Dict[str, Any]] = None, floor_bytes: float = 0.0) -> _planner.MemoryModel:
        """This model (formula, floor unless ``floor`` is False, then ``floor_bytes``, ranges)
        with other coefficients, single-record factor and single-record coefficients (None:
        none), and another formula over the same variables where ``formula`` (its JSON) is given."""
        parsed = dict(self._parsed())
        if formula is not None:
            parsed["formula"] = formula
        parsed["coefficients"] = coefficients
        parsed.pop("single_record_factor", None)
        parsed.pop("single_record_coefficients", None)
        parsed.pop("refit_region", None)  # a refit's guard is of its steady prediction, not of a phase's
        if single_record_factor != 1.0:
            parsed["single_record_factor"] = single_record_factor
        if single_record_coefficients:
            parsed["single_record_coefficients"] = single_record_coefficients
        if not floor:
            parsed["floor_bytes"] = float(floor_bytes)
            parsed.pop("floor_formula", None)
        return _planner.MemoryModel.from_json(json.dumps(parsed))

    def floor_at(self, dims: ArrayLike) -> Union[float, np.ndarray]:
        """The prediction's floor at ``dims`` (the constant floor, or the floor formula where the
        optimizer step's peak grows with the dims), bytes.

        Args:
            dims: one row of the formula's variables (in its order), or one row per microbatch
                ([n, variables]); finite and >= 0.

        Returns:
            A ``float`` for one row, a float64 [n] array for rows.

        Raises:
            ValueError: dims of the wrong width or shape, or a NaN, infinite or negative value.
        """
        if self._floor is None:
            self._floor = self._native_with({name: 0.0 for name in self.formula.coefficient_names}, 1.0)
        array = np.asarray(dims, dtype=np.float64)
        single = array.ndim == 1
        rows = _matrix(array.reshape(1, -1) if single else array, len(self.formula.variable_names), "dims")
        out = _planner.predict(self._floor, rows)
        return float(out[0]) if single else out

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
                "with_gradients" prediction (for a model refitted on training's peaks, that
                prediction lowered by what the phase lowers the probes' model); the
                "with_gradients" prediction when the model has no fit of it (``phases``).
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
            phase_bytes = _planner.predict(phase_native, rows)
            beside = self._refit_outside()  # a refit: lowered by what the phase lowered the probes' model
            out = np.minimum(out, phase_bytes) if beside is None else \
                np.maximum(0.0, out - np.maximum(0.0, _planner.predict(beside, rows) - phase_bytes))
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


def _checked_model(model: Any, where: str) -> MemoryModel:
    """``model`` when it is a ``MemoryModel``.

    Raises:
        TypeError: anything else, named with ``where`` (a path: how to read one).
    """
    if not isinstance(model, MemoryModel):
        hint = " (xpm.MemoryModel.load(path) reads a model file)" if isinstance(model, (str, os.PathLike)) else ""
        raise TypeError(f"{where}: model must be an xpm.MemoryModel{hint}, got {type(model).__name__} {model!r}")
    return model


def _names_to_numbers(values: Any, names: set) -> bool:
    """Whether ``values`` is ``{name: number}`` over exactly ``names`` (a phase record's
    coefficients)."""
    return isinstance(values, dict) and set(values) == names and \
        all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values.values())
