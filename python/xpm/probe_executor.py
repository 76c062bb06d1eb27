"""One probe of a PyTorch training step, measured: the steady state the probes run in (every
gradient allocated, the optimizer's state built, both restored afterwards) and the executor the
C++ planner drives (``_planner.ProbeExecutor``: run one probe at given dims, report its peaks or
that it ran out of memory). ``xpm.probe`` (probing.py) builds both; the test suites drive them
directly to measure held-out shapes the way a probe does.

    steady = _SteadyState(model, optimizer).__enter__()
    try:
        executor = _TorchExecutor(steady, loss_fn, meter, ["bs", "l"])
        result = executor.run_probe([8.0, 120.0])   # feasible, and each phase's peak (bytes)
    finally:
        steady.__exit__(None, None, None)
"""
from __future__ import annotations

import gc
import io
import time
import traceback
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from . import _planner
from .lockstep import Lockstep
from .meters import CpuMeter, Meter, planned_bytes_kind, planned_peak_bytes, start_peak
from .planning import RecordAggregation


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


def _check_finite(loss: torch.Tensor) -> torch.Tensor:
    """``loss``, when finite. Raises ValueError otherwise: its backward would turn the parameters
    into NaN at the probes' optimizer steps, learning rate 0 or not (0 x NaN is NaN)."""
    if not bool(torch.isfinite(loss.detach()).all()):
        raise ValueError(f"the loss is not finite ({float(loss.detach().float().sum())}): its gradients would "
                         "turn the parameters into NaN at the probes' optimizer steps, learning rate 0 or not")
    return loss


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
        # FSDP2's accumulation with phases measured: each probe's forward/backward once more,
        # synchronised, after the steady measurement (the unsharded gradient held, the sharded
        # one set to None): a step's last microbatch after zero_grad(set_to_none=True), which
        # reduce-scatters; the optimizer step is then measured as it follows it.
        self.measure_synchronised = measure_phases and self.accumulating
        self.synchronised_peaks: List[float] = []  # one per entry of results (0: not measured)
        self.results = []  # every probe run, for an error that must carry them
        # Where plans bound reserved bytes (a caching allocator): each probe's reserved step peak
        # (0: infeasible), from an emptied cache, and its reserved / allocated forward/backward peak.
        self.reserving = planned_bytes_kind(meter) == "reserved"
        self.reserved_step_peaks: List[float] = []  # one per entry of results
        self.reserved_without_gradients_peaks: List[float] = []  # the same, the step's first microbatch
        self.reserved_ratios: List[float] = []
        self._reserved_peak = 0.0                   # the last measured phase's
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

    def _combine_ranks(self, result, without_gradients_peak: float, synchronised_peak: float,
                       reserved: Tuple[float, float], failure, where: str) -> Tuple[float, float, float, float]:
        """Lockstep: every rank's peaks and forward/backward time (max), out-of-memory and error
        flags in one all-reduce; an error on another rank raises here, one out of memory
        anywhere makes the probe infeasible on every rank. Returns the ranks' largest peaks
        without gradients, synchronised, and reserved (steady, then without gradients)."""
        world, peaks = self.lockstep.world_size, 8
        mine = [0.0] * (peaks + 2 * world)
        mine[0], mine[1] = result.forward_backward_peak_bytes, result.optimizer_step_peak_bytes
        mine[2], mine[3] = without_gradients_peak, synchronised_peak
        mine[4] = result.forward_backward_s  # the slowest rank's: every rank fits the same time model
        mine[5], mine[6] = reserved
        mine[7] = -result.capacity_bytes  # the least bound (reserving meters: what the rank out of memory allocated)
        mine[peaks + self.lockstep.rank] = 0.0 if result.feasible else 1.0
        mine[peaks + world + self.lockstep.rank] = 0.0 if failure is None else 1.0
        combined = self.lockstep.max(mine)
        failed = [r for r in range(world) if combined[peaks + world + r] > 0]
        if failed and failure is None:
            raise RuntimeError(f"probing at {where}: rank {', '.join(map(str, failed))} failed (its own error says "
                               f"why); every rank stops")
        result.forward_backward_peak_bytes, result.optimizer_step_peak_bytes = combined[0], combined[1]
        result.forward_backward_s = combined[4]
        result.capacity_bytes = -combined[7]
        out_of_memory = [r for r in range(world) if combined[peaks + r] > 0]
        if out_of_memory:
            result.feasible = False
            result.error = f"out of memory on rank {', '.join(map(str, out_of_memory))}"
        return combined[2], combined[3], combined[5], combined[6]

    def _run(self, batch, dims, where):
        """One probe step: ``loss_fn(batch)``, ``batch`` the dims or a mix's records."""
        result = _planner.ProbeResult()
        result.dims = dims
        result.capacity_bytes = float(self.meter.capacity_bytes)
        start = time.perf_counter()
        _zero_gradients_in_place(self.steady.parameters)
        without_gradients_peak = synchronised_peak = reserved_step_peak = reserved_without_gradients = ratio = 0.0
        failure = None  # (the error to raise, its cause): not out of memory
        try:
            if self.accumulating and self.measure_without_gradients:
                self._release_accumulated_gradient(batch)
            elif self.accumulating and self.accumulation_batch is None:
                self.steady.model.set_requires_gradient_sync(False)
                _check_finite(self.loss_fn(batch)).backward()
                self.accumulation_batch = batch
                _zero_gradients_in_place(self.steady.parameters)
            if self.measure_without_gradients:
                for parameter in self.steady.parameters:
                    parameter.grad = None
                without_gradients_peak = self._forward_backward_peak(batch)
                reserved_without_gradients = self._reserved_peak  # the gradients placed among the activations
                _zero_gradients_in_place(self.steady.parameters)
            forward_start = time.perf_counter()
            result.forward_backward_peak_bytes = self._forward_backward_peak(batch)
            reserved_step_peak = self._reserved_peak
            if self.reserving and result.forward_backward_peak_bytes > 0:
                ratio = self._reserved_peak / result.forward_backward_peak_bytes
            result.forward_backward_s = time.perf_counter() - forward_start
            if self.measure_synchronised:  # as after zero_grad(set_to_none=True): the reduce-scatter makes them
                for parameter in self.steady.parameters:
                    parameter.grad = None
                self.steady.model.set_requires_gradient_sync(True)
                try:
                    synchronised_peak = self._forward_backward_peak(batch)
                finally:
                    self.steady.model.set_requires_gradient_sync(False)
            start_peak(self.meter)
            self.steady.optimizer.step()
            result.optimizer_step_peak_bytes = float(self.meter.peak_allocated_bytes)
            reserved_step_peak = max(reserved_step_peak, self._reserved())
        except Exception as error:  # noqa: BLE001 - out of memory is a result, the rest named
            # The graph of a forward that failed goes now, not with the exception.
            traceback.clear_frames(error.__traceback__)
            if not _is_out_of_memory(error):
                failure = (type(error)(f"probing at {where}: {error}"), error)
            else:
                result.feasible = False
                result.error = str(error).splitlines()[0]
                if self.reserving:  # reserved bytes reached the cap: the allocated fit's bound is what was allocated
                    result.capacity_bytes = float(self.meter.peak_allocated_bytes)
            if not result.feasible:
                _drain_autograd_buffers(self.meter)
                _reset_data_parallel_reducer(self.steady.model)
        finally:
            _zero_gradients_in_place(self.steady.parameters)
        if self.lockstep is not None:
            without_gradients_peak, synchronised_peak, reserved_step_peak, reserved_without_gradients = \
                self._combine_ranks(result, without_gradients_peak, synchronised_peak,
                                    (reserved_step_peak, reserved_without_gradients), failure, where)
        if failure is not None:
            self.raised = failure[0]
            raise failure[0] from failure[1]
        result.duration_s = time.perf_counter() - start
        self.results.append(result)
        self.without_gradients_peaks.append(without_gradients_peak if result.feasible else 0.0)
        self.synchronised_peaks.append(synchronised_peak if result.feasible else 0.0)
        self.reserved_step_peaks.append(reserved_step_peak if result.feasible else 0.0)
        self.reserved_without_gradients_peaks.append(reserved_without_gradients if result.feasible else 0.0)
        if result.feasible and ratio > 0:
            self.reserved_ratios.append(ratio)
        return result

    def _release_accumulated_gradient(self, batch) -> None:
        """FSDP2: a synchronised backward of ``batch`` (reduce-scatter, collective), which frees
        the unsharded gradient accumulation holds, then gradient sync off again: the state of a
        step's first microbatch, measured next; its backward allocates the held gradient anew
        for the steady measurement after it."""
        self.steady.model.set_requires_gradient_sync(True)
        _check_finite(self.loss_fn(batch)).backward()
        self.steady.model.set_requires_gradient_sync(False)
        if self.accumulation_batch is None:
            self.accumulation_batch = batch  # released once more at the end (end_accumulation)

    def _forward_backward_peak(self, batch) -> float:
        """The meter's peak over ``loss_fn(batch).backward()``, bytes; the graph freed on return
        (also when it raises: the frame's locals go with it)."""
        start_peak(self.meter)
        loss = self.loss_fn(batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("the loss function must return a scalar tensor")
        _check_finite(loss)
        loss.backward()
        del loss
        self._reserved_peak = self._reserved()
        return float(self.meter.peak_allocated_bytes)

    def _reserved(self) -> float:
        """The reserved peak since ``start_peak`` where the meter reserves segments, else 0."""
        return float(planned_peak_bytes(self.meter)) if self.reserving else 0.0


def _reset_data_parallel_reducer(model: torch.nn.Module) -> None:
    """DistributedDataParallel: a forward or backward that ran out of memory leaves its reducer
    waiting for that backward's buckets, and the next forward would refuse to start ("Expected to
    have finished reduction in the prior iteration"); in lockstep every rank ran out of memory at
    that probe, so every rank resets its reducer here (DDP's own reset, private in torch 2.x;
    nothing where it is missing)."""
    reset = getattr(getattr(model, "reducer", None), "_reset_state", None)
    if callable(reset):
        reset()


def _local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2's parameters), else the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _enter_steady_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, meter: Meter,
                        ranks: Optional[Lockstep]) -> _SteadyState:
    """The steady state entered (on every rank in lockstep, or on none). Garbage is collected
    first: tensors of earlier work held in reference cycles (a failed run's traceback, a loaded
    checkpoint) would otherwise be freed in the middle of a probe and lower its peak (measured:
    a Lightning fit after a refused one, 19.5 % off at one probe and the fit refused)."""
    gc.collect()
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
