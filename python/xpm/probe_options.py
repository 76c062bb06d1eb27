"""The options of ``xpm.probe`` (``ProbeOptions``) and the checks ``probe`` runs on them before
anything is probed: one-line ``ValueError``s naming the option and the value.

    options = xpm.ProbeOptions(variable_max={"bs": 64, "l": 300}, usable_max_rel_error=0.03)
    outcome = xpm.probe(model, optimizer, loss_fn, formula, meter=meter, options=options)
    outcome = xpm.probe(model, optimizer, loss_fn, formula, meter=meter, variable_max={"bs": 64, "l": 300})
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from . import _planner
from .meters import METERS, CpuMeter, DeviceKind, Meter
from .choices import RECORD_AGGREGATIONS, RecordAggregation, _check_aggregation
from .planning import CostFormula, MemoryBudget
from .record_dims import _check_one_record_each, _matrix, _numbers
from .probe_executor import _local_tensor


@dataclass
class ProbeOptions:
    """How ``xpm.probe`` designs, runs and judges its probes; every field has a default.

    Attributes:
        budget: default the meter's capacity, 90 %.
        variable_max: the automatic design's upper end of every variable (with ``record_dims``,
            of the batch size only: the records set the others).
        probe_points: explicit probe shapes instead of the automatic design (no adaptive one).
        record_dims: records like the training data's (dims per record in variable order,
            batch-size column 1; e.g. ``record_dims_from_lengths`` of a few thousand drawn from
            the dataset). The design then probes mixes of them, near-equal ones (as a sorting
            packer makes) and spread ones (as an unsorted batch is), at every fraction of
            ``design_fractions`` of them: needed for a ``"sum"`` variable (real tokens) beside
            the padded length it moves with, which equal records cannot tell apart.
        variables: the formula's variables with ``formula="auto"`` (needed with
            ``record_dims``, whose ``variable_max`` names the batch size only).
        design_fractions: the automatic design's fractions of each variable's max.
        batch_size_variable: the variable that counts records.
        aggregation: per variable other than the batch size, how a microbatch's records combine
            (``xpm.RecordAggregation``): "max" (padded, the default) or "sum" (real tokens).
        usable_max_rel_error: the largest fit error and held-out (leave-one-shape-out) error
            that keep the fit usable (5 %).
        adaptive_max_probes: the adaptive design's budget of probes (0: no adaptive design).
            After the initial design it probes where the fit and its held-out refits (and, with
            "auto", the other formulas that explain the probes) disagree most, until they agree
            within ``adaptive_tolerance``.
        adaptive_tolerance: the relative disagreement the adaptive design stops at (1 %).
        adaptive_grid_steps: the values per variable other than the batch size on the grid of
            shapes the adaptive design picks from (8).
        device: where the model is probed (``xpm.DeviceKind``, ``"cuda:N"`` or a
            ``torch.device``). None (the default): wherever ``meter`` measures. ``"cpu"``: needs
            ``meter`` a ``CpuMeter`` (it cannot be made here: it must be installed before the
            model is built). ``"cuda"`` or ``"cuda:N"``: ``meter`` a ``CudaMeter`` of that device,
            or None to have one made. The model's parameters must be on that device.
        lockstep: probe on every rank of ``process_group`` at once (a DistributedDataParallel or
            FSDP2 model, whose backward or forward and backward are collectives;
            ``xpm.lockstep``): every rank calls ``probe``
            with the same arguments, runs the same probes in the same order, and each probe's
            peaks are the maximum over ranks, its out of memory the union, in one all-reduce;
            every rank returns the same model. An FSDP2 model is probed as its microbatches
            accumulate (``set_requires_gradient_sync(False)``, its unsharded gradient held),
            the state of every microbatch of a step but the first. False (the default): this
            process alone (rank 0 of a data-parallel job, before wrapping the model; a
            DistributedDataParallel model is refused).
        process_group: the ranks of ``lockstep`` (None: torch.distributed's default group).
        measure_phases: also measure every probe's forward and backward with the gradients set
            to None first (one more forward and backward per probe) and fit the
            "without_gradients" phase (``xpm.GradientPhase``): a step's first microbatch after
            ``zero_grad(set_to_none=True)`` peaks lower, by up to the gradients' bytes, and the
            sampler predicts it apart (``model.phases``; the phase's fit in
            ``model.phase_report``). Kept only when that fit is within
            ``usable_max_rel_error``. An FSDP2 model in lockstep is measured in that phase
            without the unsharded gradient its accumulation holds too (released first by a
            synchronised backward of the probe's batch), and once more synchronised, the
            "synchronised" phase of a step's last microbatch: three more backwards per probe.
    """

    budget: Optional[MemoryBudget] = None
    variable_max: Optional[Dict[str, float]] = None
    probe_points: Optional[List[Dict[str, float]]] = None
    record_dims: Optional[Sequence[Sequence[float]]] = None
    variables: Optional[Sequence[str]] = None
    design_fractions: Sequence[float] = _planner.DEFAULTS["design_fractions"]
    batch_size_variable: str = _planner.DEFAULTS["batch_size_variable"]
    aggregation: Optional[Dict[str, RecordAggregation]] = None
    usable_max_rel_error: float = _planner.DEFAULTS["usable_max_rel_error"]
    adaptive_max_probes: int = _planner.DEFAULTS["adaptive_max_probes"]
    adaptive_tolerance: float = _planner.DEFAULTS["adaptive_tolerance"]
    adaptive_grid_steps: int = _planner.DEFAULTS["adaptive_grid_steps"]
    device: Union[DeviceKind, torch.device, str, None] = None
    lockstep: bool = False
    process_group: Optional[Any] = None
    measure_phases: bool = True

    @classmethod
    def from_keywords(cls, options: Optional["ProbeOptions"], keywords: Dict[str, Any]) -> "ProbeOptions":
        """``options``, or the options the loose keywords of ``probe(..., variable_max=...)`` name.

        Args:
            options: what ``probe`` was given as ``options`` (None: none).
            keywords: ``probe``'s other keywords, by name.

        Returns:
            The options ``probe`` runs with.

        Raises:
            TypeError: a keyword that is no field (named, with the fields), or both forms given.
        """
        if options is not None and keywords:
            raise TypeError(f"probe: give options=xpm.ProbeOptions(...) or keyword options, not both "
                            f"(got options= and {', '.join(sorted(keywords))})")
        if options is not None:
            if not isinstance(options, ProbeOptions):
                raise TypeError(f"probe: options must be an xpm.ProbeOptions, got {type(options).__name__}")
            return options
        fields = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(keywords) - set(fields))
        if unknown:
            raise TypeError(f"probe: unknown option(s) {', '.join(unknown)}; the options are {', '.join(fields)}")
        return cls(**keywords)


def _cpu_parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of the storages of ``model``'s CPU parameters that c10's CPU allocator made (the
    resizable ones: what a module's constructor allocates), each storage once (tied weights).
    Storages over memory of another owner (``torch.from_numpy``, safetensors' memory map) are
    left out: no meter ever counts them, whenever it was installed."""
    storages = {}
    for p in model.parameters():
        p = _local_tensor(p)
        if p.device.type == "cpu":
            storage = p.untyped_storage()
            if storage.resizable():
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _check_meter_saw_the_weights(model: torch.nn.Module, meter: Meter) -> None:
    """ValueError when a ``CpuMeter`` counts fewer bytes than the model's CPU parameters take:
    it was installed after they were allocated, so every probe (and the floor) would miss them."""
    if not isinstance(meter, CpuMeter):
        return
    allocated, weights = int(meter.current_allocated_bytes), _cpu_parameter_bytes(model)
    if allocated < weights:
        raise ValueError(f"probe: the meter counts {allocated} bytes allocated but the model's CPU parameters alone "
                         f"take {weights} bytes: it was installed after the model was built, so the memory model "
                         f"would miss the weights; call xpm.CpuMeter.install() before building the model")


def _check_variable_names(formula: CostFormula, variable_max: Optional[Dict[str, float]],
                          probe_points: Optional[List[Dict[str, float]]],
                          aggregation: Optional[Dict[str, RecordAggregation]] = None) -> None:
    if not hasattr(formula, "variable_names"):
        return  # not a CostFormula: refused with the planner's message
    variables = list(formula.variable_names)
    named = ([("variable_max", variable_max or {}), ("aggregation", aggregation or {})] +
             [(f"probe_points[{k}]", point) for k, point in enumerate(probe_points or [])])
    for what, values in named:
        for key in values:
            if key not in variables:
                raise ValueError(f"probe: {what} has '{key}', which is not a variable of the formula "
                                 f"'{formula.canonical}' (its variables: {', '.join(variables)})")


def _check_batch_size_variable(formula: CostFormula, batch_size_variable: str) -> None:
    """Refuses a ``batch_size_variable`` in which the formula grows faster than linearly (a
    length named by mistake: the design would double it as a batch size)."""
    variables = list(formula.variable_names)
    if batch_size_variable not in variables:
        return  # the planner names it
    k = variables.index(batch_size_variable)
    ones = [1.0] * len(formula.coefficient_names)

    def at(value: float) -> float:
        dims = [8.0] * len(variables)
        dims[k] = value
        return float(formula.predict(ones, dims))

    before, after = at(1024.0), at(2048.0)
    if before > 0 and after > 2.2 * before:
        raise ValueError(f"probe: batch_size_variable '{batch_size_variable}' makes the formula "
                         f"'{formula.canonical}' grow {after / before:.1f}x when it doubles, but a microbatch's memory "
                         f"grows in proportion to its batch size: '{batch_size_variable}' looks like a length, and the "
                         f"probe design would double it as a batch size; name the batch size's variable (the "
                         f"formula's: {', '.join(variables)})")


def _check_record_dims(record_dims, formula: CostFormula, batch_size_variable: str,
                       aggregation: Optional[Dict[str, RecordAggregation]]) -> np.ndarray:
    """``record_dims`` as a float64 [n, variables] array, one record each; warns when two length
    columns are equal on every record and neither is summed (``aggregation`` forgotten)."""
    variables = list(formula.variable_names)
    array = _numbers(record_dims, f"probe: record_dims must be numbers, one row of {len(variables)} per record "
                                  f"({', '.join(variables)})")
    array = _matrix(array, len(variables), "record_dims")
    if not len(array):
        raise ValueError("probe: record_dims is empty: give records like the training data's")
    _check_one_record_each(array, variables, batch_size_variable, "record_dims")
    summed = {name for name, how in (aggregation or {}).items() if how == "sum"}
    others = [k for k, name in enumerate(variables) if name != batch_size_variable]
    for i, j in ((i, j) for i in others for j in others if i < j):
        if variables[i] not in summed and variables[j] not in summed and np.array_equal(array[:, i], array[:, j]):
            warnings.warn(f"probe: record_dims' columns '{variables[i]}' and '{variables[j]}' are equal on every record "
                          f"and neither is summed: a count of real tokens needs aggregation={{'{variables[j]}': 'sum'}}, "
                          "else every microbatch takes its largest value", RuntimeWarning, stacklevel=3)
    return array


def _probe_meter(model: torch.nn.Module, meter: Optional[Meter],
                 device: Union[DeviceKind, torch.device, str, None]) -> Meter:
    """The meter ``probe`` measures with: ``meter`` when ``device`` is None (the device follows
    the meter), else the meter class registered for ``device``'s type (``xpm.meters.METERS``)
    checks ``meter`` against it (or makes one), and the model's parameters must be there. One-line
    ValueErrors, before anything is allocated or run."""
    if device is None:
        if meter is None:
            raise ValueError("probe: meter=None without device=: give meter=xpm.CpuMeter.install() (installed before "
                             "the model was built) or meter=xpm.CudaMeter(), or device='cuda' to measure a GPU")
        return meter
    shown = f"device='{device}'"
    if not isinstance(device, (str, torch.device)):
        raise ValueError(f"probe: device must be 'cpu', 'cuda', 'cuda:N' or a torch.device, got {device!r} "
                         f"({type(device).__name__})")
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise ValueError(f"probe: {shown} is not a device: give 'cpu', 'cuda', 'cuda:N' or a torch.device") from None
    meter_class = METERS.get(kind)
    if meter_class is None:
        measured = " and ".join(f"{name.upper()} memory (xpm.{cls.__name__})" for name, cls in METERS.items())
        raise ValueError(f"probe: {shown}: xpm measures {measured} only")
    chosen = meter_class.for_probe(device, meter, "probe", shown)
    devices = {p.device for p in model.parameters()}
    if devices - {chosen.device}:
        raise ValueError(f"probe: {shown} but the model's parameters are on {', '.join(sorted(map(str, devices)))}: "
                         f"move the model with model.to('{chosen.device}') before building its optimizer, or give the "
                         f"parameters' device")
    return chosen


def _probe_setup(model: torch.nn.Module, meter: Optional[Meter], formula: Union[CostFormula, str],
                 options: ProbeOptions) -> Tuple[Meter, CostFormula, MemoryBudget, Any]:
    """``probe``'s checks and the planner's arguments: (meter, formula, budget, args). One-line
    ValueErrors before anything is run."""
    o = options
    _check_option_types(o)
    meter = _probe_meter(model, meter, o.device)
    automatic = isinstance(formula, str)
    formula = _resolved_formula(formula, o)
    _check_aggregation(o.aggregation, RECORD_AGGREGATIONS, "probe")
    _check_variable_names(formula, o.variable_max, o.probe_points, o.aggregation)
    if not automatic:
        _check_batch_size_variable(formula, o.batch_size_variable)
    record_dims = None
    if o.record_dims is not None:
        record_dims = _check_record_dims(o.record_dims, formula, o.batch_size_variable, o.aggregation)
    _check_meter_saw_the_weights(model, meter)
    budget = o.budget
    if budget is None:
        if meter.capacity_bytes <= 0:
            raise ValueError("probe: the meter has no capacity (0 bytes): set meter.capacity_bytes or give budget")
        budget = MemoryBudget(meter.capacity_bytes)
    if o.probe_points and not automatic and len(o.probe_points) < len(formula.coefficient_names):
        raise ValueError(f"probe: {len(o.probe_points)} probe point(s) for {len(formula.coefficient_names)} "
                         f"coefficients ({', '.join(formula.coefficient_names)}); give at least one per coefficient")
    return meter, formula, budget, _planner_arguments(o, record_dims, automatic)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _check_option_types(o: ProbeOptions) -> None:
    """One-line ValueErrors naming the option for a value of the wrong kind (a number where a
    mapping of them is due, an int where a MemoryBudget is), before anything is allocated."""
    def refuse(name: str, what: str, value: Any) -> None:
        raise ValueError(f"probe: {name} must be {what}, got {value!r}")

    if o.budget is not None and not isinstance(o.budget, _planner.MemoryBudget):
        refuse("budget", "an xpm.MemoryBudget (xpm.MemoryBudget(capacity_bytes) for a capacity)", o.budget)
    if o.variable_max is not None and not (isinstance(o.variable_max, Mapping) and
                                           all(isinstance(k, str) and _is_number(v) for k, v in o.variable_max.items())):
        refuse("variable_max", "a dict {variable: number}", o.variable_max)
    for name, value in (o.variable_max or {}).items():
        if not (math.isfinite(value) and value >= 1):
            raise ValueError(f"probe: variable_max[{name!r}] is {value!r}: the design's upper end of a variable must "
                             "be a finite number >= 1")
    if o.probe_points is not None and (isinstance(o.probe_points, (str, Mapping)) or not all(
            isinstance(p, Mapping) and all(isinstance(k, str) and _is_number(v) for k, v in p.items())
            for p in o.probe_points)):
        refuse("probe_points", "a list of dicts {variable: number}", o.probe_points)
    if isinstance(o.design_fractions, (str, Mapping)) or not all(_is_number(f) for f in _iterable(o.design_fractions)):
        refuse("design_fractions", "a sequence of numbers in (0, 1]", o.design_fractions)
    for name in ("usable_max_rel_error", "adaptive_tolerance"):
        if not _is_number(getattr(o, name)):
            refuse(name, "a number", getattr(o, name))
    for name in ("adaptive_max_probes", "adaptive_grid_steps"):
        value = getattr(o, name)
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            refuse(name, "a whole number", value)
    if not isinstance(o.batch_size_variable, str):
        refuse("batch_size_variable", "a variable's name", o.batch_size_variable)


def _iterable(value: Any) -> Any:
    """``value`` when it can be iterated, else a list that fails the check it is used in."""
    try:
        iter(value)
    except TypeError:
        return [None]
    return value


def _resolved_formula(formula: Union[CostFormula, str], o: ProbeOptions) -> CostFormula:
    """``formula``, or for ``"auto"`` a constant one over the variables the options name (the
    formula is chosen from the probes)."""
    if not isinstance(formula, str):
        if o.variables is not None and list(o.variables) != list(formula.variable_names):
            raise ValueError(f"probe: variables={list(o.variables)!r} names the variables of formula='auto'; the "
                             f"CostFormula has its own, {list(formula.variable_names)!r}")
        return formula
    if formula != "auto":
        raise ValueError(f"probe: formula must be a CostFormula or 'auto', got {formula!r}")
    names = list(o.variables or []) or list(o.variable_max or {}) or list((o.probe_points or [{}])[0])
    if not names:
        raise ValueError("probe: formula='auto' takes its variables from variables=, variable_max or probe_points: "
                         "give one")
    if o.record_dims is not None and o.variables is None:
        raise ValueError("probe: formula='auto' with record_dims needs variables=[...] (the records' columns, in "
                         "order): variable_max names the batch size only")
    return CostFormula("xpm_constant", names)


def _planner_arguments(o: ProbeOptions, record_dims: Optional[np.ndarray], automatic: bool) -> Any:
    """The C++ planner's ProbeArguments of checked options."""
    if not o.probe_points and not o.design_fractions:
        raise ValueError("probe: design_fractions is empty and no probe_points are given: nothing to probe")
    args = _planner.ProbeArguments()
    args.batch_size_variable = o.batch_size_variable
    args.aggregation = dict(o.aggregation or {})
    args.probe_points = [dict(point) for point in (o.probe_points or [])]
    args.variable_max = {name: float(value) for name, value in (o.variable_max or {}).items()}
    args.record_dims_sample = record_dims.tolist() if record_dims is not None else []
    args.design_fractions = list(o.design_fractions)
    args.usable_max_rel_error = o.usable_max_rel_error
    args.automatic_formula = automatic
    args.adaptive.max_probes = int(o.adaptive_max_probes)
    args.adaptive.tolerance = float(o.adaptive_tolerance)
    args.adaptive.grid_steps = int(o.adaptive_grid_steps)
    return args
