"""Probing a user's PyTorch training step and fitting its memory model, from Python.

    meter = xpm.CpuMeter.install()          # CPU: before the model is built (it must see the weights)
    meter.capacity_bytes = 200_000_000      # the cap the probes and the steps run under
    model = MyModel(); optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    result = xpm.probe(model, optimizer, lambda dims: model.loss_sum(random_batch(dims)),
                       xpm.CostFormula("a*bs*l + b*bs + c", ["bs", "l"]),
                       variable_max={"bs": 64, "l": 300}, meter=meter)
    result.model.predict([8, 120])          # bytes

What a probe runs, as the C++ probe does: gradients zeroed in place (allocated when missing),
``loss_fn(dims).backward()`` (the forward/backward peak), ``optimizer.step()`` at learning rate
0 (the optimizer-step peak), each phase's peak allocated bytes read from the meter. Before the
first probe every trainable parameter has a gradient and the optimizer its state (one step at
learning rate 0): the steady state of training. Afterwards the optimizer's state, its learning
rates and the CPU (and CUDA) random generators are as they were; the parameters are unchanged
(every ``torch.optim`` optimizer but LBFGS scales its update with the learning rate). A probe
that runs out of memory is an upper bound of what fits, never dropped. The automatic design
(no ``probe_points``): for each fraction of ``design_fractions``, the other variables at that
fraction of their max, the batch size doubling from 1 to ``variable_max[bs]`` until the budget
or the first out-of-memory probe, then one bisection. Call it on rank 0 before wrapping the
model in DistributedDataParallel, and share ``result.model.to_json()`` with the other ranks.
"""
from __future__ import annotations

import io
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Literal, Optional, Sequence, Union

import numpy as np
import torch

from . import _planner
from .planning import CostFormula, FitReport, MemoryBudget, MemoryModel, _check_one_record_each, _matrix, _report


class CpuMeter:
    """Peak allocated bytes of CPU tensors (c10's CPU allocator, wrapped), with a hard cap
    that raises PyTorch's out-of-memory error. One per process; ``install()`` it before the
    model is built."""

    def __init__(self, native):
        self._native = native

    @classmethod
    def install(cls) -> "CpuMeter":
        from .torch_extension import load_torch_extension  # the torch xpm was built against

        return cls(load_torch_extension().CpuMemoryMeter.install())

    @property
    def capacity_bytes(self) -> int:
        """Cap on allocated bytes (0: none)."""
        return self._native.capacity_bytes

    @capacity_bytes.setter
    def capacity_bytes(self, value: int) -> None:
        self._native.capacity_bytes = int(value)

    @property
    def current_allocated_bytes(self) -> int:
        return self._native.current_allocated_bytes

    @property
    def peak_allocated_bytes(self) -> int:
        return self._native.peak_allocated_bytes

    @property
    def oom_count(self) -> int:
        """Allocations the cap refused since the process started (each raised an out-of-memory
        error)."""
        return self._native.oom_count

    def reset_peak(self) -> None:
        self._native.reset_peak()


class CudaMeter:
    """Peak allocated bytes of one CUDA device through ``torch.cuda`` (reset per probe phase);
    the capacity is the device's total memory. ``reserved_peak_bytes`` is the caching
    allocator's reserved peak, for reports."""

    def __init__(self, device: Optional[torch.device] = None):
        if not torch.cuda.is_available():
            raise ValueError("CudaMeter: this torch has no CUDA device (torch.cuda.is_available() is False); "
                             "on CPU use xpm.CpuMeter.install()")
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)

    @property
    def capacity_bytes(self) -> int:
        return torch.cuda.get_device_properties(self.device).total_memory

    @property
    def current_allocated_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    @property
    def peak_allocated_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    @property
    def reserved_peak_bytes(self) -> int:
        return torch.cuda.max_memory_reserved(self.device)

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)


def _is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, getattr(torch.cuda, "OutOfMemoryError", ())) or "out of memory" in str(error).lower()


def _drain_autograd_buffers(meter) -> None:
    """The autograd engine keeps the gradients of a backward that ran out of memory until the
    next backward on the thread; a tiny one, with a CPU cap lifted for its bytes, frees them,
    so the next probe measures only itself."""
    capped = isinstance(meter, CpuMeter)
    capacity = meter.capacity_bytes if capped else 0
    if capped:
        meter.capacity_bytes = 0
    try:
        torch.zeros(1, requires_grad=True).sum().backward()
    finally:
        if capped:
            meter.capacity_bytes = capacity


def _zero_gradients_in_place(parameters: Sequence[torch.Tensor]) -> None:
    with torch.no_grad():
        for p in parameters:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            else:
                p.grad.zero_()


def _reallocate_state(optimizer: torch.optim.Optimizer) -> None:
    """Replaces every state tensor by a clone. ``load_state_dict`` deep-copies the state through
    Python storages, which PyTorch allocates past c10's CPU allocator and so past the meter;
    a clone is allocated as the optimizer's own step allocates, and counted."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                state[key] = value.clone()


class _SteadyState:
    """Gradients and optimizer state allocated, learning rates 0; restores the optimizer, its
    learning rates and the random generators on exit."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = optimizer

    def __enter__(self):
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        # Saved as bytes, not as tensors: a tensor copy would be counted in every probe.
        self.state = io.BytesIO()
        torch.save(self.optimizer.state_dict(), self.state)
        self.had_state = len(self.optimizer.state) > 0
        self.rates = [group["lr"] for group in self.optimizer.param_groups]
        try:
            for group in self.optimizer.param_groups:
                group["lr"] = 0.0
            _zero_gradients_in_place(self.parameters)
            self.optimizer.step()
            _zero_gradients_in_place(self.parameters)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        if self.had_state:
            self.state.seek(0)
            # Bytes this process wrote a moment ago, so trusted: weights_only=False, because an
            # optimizer's state may hold objects torch 2.x's default weights-only loader refuses.
            self.optimizer.load_state_dict(torch.load(self.state, weights_only=False))
            _reallocate_state(self.optimizer)
        else:
            self.optimizer.state.clear()
        for group, rate in zip(self.optimizer.param_groups, self.rates):
            group["lr"] = rate
        _zero_gradients_in_place(self.parameters)
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        return False


class _TorchExecutor(_planner.ProbeExecutor):
    """The probe steps over the user's model, optimizer and loss function."""

    def __init__(self, steady: _SteadyState, loss_fn, meter, names: List[str], batch_size_variable: str = "bs",
                 aggregation: Optional[Dict[str, str]] = None):
        super().__init__()
        self.steady, self.loss_fn, self.meter, self.names = steady, loss_fn, meter, names
        self.batch_size_variable, self.aggregation = batch_size_variable, dict(aggregation or {})
        self.results = []  # every probe run, for an error that must carry them

    def static_bytes(self) -> float:
        return float(self.meter.current_allocated_bytes)

    def run_probe(self, dims):
        return self._run(list(dims), list(dims), " ".join(f"{n}={d:g}" for n, d in zip(self.names, dims)))

    def run_probe_records(self, records):
        records = [list(record) for record in records]
        dims = self._aggregate(records)
        where = (f"a mix of {len(records)} records, " + " ".join(f"{n}={d:g}" for n, d in zip(self.names, dims)) +
                 " (loss_fn gets the records: one dims list each)")
        return self._run(records, dims, where)

    def _aggregate(self, records: List[List[float]]) -> List[float]:
        """A mix's dims (the planner's rule): the record count, sums of "sum" variables, else maxima."""
        columns = list(zip(*records))
        return [float(len(records)) if name == self.batch_size_variable else
                float(sum(columns[k]) if self.aggregation.get(name) == "sum" else max(columns[k]))
                for k, name in enumerate(self.names)]

    def _run(self, batch, dims, where):
        """One probe step: ``loss_fn(batch)``, ``batch`` the dims or a mix's records."""
        result = _planner.ProbeResult()
        result.dims = dims
        result.capacity_bytes = float(self.meter.capacity_bytes)
        start = time.perf_counter()
        _zero_gradients_in_place(self.steady.parameters)
        loss = None
        try:
            self.meter.reset_peak()
            loss = self.loss_fn(batch)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError("the loss function must return a scalar tensor")
            loss.backward()
            loss = None
            result.forward_backward_peak_bytes = float(self.meter.peak_allocated_bytes)
            self.meter.reset_peak()
            self.steady.optimizer.step()
            result.optimizer_step_peak_bytes = float(self.meter.peak_allocated_bytes)
        except Exception as error:  # noqa: BLE001 - out of memory is a result, the rest named
            if not _is_out_of_memory(error):
                raise type(error)(f"probing at {where}: {error}") from error
            result.feasible = False
            result.error = str(error).splitlines()[0]
            loss = None  # the graph of a forward that ran out of memory goes now, not later
            _drain_autograd_buffers(self.meter)
        finally:
            _zero_gradients_in_place(self.steady.parameters)
        result.duration_s = time.perf_counter() - start
        self.results.append(result)
        return result


AdaptiveStop = Literal["not run", "agreed", "probe count", "probe time", "no candidates"]


@dataclass
class AdaptiveReport:
    """What the adaptive probe design did: ``added_probes``, ``stop`` (why it stopped),
    ``disagreement`` (largest relative disagreement of the candidate models at the last check,
    NaN when never computed) at ``disagreement_dims``, ``elapsed_s``, and ``report``, a sentence."""

    stop: AdaptiveStop
    added_probes: int
    elapsed_s: float
    disagreement: float
    disagreement_dims: List[float]
    report: str


def _cpu_parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of the storages of ``model``'s CPU parameters that c10's CPU allocator made (the
    resizable ones: what a module's constructor allocates), each storage once (tied weights).
    Storages over memory of another owner (``torch.from_numpy``, safetensors' memory map) are
    left out: no meter ever counts them, whenever it was installed."""
    storages = {}
    for p in model.parameters():
        if p.device.type == "cpu":
            storage = p.untyped_storage()
            if storage.resizable():
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _check_meter_saw_the_weights(model: torch.nn.Module, meter) -> None:
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
                          aggregation: Optional[Dict[str, str]] = None) -> None:
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


def _check_record_dims(record_dims, formula: CostFormula, batch_size_variable: str,
                       aggregation: Optional[Dict[str, str]]) -> np.ndarray:
    """``record_dims`` as a float64 [n, variables] array, one record each; warns when two length
    columns are equal on every record and neither is summed (``aggregation`` forgotten)."""
    variables = list(formula.variable_names)
    try:
        array = np.asarray(record_dims, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"probe: record_dims must be numbers, one row of {len(variables)} per record "
                         f"({', '.join(variables)})") from None
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


@dataclass
class ProbeOutcome:
    """``model``: the fitted memory model; ``probes``: every probe (``feasible`` False: ran out
    of memory); ``fit``: the fit report (``fit.formula_selection`` lists the candidates with
    ``formula="auto"``); ``floor``: how the floor was chosen; ``adaptive``: what the adaptive
    design added and why it stopped; ``probe_s``."""

    model: MemoryModel
    probes: list
    fit: FitReport
    floor: str
    probe_s: float
    adaptive: AdaptiveReport


def probe(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
          loss_fn: Callable[[Union[List[float], List[List[float]]]], torch.Tensor],
          formula: Union[CostFormula, Literal["auto"]], *, meter, budget: Optional[MemoryBudget] = None,
          variable_max: Optional[Dict[str, float]] = None, probe_points: Optional[List[Dict[str, float]]] = None,
          record_dims: Optional[Sequence[Sequence[float]]] = None, variables: Optional[Sequence[str]] = None,
          design_fractions: Sequence[float] = (1.0, 0.75, 0.5), batch_size_variable: str = "bs",
          aggregation: Optional[Dict[str, str]] = None, usable_max_rel_error: float = 0.05,
          adaptive_max_probes: int = 8, adaptive_max_s: float = 120.0,
          adaptive_tolerance: float = 0.01) -> ProbeOutcome:
    """Probes the step (see the module docstring) and fits ``formula``; rank 0 only.

    Args:
        model, optimizer: the user's, before any DistributedDataParallel wrapping.
        loss_fn: ``loss_fn(dims)`` builds a batch at ``dims`` (variable order; synthetic data is
            fine) and returns its summed loss, a scalar tensor. With ``record_dims`` it gets the
            probe's records instead: ``loss_fn(records)``, one dims list per record (batch-size
            column 1), and builds a batch of exactly those records (each its own length).
        formula: the cost formula, or ``"auto"``: chosen from the probes (the variables are
            ``variables``, else ``variable_max``'s keys in order, or the first probe point's);
            the candidates and the choice are in ``outcome.fit.formula_selection``.
        meter: ``CpuMeter.install()`` (installed before the model was built: its CPU parameters
            must have been allocated under it) or ``CudaMeter()``.
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
        aggregation: per variable, "max" (padded) or "sum" over a microbatch's records.
        usable_max_rel_error: the largest fit error and held-out (leave-one-shape-out) error
            that keep the fit usable (5 %).
        adaptive_max_probes, adaptive_max_s: the adaptive design's budget, probes and seconds
            (``adaptive_max_probes=0``: none). After the initial design it probes where the fit
            and its held-out refits (and, with "auto", the other formulas that explain the
            probes) disagree most, until they agree within ``adaptive_tolerance``.

    Returns:
        ProbeOutcome: the model, every probe, the fit report, the floor, the adaptive report.

    Raises:
        ValueError: bad options (a ``variable_max``, ``aggregation`` or ``probe_points`` key that
            is not a variable of the formula, named with the formula's variables; ``record_dims``
            of the wrong width, with a batch-size column other than 1 or a NaN, infinite or
            negative value, named by row; ``"auto"`` with ``record_dims`` but no ``variables``),
            a ``CpuMeter`` that counts fewer bytes than the model's CPU parameters take
            (installed after the model was built), or a budget the probes cannot work under;
            nothing is probed then.
        RuntimeError: an unusable fit (its ``probes`` attribute holds the probes, so ``xpm.fit``
            can refit them); an error of ``loss_fn`` names the probe's dims.

    Warns:
        RuntimeWarning: two columns of ``record_dims`` are equal on every record and neither is
            summed (a count of real tokens left at the default aggregation, max).

    Whatever is allocated after probing (a dataset made of tensors, caches, a second optimizer)
    is not in the model: build it before, or leave room for it in ``budget``
    (``xpm.check_unplanned_memory`` warns about it during training). The model records the
    bytes allocated before every probe (``result.model.static_bytes``).
    """
    automatic = isinstance(formula, str)
    if automatic:
        if formula != "auto":
            raise ValueError(f"probe: formula must be a CostFormula or 'auto', got {formula!r}")
        names = list(variables or []) or list(variable_max or {}) or list((probe_points or [{}])[0])
        if not names:
            raise ValueError("probe: formula='auto' takes its variables from variables=, variable_max or probe_points: "
                             "give one")
        formula = CostFormula("xpm_constant", names)  # the variables; the formula is chosen from the probes
        if record_dims is not None and variables is None:
            raise ValueError("probe: formula='auto' with record_dims needs variables=[...] (the records' columns, in "
                             "order): variable_max names the batch size only")
    elif variables is not None:
        raise ValueError("probe: variables= names the variables of formula='auto'; a CostFormula has its own")
    _check_variable_names(formula, variable_max, probe_points, aggregation)
    if record_dims is not None:
        record_dims = _check_record_dims(record_dims, formula, batch_size_variable, aggregation)
    _check_meter_saw_the_weights(model, meter)
    if budget is None:
        if meter.capacity_bytes <= 0:
            raise ValueError("probe: the meter has no capacity (0 bytes): set meter.capacity_bytes or give budget")
        budget = MemoryBudget(meter.capacity_bytes)
    args = _planner.ProbeArguments()
    args.batch_size_variable = batch_size_variable
    args.aggregation = dict(aggregation or {})
    args.probe_points = [dict(point) for point in (probe_points or [])]
    args.variable_max = {name: float(value) for name, value in (variable_max or {}).items()}
    args.record_dims_sample = record_dims.tolist() if record_dims is not None else []
    args.design_fractions = list(design_fractions)
    args.usable_max_rel_error = usable_max_rel_error
    args.automatic_formula = automatic
    args.adaptive.max_probes = int(adaptive_max_probes)
    args.adaptive.max_s = float(adaptive_max_s)
    args.adaptive.tolerance = float(adaptive_tolerance)
    if not probe_points and not design_fractions:
        raise ValueError("probe: design_fractions is empty and no probe_points are given: nothing to probe")
    if probe_points and not automatic and len(probe_points) < len(formula.coefficient_names):
        raise ValueError(f"probe: {len(probe_points)} probe point(s) for {len(formula.coefficient_names)} "
                         f"coefficients ({', '.join(formula.coefficient_names)}); give at least one per coefficient")
    start = time.perf_counter()
    try:
        steady = _SteadyState(model, optimizer).__enter__()
    except Exception as error:  # noqa: BLE001 - only out of memory is translated
        if not _is_out_of_memory(error):
            raise
        raise ValueError(f"probe: the steady state (gradients and optimizer state) does not fit under the "
                         f"meter's capacity of {meter.capacity_bytes} bytes: raise the capacity") from None
    executor = _TorchExecutor(steady, loss_fn, meter, list(formula.variable_names), batch_size_variable, aggregation)
    try:
        native, probes, summary, floor, adaptive, selection = _planner.probe_and_fit(executor, formula, budget, args)
    except RuntimeError as error:
        failure = RuntimeError(f"{error} (xpm.probe(..., usable_max_rel_error=...) sets that limit; this error's "
                               f".probes holds the {len(executor.results)} probes, for xpm.fit)")
        failure.probes = list(executor.results)
        raise failure from None
    finally:
        steady.__exit__(None, None, None)
    return ProbeOutcome(MemoryModel(native), list(probes), _report(summary, selection), floor,
                        time.perf_counter() - start, AdaptiveReport(**adaptive))
