"""Training under a memory cap with the plans of a probed model (tests/python/model_suite.py).

The project's goal for training: under a memory cap that binds, 0 out-of-memory errors, and no
microbatch under-predicted by more than 1 % after the first optimizer step. For each case here
(a model of the suite the planner has never seen, and the formula it is probed with), in one
process under the CPU meter:

1. the model is built after the meter is installed; one calibration step at ``variable_max``
   (without a cap) gives the step's peak there, and the meter's cap is set to the static bytes
   (weights, gradients, optimizer state) plus ``CAP_FRACTION`` of what the step adds above them,
   so an outer batch of ``OUTER_BATCH`` records must be split into several microbatches;
2. ``xpm.probe`` (automatic design) fits the model under that cap;
3. a synthetic, seeded dataset of records whose dims are drawn inside the probed range of every
   variable (the batch-size column 1) is planned by ``xpm.PredictiveBatchSampler`` under the
   budget (``MemoryBudget(cap).usable_bytes``) and trained for ``STEPS`` optimizer steps with
   gradient accumulation through ``xpm.microbatch_loop``: each microbatch runs the model's loss on
   a batch at the microbatch's planned dims (records, and the largest value of each other
   variable: what the planner predicts for), backward, and one optimizer step per outer batch at
   the optimizer's real learning rate; for a model probed with a record sample (summed real
   tokens), the dataset is another such sample and each microbatch runs on its own records;
4. each microbatch's peak allocated bytes (the forward/backward, and for a step's last
   microbatch also the optimizer step) is compared with the sampler's prediction of it
   (``Microbatch.predicted_bytes``: ``model.predict(dims)``, in the "without_gradients" phase
   for a step's first microbatch, which runs after ``zero_grad()`` has set the gradients to
   None).

Asserted: the meter's ``oom_count`` unchanged over training (no out-of-memory error), several
microbatches per step (the cap binds), and every microbatch after the first step
under-predicted by at most 1 % ((measured - predicted) / measured <= 0.01). Each case prints its
figures (-s): steps, microbatches, the largest under- and over-prediction, the out-of-memory
count. Where the planner misses the goal the case is marked xfail with the measured figures, the
assertion kept.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import pytest
import torch

import xpm
from model_suite import SPECS, ModelSpec, aggregate, probed_ranges
from xpm.probe_executor import _SteadyState, _TorchExecutor  # the probe step itself, for the calibration step

torch.set_num_threads(1)
METER = xpm.CpuMeter.install()  # before any model is built: the meter must see the weights
GOAL = 0.01                     # no microbatch under-predicted by more than 1 % after the first step
CAP_FRACTION = 0.35             # the cap: static bytes + this share of the step's bytes at variable_max
OUTER_BATCH = 32                # records per optimizer step
STEPS = 4                       # optimizer steps trained per case
RECORDS = OUTER_BATCH * STEPS   # the dataset: exactly STEPS outer batches

# (model, formula) -> the xfail reason (measured figures) where the planner misses the goal.
XFAIL: Dict[Tuple[str, str], str] = {}

CASES = [("seq2seq", "auto"), ("moving_peak", "user"), ("packed_lstm", "user"), ("char_lm", "user"),
         ("packed_tokens", "user")]


@dataclass
class MicrobatchRecord:
    """One trained microbatch: its step, planned dims, measured and predicted peak bytes."""

    step: int
    dims: List[int]
    measured: float
    predicted: float

    @property
    def under(self) -> float:
        """(measured - predicted) / measured: > 0 when the prediction is below the measurement."""
        return (self.measured - self.predicted) / self.measured


@dataclass
class TrainingResult:
    """What ``train_under_cap`` found for one case."""

    name: str
    formula: str
    capacity_bytes: int = 0
    usable_bytes: int = 0
    static_bytes: float = 0.0
    peak_at_max_bytes: float = 0.0
    probes: int = 0
    probe_s: float = 0.0
    chosen_formula: str = ""
    steps: int = 0
    ooms: int = 0
    oom_errors: List[str] = field(default_factory=list)
    warnings: List[str] = field(default_factory=list)
    losses: List[float] = field(default_factory=list)
    microbatches: List[MicrobatchRecord] = field(default_factory=list)
    train_s: float = 0.0
    parameters_changed: bool = False

    def after_first_step(self) -> List[MicrobatchRecord]:
        return [m for m in self.microbatches if m.step > 0]

    def worst_under(self) -> Optional[MicrobatchRecord]:
        """The microbatch after the first step with the largest under-prediction (signed)."""
        later = self.after_first_step()
        return max(later, key=lambda m: m.under) if later else None

    def worst_over(self) -> Optional[MicrobatchRecord]:
        """The microbatch after the first step with the largest over-prediction."""
        later = self.after_first_step()
        return min(later, key=lambda m: m.under) if later else None

    def line(self) -> str:
        under, over = self.worst_under(), self.worst_over()
        figures = "no microbatch after the first step"
        if under is not None and over is not None:
            figures = (f"largest under-prediction {100 * under.under:+.2f} % at {under.dims} "
                       f"(measured {under.measured:.0f}, predicted {under.predicted:.0f}), largest "
                       f"over-prediction {100 * -over.under:.2f} % at {over.dims}")
        first = [m for m in self.microbatches if m.step == 0]
        first_under = max((m.under for m in first), default=float("nan"))
        return (f"{self.name} ({self.formula}): cap {self.capacity_bytes} bytes (static {self.static_bytes:.0f}, "
                f"step peak at variable_max {self.peak_at_max_bytes:.0f}), usable {self.usable_bytes}; "
                f"{self.probes} probes in {self.probe_s:.1f} s, formula {self.chosen_formula}; "
                f"{self.steps} steps, {len(self.microbatches)} microbatches "
                f"({len(self.after_first_step())} after the first step) in {self.train_s:.1f} s; {figures}; "
                f"first step's largest under-prediction {100 * first_under:+.2f} %; out-of-memory errors "
                f"{self.ooms}; losses {', '.join(f'{x:.3f}' for x in self.losses)}; "
                f"{len(self.warnings)} warnings")


def _is_out_of_memory(error: BaseException) -> bool:
    return "out of memory" in str(error).lower()


def _step_peak_at(module: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable,
                  variables: List[str], dims: List[float],
                  records: Optional[List[List[float]]] = None) -> Tuple[float, float]:
    """One probe step at ``dims`` (of ``records``, for a model probed with a record sample)
    without a cap: (static bytes, the step's peak bytes); the optimizer, learning rates and
    random generators are restored afterwards."""
    previous = METER.capacity_bytes
    METER.capacity_bytes = 0
    steady = _SteadyState(module, optimizer).__enter__()
    try:
        executor = _TorchExecutor(steady, loss_fn, METER, variables)
        static = executor.static_bytes()
        probe = executor.run_probe_records(records) if records else executor.run_probe(dims)
        assert probe.feasible, f"the calibration step at {dims} failed: {probe.error}"
        return static, max(probe.forward_backward_peak_bytes, probe.optimizer_step_peak_bytes)
    finally:
        steady.__exit__(None, None, None)
        METER.capacity_bytes = previous


def _record_dims(ranges: Dict[str, Tuple[float, float]], variables: List[str], count: int,
                 rng: np.random.Generator) -> np.ndarray:
    """[count, variables] record dims: the batch-size column 1, every other variable drawn on its
    own, uniformly (integers), inside its probed range."""
    columns = []
    for v in variables:
        if v == "bs":
            columns.append(np.ones(count))
        else:
            low, high = int(np.ceil(ranges[v][0])), int(np.floor(ranges[v][1]))
            columns.append(rng.integers(low, high + 1, size=count).astype(np.float64))
    return np.ascontiguousarray(np.stack(columns, axis=1))


def train_under_cap(spec: ModelSpec, formula: str, seed: int = 0) -> TrainingResult:
    """Builds, probes under a binding cap and trains one case (see the module docstring)."""
    result = TrainingResult(spec.name, formula)
    torch.manual_seed(seed)
    module, optimizer, loss_fn = spec.build()
    module.train()
    variables = list(spec.variables)

    # The cap: static bytes plus CAP_FRACTION of the step's bytes above them at variable_max
    # (with a record sample: the variable_max[bs] largest records of the dataset).
    rng = np.random.default_rng(seed + 1)
    dataset = spec.record_sample(seed + 1)[:RECORDS] if spec.record_sample else None
    largest = sorted(dataset, key=lambda r: r[1:])[-int(spec.variable_max["bs"]):] if dataset else None
    at_max = aggregate(spec, largest) if dataset else [float(spec.variable_max[v]) for v in variables]
    result.static_bytes, result.peak_at_max_bytes = _step_peak_at(module, optimizer, loss_fn, variables, at_max,
                                                                  largest)
    result.capacity_bytes = int(result.static_bytes + CAP_FRACTION * (result.peak_at_max_bytes - result.static_bytes))
    budget = xpm.MemoryBudget(result.capacity_bytes)
    result.usable_bytes = int(budget.usable_bytes)

    previous_capacity = METER.capacity_bytes
    METER.capacity_bytes = result.capacity_bytes
    try:
        cost = xpm.CostFormula(spec.formula, variables) if formula == "user" else "auto"
        outcome = xpm.probe(module, optimizer, loss_fn, cost, meter=METER, budget=budget,
                            variable_max=spec.variable_max, usable_max_rel_error=spec.usable_max_rel_error,
                            aggregation=spec.aggregation or None,
                            record_dims=spec.record_sample(seed) if spec.record_sample else None,
                            variables=variables if formula == "auto" else None)
        model = outcome.model
        result.probes, result.probe_s = len(outcome.probes), outcome.probe_s
        result.chosen_formula = model.formula.canonical

        records = (np.array(dataset) if dataset
                   else _record_dims(probed_ranges(model), variables, RECORDS, rng))
        sampler = xpm.PredictiveBatchSampler(records, model, result.usable_bytes, outer_batch_size=OUTER_BATCH,
                                             seed=seed, drop_last=True)
        # NumPy copies: memory the meter does not count (a tensor copy would be unplanned memory).
        before = [p.detach().numpy().copy() for p in module.parameters()]
        ooms_before = METER.oom_count
        start = time.perf_counter()
        optimizer.zero_grad()
        step_loss = 0.0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for microbatch, weight, last in xpm.microbatch_loop(iter(sampler), sampler, meter=METER, module=module):
                dims = [int(d) for d in microbatch.dims]
                records_in = dims[variables.index("bs")]
                try:
                    METER.reset_peak()
                    # The loss averaged over the outer batch's records: the microbatch's summed
                    # loss / its records x its weight (its share of the outer batch's records).
                    batch = [list(records[i]) for i in microbatch] if dataset else dims
                    loss = loss_fn(batch) * (weight / records_in)
                    loss.backward()
                    step_loss += float(loss.detach())
                    loss = None
                    measured = float(METER.peak_allocated_bytes)
                    if last:
                        METER.reset_peak()
                        optimizer.step()
                        measured = max(measured, float(METER.peak_allocated_bytes))
                except RuntimeError as error:
                    if not _is_out_of_memory(error):
                        raise
                    loss = None
                    result.oom_errors.append(f"step {microbatch.step} dims {dims}: {str(error).splitlines()[0]}")
                    measured = float("nan")
                if not np.isnan(measured):
                    result.microbatches.append(MicrobatchRecord(microbatch.step, dims, measured,
                                                                float(microbatch.predicted_bytes)))
                if last:
                    optimizer.zero_grad()
                    result.losses.append(step_loss)
                    step_loss = 0.0
                    result.steps += 1
        result.warnings = [str(w.message) for w in caught]
        result.train_s = time.perf_counter() - start
        result.ooms = METER.oom_count - ooms_before
        result.parameters_changed = any(not np.array_equal(b, p.detach().numpy())
                                        for b, p in zip(before, module.parameters()))
    finally:
        METER.capacity_bytes = previous_capacity
    return result


def _cases():
    for name, formula in CASES:
        reason = XFAIL.get((name, formula))
        marks = [pytest.mark.xfail(strict=False, reason=reason)] if reason else []
        yield pytest.param(name, formula, marks=marks, id=f"{name}-{formula}")


@pytest.mark.parametrize("name, formula", list(_cases()))
def test_training_under_a_binding_cap_runs_out_of_memory_never_and_under_predicts_within_the_goal(
        name: str, formula: str) -> None:
    result = train_under_cap(SPECS[name], formula)
    print(f"\n{result.line()}")
    for message in result.warnings:
        print(f"  warning: {message}")
    for message in result.oom_errors:
        print(f"  out of memory: {message}")
    assert result.steps == STEPS, result.line()
    assert len(result.microbatches) >= 2 * STEPS, f"the cap does not bind: {result.line()}"
    assert result.ooms == 0 and not result.oom_errors, result.line()
    assert all(np.isfinite(result.losses)), result.line()
    assert result.parameters_changed, "the optimizer steps left the parameters unchanged"
    records = {}
    for m in result.microbatches:
        records[m.step] = records.get(m.step, 0) + m.dims[SPECS[name].variables.index("bs")]
    assert records == {step: OUTER_BATCH for step in range(STEPS)}, records  # every record trained once
    worst = result.worst_under()
    assert worst is not None and worst.under <= GOAL, result.line()
