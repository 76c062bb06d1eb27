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
0 (the optimizer-step peak), each phase's peak allocated bytes read from the meter. Before
those, with ``measure_phases`` (the default), one more ``loss_fn(dims).backward()`` with every
gradient set to None: the peak of a step's first microbatch after ``zero_grad()``, fitted as the
model's "without_gradients" phase (``xpm.GradientPhase``), which the sampler predicts each
step's first microbatch with. Before the
first probe every trainable parameter has a gradient and the optimizer its state (one step at
learning rate 0): the steady state of training. Afterwards the optimizer's state, its learning
rates and the CPU (and CUDA) random generators are as they were; the parameters are unchanged
(every ``torch.optim`` optimizer but LBFGS scales its update with the learning rate). A probe
that runs out of memory is an upper bound of what fits, never dropped. The automatic design
(no ``probe_points``): for each fraction of ``design_fractions``, the other variables at that
fraction of their max, the batch size doubling from 1 to ``variable_max[bs]`` until the budget
or the first out-of-memory probe, then one bisection. Call it on rank 0 before wrapping the
model in DistributedDataParallel, and share ``result.model.to_json()`` with the other ranks.

On a GPU: ``xpm.probe(..., meter=None, device="cuda")`` (or ``meter=xpm.CudaMeter()``) with the
model and the loss's batches on that device. ``device=`` is checked first, against the meter
and the model's parameters: a mismatch, or ``"cuda"`` where torch sees no GPU, is a one-line
``ValueError`` before anything is probed.
"""
from __future__ import annotations

import io
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Literal, Optional, Sequence, Union

import numpy as np
import torch

from . import _planner
from .lockstep import Lockstep
from .meters import METERS, CpuMeter, CudaMeter, DeviceKind, Meter
from .planning import (RECORD_AGGREGATIONS, CostFormula, FitReport, MemoryBudget, MemoryModel, RecordAggregation,
                       _check_aggregation, _check_one_record_each, _matrix, _report)


def _is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, getattr(torch.cuda, "OutOfMemoryError", ())) or "out of memory" in str(error).lower()


def _drain_autograd_buffers(meter: Meter) -> None:
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
        self.model = model
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

    def __init__(self, steady: _SteadyState, loss_fn, meter: Meter, names: List[str], batch_size_variable: str = "bs",
                 aggregation: Optional[Dict[str, RecordAggregation]] = None, lockstep: Optional[Lockstep] = None,
                 measure_phases: bool = True):
        super().__init__()
        self.steady, self.loss_fn, self.meter, self.names = steady, loss_fn, meter, names
        self.lockstep = lockstep
        # FSDP2 in lockstep: probed as its microbatches accumulate, without gradient sync and
        # with the unsharded gradient FSDP2 keeps meanwhile already held (accumulation_batch:
        # the first probe's batch, run once unmeasured to allocate it, and again at the end,
        # synchronised, to release it).
        self.accumulating = lockstep is not None and callable(getattr(steady.model, "set_requires_gradient_sync", None))
        self.accumulation_batch = None
        self.batch_size_variable, self.aggregation = batch_size_variable, dict(aggregation or {})
        # Each probe's forward/backward also measured with the gradients set to None first (a
        # step's first microbatch after zero_grad(set_to_none=True)); under FSDP2's accumulation
        # also without the unsharded gradient it holds (released first by a synchronised backward).
        self.measure_without_gradients = measure_phases
        self.without_gradients_peaks: List[float] = []  # one per entry of results (0: not measured)
        self.results = []  # every probe run, for an error that must carry them
        self.raised: Optional[BaseException] = None  # the error a probe raised (the loss function's), if any

    def static_bytes(self) -> float:
        allocated = float(self.meter.current_allocated_bytes)
        return allocated if self.lockstep is None else self.lockstep.max([allocated])[0]

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

    def end_accumulation(self) -> None:
        """FSDP2 in lockstep: one synchronised backward of the first probe's batch, which
        reduce-scatters and so frees the unsharded gradient the probes held; gradient sync back
        on. Collective: every rank calls it."""
        if self.accumulation_batch is None:
            return
        self.steady.model.set_requires_gradient_sync(True)
        self.loss_fn(self.accumulation_batch).backward()
        self.accumulation_batch = None

    def _combine_ranks(self, result, without_gradients_peak: float, failure, where: str) -> float:
        """Lockstep: every rank's peaks (max), out-of-memory and error flags in one all-reduce;
        an error on another rank raises here, one out of memory anywhere makes the probe
        infeasible on every rank. Returns the ranks' largest peak without gradients."""
        world, peaks = self.lockstep.world_size, 3
        mine = [0.0] * (peaks + 2 * world)
        mine[0], mine[1] = result.forward_backward_peak_bytes, result.optimizer_step_peak_bytes
        mine[2] = without_gradients_peak
        mine[peaks + self.lockstep.rank] = 0.0 if result.feasible else 1.0
        mine[peaks + world + self.lockstep.rank] = 0.0 if failure is None else 1.0
        combined = self.lockstep.max(mine)
        failed = [r for r in range(world) if combined[peaks + world + r] > 0]
        if failed and failure is None:
            raise RuntimeError(f"probing at {where}: rank {', '.join(map(str, failed))} failed (its own error says "
                               f"why); every rank stops")
        result.forward_backward_peak_bytes, result.optimizer_step_peak_bytes = combined[0], combined[1]
        out_of_memory = [r for r in range(world) if combined[peaks + r] > 0]
        if out_of_memory:
            result.feasible = False
            result.error = f"out of memory on rank {', '.join(map(str, out_of_memory))}"
        return combined[2]

    def _run(self, batch, dims, where):
        """One probe step: ``loss_fn(batch)``, ``batch`` the dims or a mix's records."""
        result = _planner.ProbeResult()
        result.dims = dims
        result.capacity_bytes = float(self.meter.capacity_bytes)
        start = time.perf_counter()
        _zero_gradients_in_place(self.steady.parameters)
        without_gradients_peak = 0.0
        failure = None  # (the error to raise, its cause): not out of memory
        try:
            if self.accumulating and self.measure_without_gradients:
                self._release_accumulated_gradient(batch)
            elif self.accumulating and self.accumulation_batch is None:
                self.steady.model.set_requires_gradient_sync(False)
                self.loss_fn(batch).backward()
                self.accumulation_batch = batch
                _zero_gradients_in_place(self.steady.parameters)
            if self.measure_without_gradients:
                for parameter in self.steady.parameters:
                    parameter.grad = None
                without_gradients_peak = self._forward_backward_peak(batch)
                _zero_gradients_in_place(self.steady.parameters)
            result.forward_backward_peak_bytes = self._forward_backward_peak(batch)
            self.meter.reset_peak()
            self.steady.optimizer.step()
            result.optimizer_step_peak_bytes = float(self.meter.peak_allocated_bytes)
        except Exception as error:  # noqa: BLE001 - out of memory is a result, the rest named
            # The graph of a forward that failed goes now, not with the exception.
            traceback.clear_frames(error.__traceback__)
            if not _is_out_of_memory(error):
                failure = (type(error)(f"probing at {where}: {error}"), error)
            else:
                result.feasible = False
                result.error = str(error).splitlines()[0]
            if not result.feasible:
                _drain_autograd_buffers(self.meter)
        finally:
            _zero_gradients_in_place(self.steady.parameters)
        if self.lockstep is not None:
            without_gradients_peak = self._combine_ranks(result, without_gradients_peak, failure, where)
        if failure is not None:
            self.raised = failure[0]
            raise failure[0] from failure[1]
        result.duration_s = time.perf_counter() - start
        self.results.append(result)
        self.without_gradients_peaks.append(without_gradients_peak if result.feasible else 0.0)
        return result

    def _release_accumulated_gradient(self, batch) -> None:
        """FSDP2: a synchronised backward of ``batch`` (reduce-scatter, collective), which frees
        the unsharded gradient accumulation holds, then gradient sync off again: the state of a
        step's first microbatch, measured next; its backward allocates the held gradient anew
        for the steady measurement after it."""
        self.steady.model.set_requires_gradient_sync(True)
        self.loss_fn(batch).backward()
        self.steady.model.set_requires_gradient_sync(False)
        if self.accumulation_batch is None:
            self.accumulation_batch = batch  # released once more at the end (end_accumulation)

    def _forward_backward_peak(self, batch) -> float:
        """The meter's peak over ``loss_fn(batch).backward()``, bytes; the graph freed on return
        (also when it raises: the frame's locals go with it)."""
        self.meter.reset_peak()
        loss = self.loss_fn(batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("the loss function must return a scalar tensor")
        loss.backward()
        del loss
        return float(self.meter.peak_allocated_bytes)


AdaptiveStop = Literal["not run", "agreed", "probe count", "probe time", "no candidates"]
"""Why the adaptive probe design stopped (``AdaptiveReport.stop``)."""


@dataclass
class AdaptiveReport:
    """What the adaptive probe design did.

    Attributes:
        stop: why it stopped (``xpm.AdaptiveStop``): "not run", "agreed", "probe count",
            "probe time" or "no candidates".
        added_probes: the probes it added to the initial design.
        elapsed_s: its time, seconds.
        disagreement: the largest relative disagreement of the candidate models at the last
            check (NaN when never computed).
        disagreement_dims: where that disagreement was (the formula's variables).
        report: a sentence.
    """

    stop: AdaptiveStop
    added_probes: int
    elapsed_s: float
    disagreement: float
    disagreement_dims: List[float]
    report: str


def _local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2's parameters), else the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


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


@dataclass
class ProbeOutcome:
    """What ``probe`` returns.

    Attributes:
        model: the fitted memory model.
        probes: every probe (``dims``, ``feasible`` False: ran out of memory,
            ``forward_backward_peak_bytes``, ``optimizer_step_peak_bytes``, ``step_peak_bytes``,
            ``capacity_bytes``, ``duration_s``, ``error``).
        fit: the fit report (``fit.formula_selection`` lists the candidates with ``formula="auto"``).
        floor: how the floor was chosen, a sentence.
        probe_s: the probing and fitting time, seconds.
        adaptive: what the adaptive design added and why it stopped.
        meter: the meter the probes ran under (the ``CudaMeter`` ``probe`` made for
            ``device="cuda"`` without a meter): give it to ``microbatch_loop(..., meter=)``.
    """

    model: MemoryModel
    probes: List[_planner.ProbeResult]
    fit: FitReport
    floor: str
    probe_s: float
    adaptive: AdaptiveReport
    meter: Optional[Meter] = None


def _enter_steady_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, meter: Meter,
                        ranks: Optional[Lockstep]) -> _SteadyState:
    """The steady state entered (on every rank in lockstep, or on none)."""
    steady, failure = None, None
    try:
        steady = _SteadyState(model, optimizer).__enter__()
    except Exception as error:  # noqa: BLE001 - only out of memory is translated
        failure = error
        if _is_out_of_memory(error):
            failure = ValueError(f"probe: the steady state (gradients and optimizer state) does not fit under the "
                                 f"meter's capacity of {meter.capacity_bytes} bytes: raise the capacity")
    if ranks is not None:
        try:
            ranks.agree(failure, "probe: the steady state")
        except BaseException:
            if steady is not None:
                steady.__exit__(None, None, None)
            raise
    if failure is not None:
        raise failure
    return steady


def _probe_setup(model, meter, device, formula, variables, variable_max, probe_points, record_dims, aggregation,
                 batch_size_variable, budget, design_fractions, usable_max_rel_error, adaptive_max_probes,
                 adaptive_max_s, adaptive_tolerance, lockstep):
    """``probe``'s checks and the planner's arguments: (meter, formula, budget, args). One-line
    ValueErrors before anything is run."""
    meter = _probe_meter(model, meter, device)
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
    _check_aggregation(aggregation, RECORD_AGGREGATIONS, "probe")
    _check_variable_names(formula, variable_max, probe_points, aggregation)
    if not automatic:
        _check_batch_size_variable(formula, batch_size_variable)
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
    if adaptive_max_s is not None and lockstep:
        raise ValueError("probe: adaptive_max_s with lockstep=True: each rank's clock would stop the adaptive design "
                         "at a different probe and the ranks would wait on each other; bound it with "
                         "adaptive_max_probes")
    args.adaptive.max_s = float("inf") if lockstep else float(120.0 if adaptive_max_s is None else adaptive_max_s)
    args.adaptive.tolerance = float(adaptive_tolerance)
    if not probe_points and not design_fractions:
        raise ValueError("probe: design_fractions is empty and no probe_points are given: nothing to probe")
    if probe_points and not automatic and len(probe_points) < len(formula.coefficient_names):
        raise ValueError(f"probe: {len(probe_points)} probe point(s) for {len(formula.coefficient_names)} "
                         f"coefficients ({', '.join(formula.coefficient_names)}); give at least one per coefficient")
    return meter, formula, budget, args


def probe(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
          loss_fn: Callable[[Union[List[float], List[List[float]]]], torch.Tensor],
          formula: Union[CostFormula, Literal["auto"]], *, meter: Optional[Meter],
          budget: Optional[MemoryBudget] = None, variable_max: Optional[Dict[str, float]] = None,
          probe_points: Optional[List[Dict[str, float]]] = None,
          record_dims: Optional[Sequence[Sequence[float]]] = None, variables: Optional[Sequence[str]] = None,
          design_fractions: Sequence[float] = (1.0, 0.75, 0.5), batch_size_variable: str = "bs",
          aggregation: Optional[Dict[str, RecordAggregation]] = None, usable_max_rel_error: float = 0.05,
          adaptive_max_probes: int = 8, adaptive_max_s: Optional[float] = None, adaptive_tolerance: float = 0.01,
          device: Union[DeviceKind, torch.device, str, None] = None, lockstep: bool = False,
          process_group: Optional[Any] = None, measure_phases: bool = True) -> ProbeOutcome:
    """Probes the step (see the module docstring) and fits ``formula``: on rank 0 alone, or on
    every rank in lockstep (an FSDP2 model, ``xpm.lockstep``).

    Args:
        model: the user's module, before any DistributedDataParallel wrapping.
        optimizer: its optimizer, the one training steps (its state is probed too).
        loss_fn: ``loss_fn(dims)`` builds a batch at ``dims`` (variable order; synthetic data is
            fine) and returns its summed loss, a scalar tensor. With ``record_dims`` it gets the
            probe's records instead: ``loss_fn(records)``, one dims list per record (batch-size
            column 1), and builds a batch of exactly those records (each its own length).
        formula: the cost formula, or ``"auto"``: chosen from the probes (the variables are
            ``variables``, else ``variable_max``'s keys in order, or the first probe point's);
            the candidates and the choice are in ``outcome.fit.formula_selection``.
        meter: ``CpuMeter.install()`` (installed before the model was built: its CPU parameters
            must have been allocated under it) or ``CudaMeter()``; required, None only with
            ``device="cuda"`` (a ``CudaMeter`` of that device is made).
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
        adaptive_max_s: the adaptive design's budget of time, seconds (default 120; refused with
            ``lockstep``, where each rank's clock would stop it at a different probe).
        adaptive_tolerance: the relative disagreement the adaptive design stops at (1 %).
        device: where the model is probed (``xpm.DeviceKind``, ``"cuda:N"`` or a
            ``torch.device``). None (the default): wherever ``meter`` measures. ``"cpu"``: needs
            ``meter`` a ``CpuMeter`` (it cannot be made here: it must be installed before the
            model is built). ``"cuda"`` or ``"cuda:N"``: ``meter`` a ``CudaMeter`` of that device,
            or None to have one made. The model's parameters must be on that device.
        lockstep: probe on every rank of ``process_group`` at once (an FSDP2 model, whose
            forward and backward are collectives; ``xpm.lockstep``): every rank calls ``probe``
            with the same arguments, runs the same probes in the same order, and each probe's
            peaks are the maximum over ranks, its out of memory the union, in one all-reduce;
            every rank returns the same model. An FSDP2 model is probed as its microbatches
            accumulate (``set_requires_gradient_sync(False)``, its unsharded gradient held),
            the state of every microbatch of a step but the first. False (the default): this
            process alone (rank 0 of a data-parallel job, before wrapping the model).
        process_group: the ranks of ``lockstep`` (None: torch.distributed's default group).
        measure_phases: also measure every probe's forward and backward with the gradients set
            to None first (one more forward and backward per probe) and fit the
            "without_gradients" phase (``xpm.GradientPhase``): a step's first microbatch after
            ``zero_grad(set_to_none=True)`` peaks lower, by up to the gradients' bytes, and the
            sampler predicts it apart (``model.phases``; the phase's fit in
            ``model.phase_report``). Kept only when that fit is within
            ``usable_max_rel_error``. An FSDP2 model in lockstep is measured in that phase
            without the unsharded gradient its accumulation holds too (released first by a
            synchronised backward of the probe's batch: two more backwards per probe).

    Returns:
        ProbeOutcome: the model, every probe, the fit report, the floor, the adaptive report and
        the meter.

    Raises:
        ValueError: bad options (a ``variable_max``, ``aggregation`` or ``probe_points`` key that
            is not a variable of the formula, named with the formula's variables; ``record_dims``
            of the wrong width, with a batch-size column other than 1 or a NaN, infinite or
            negative value, named by row; ``"auto"`` with ``record_dims`` but no ``variables``),
            an ``aggregation`` value other than "max" or "sum" (named with its variable), a
            ``CpuMeter`` that counts fewer bytes than the model's CPU parameters take (installed
            after the model was built), or a budget the probes cannot work under; nothing is
            probed then. ``device`` errors come first, one line each, before anything is
            touched: ``"cuda"`` where ``torch.cuda.is_available()`` is False (with the reason: a
            torch build without CUDA, or no GPU visible), a CUDA index torch does not see, a
            device that is not CPU or CUDA, a ``meter`` of another device (or None with
            ``"cpu"``, or with no ``device``), the model's parameters on another device, a
            ``batch_size_variable`` in which the formula grows faster than linearly (a length
            named as the batch size).
        RuntimeError: an unusable fit (its ``probes`` attribute holds the probes, so ``xpm.fit``
            can refit them; the note on ``usable_max_rel_error`` only where a reason is that
            limit). With ``lockstep``, every rank raises when one does: that rank its own error,
            the others a RuntimeError naming it.
        Exception: an error of ``loss_fn``, of its own type, its message prefixed with the
            probe's dims ("probing at bs=16 l=48: ...").

    After any error the frames the error passed through hold no locals (the probe's batches,
    graphs and saved optimizer state are freed), so keeping the exception keeps no memory.

    Warns:
        RuntimeWarning: two columns of ``record_dims`` are equal on every record and neither is
            summed (a count of real tokens left at the default aggregation, max).

    Whatever is allocated after probing (a dataset made of tensors, caches, a second optimizer)
    is not in the model: build it before, or leave room for it in ``budget``
    (``xpm.check_unplanned_memory`` warns about it during training). The model records the
    bytes allocated before every probe (``result.model.static_bytes``).
    """
    ranks = Lockstep(process_group) if lockstep else None
    if ranks is None and process_group is not None:
        raise ValueError("probe: process_group names the ranks of lockstep=True probing; give lockstep=True")
    setup_error = None
    try:
        meter, formula, budget, args = _probe_setup(
            model, meter, device, formula, variables, variable_max, probe_points, record_dims, aggregation,
            batch_size_variable, budget, design_fractions, usable_max_rel_error, adaptive_max_probes, adaptive_max_s,
            adaptive_tolerance, lockstep)
    except Exception as error:  # noqa: BLE001 - raised below, on every rank in lockstep
        setup_error = error
    if ranks is not None:
        ranks.agree(setup_error, "probe: checking the options")
    elif setup_error is not None:
        raise setup_error
    try:
        return _probe_and_fit(model, optimizer, loss_fn, meter, formula, budget, args, ranks, batch_size_variable,
                              aggregation, measure_phases)
    except BaseException as error:
        _release_frames(error)  # the probe's batches, graphs and saved state go with the frames' locals
        raise


def _probe_and_fit(model, optimizer, loss_fn, meter, formula, budget, args, ranks, batch_size_variable,
                   aggregation, measure_phases) -> ProbeOutcome:
    """``probe``'s steps once its options are checked: the steady state, the probes, the fit."""
    start = time.perf_counter()
    steady = _enter_steady_state(model, optimizer, meter, ranks)
    executor = _TorchExecutor(steady, loss_fn, meter, list(formula.variable_names), batch_size_variable, aggregation,
                              ranks, measure_phases)
    try:
        native, probes, summary, floor, adaptive, selection = _planner.probe_and_fit(executor, formula, budget, args)
    except RuntimeError as error:
        if error is executor.raised:  # a probe's own error (the loss function's): as it was raised
            raise
        failure = RuntimeError(f"{error} (xpm.probe(..., usable_max_rel_error=...) sets that limit; this error's "
                               f".probes holds the {len(executor.results)} probes, for xpm.fit)"
                               if "usable_max_rel_error" in str(error) else str(error))
        failure.probes = list(executor.results)
        raise failure from None
    finally:
        try:
            executor.end_accumulation()
        finally:
            steady.__exit__(None, None, None)
    memory_model = _with_without_gradients_phase(MemoryModel(native), executor, aggregation,
                                                 args.usable_max_rel_error)
    return ProbeOutcome(memory_model, list(probes), _report(summary, selection), floor,
                        time.perf_counter() - start, AdaptiveReport(**adaptive), meter)


def _with_without_gradients_phase(model: MemoryModel, executor: _TorchExecutor,
                                  aggregation: Optional[Dict[str, RecordAggregation]],
                                  usable_max_rel_error: float) -> MemoryModel:
    """``model`` with its "without_gradients" phase: the model's formula fitted to the peaks
    measured without gradients at the shapes the model itself was fitted to; ``model`` as it is
    when that phase was not measured, or its fit is not identifiable or not within
    ``usable_max_rel_error``. Deterministic from the probes, so every rank in lockstep agrees."""
    peaks_at: Dict[tuple, float] = {}
    for result, peak in zip(executor.results, executor.without_gradients_peaks):
        if result.feasible and peak > 0:
            key = tuple(result.dims)
            peaks_at[key] = max(peaks_at.get(key, 0.0), peak)
    shapes = [m["dims"] for m in model._parsed().get("metadata", {}).get("fit_measurements", [])]
    if not shapes or any(tuple(dims) not in peaks_at for dims in shapes):
        return model
    # As the model's own fit: the shapes where the phase peaks above the floor (below it, the
    # floor predicts; the prediction is the larger of the two).
    width = len(model.formula.variable_names)
    floor_at = model.floor_at(_matrix(shapes, width, "dims"))
    shapes = [dims for dims, floor in zip(shapes, floor_at) if peaks_at[tuple(dims)] > floor]
    if len(shapes) < len(model.formula.coefficient_names):
        return model
    args = _planner.FitArguments()
    args.batch_size_variable = model.batch_size_variable
    args.aggregation = dict(aggregation or {})
    args.usable_max_rel_error = usable_max_rel_error
    try:
        native, summary, _ = _planner.fit(model.formula, _matrix(shapes, width, "dims"),
                                          np.array([peaks_at[tuple(dims)] for dims in shapes]),
                                          np.zeros((0, width)), np.zeros(0), args)
    except (ValueError, RuntimeError):
        return model  # not identifiable from these shapes: the first microbatch is predicted as the others
    if not np.isfinite(summary["max_rel_error"]) or abs(summary["max_rel_error"]) > usable_max_rel_error:
        return model
    return model._with_phase("without_gradients", native.coefficients, native.single_record_factor,
                             summary["max_rel_error"], len(shapes))


def _release_frames(error: BaseException) -> None:
    """Clears the local variables of the finished frames in ``error``'s traceback and in those of
    its cause and context (tensors of a failed forward, the probe's state), keeping the
    tracebacks' lines: an exception kept by the caller then holds no memory of the probe."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        for linked in (error.__cause__, error.__context__):
            if linked is not None and id(linked) not in seen:
                traceback.clear_frames(linked.__traceback__)
        error = error.__cause__ or error.__context__
