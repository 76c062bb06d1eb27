"""The CPU meter playing CUDA's caching allocator (``xpm.CpuMeter.install(caching=True)``):
the shared allocation sequences, and planning that bounds reserved bytes.

The sequences (tests/caching_allocator/sequences.json) are replayed through the meter by
tools/replay_allocation_sequences.py in a process of their own (nothing else in its allocator)
and must give the table's bytes, which the C++ emulation's test checks too.

The training case: a token model (embedding, a wide MLP block, an output layer) whose
microbatches change shape every step (records of 8 to 256 tokens), under a cap on reserved bytes
that binds, trained through ``xpm.microbatch_loop``. Planned by the reserved bytes the emulated
allocator holds (probes and calibration from an emptied cache): 0 out-of-memory errors, and from
the third optimizer step no microbatch above half the budget planned more than 1 % under its
measured reserved peak (the over side is printed: at this scale a 20 MiB segment is about 8 %
of the budget, and the reserved peaks of neighbouring shapes differ by whole segments). The
same model and cap planned by allocated bytes alone (a meter that hides its segments) runs out
of memory: the segments' rounding and fragmentation are what the plan must hold.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, List, Tuple

import numpy as np
import pytest
import torch

import xpm
from xpm.meters import planned_bytes_kind, planned_peak_bytes

ROOT = pathlib.Path(__file__).resolve().parents[2]
OUTER_BATCH = 32
STEPS = 6
VARIABLE_MAX = {"bs": 16, "l": 128}
VOCABULARY = 8192
MEMORY_FRACTION = 1.0  # no room beside the plan: what the plan leaves out runs out of memory
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def meter():
    """The process's CPU meter, caching while this module's tests run."""
    installed = xpm.CpuMeter.install(caching=True, expandable_segments=False)
    yield installed
    installed.capacity_bytes = 0
    installed.set_caching(False)


def test_the_meter_replays_the_shared_sequences_as_the_table_says() -> None:
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "replay_allocation_sequences.py"), "--device", "cpu"],
                         capture_output=True, text=True, env=dict(os.environ), timeout=120)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) >= 8, run.stdout
    for line in lines:
        name, _, figures = line.partition(": ")
        for figure in figures.split("; "):
            key, value, table = figure.split(" ", 2)
            assert f"(table {value})" == table, f"{name}: {key} {value}, the table says {table}"


def test_caching_reports_reserved_bytes_and_caps_them(meter: xpm.CpuMeter) -> None:
    assert meter.caching == "segments" and planned_bytes_kind(meter) == "reserved"
    meter.empty_cache()
    base_allocated, base_reserved = meter.current_allocated_bytes, meter.current_reserved_bytes
    block = torch.empty(3 << 20, dtype=torch.uint8)  # 3 MiB: a 20 MiB segment
    assert meter.current_allocated_bytes - base_allocated == 3 << 20
    assert meter.current_reserved_bytes - base_reserved == 20 << 20
    del block
    assert meter.current_reserved_bytes - base_reserved == 20 << 20  # cached
    meter.empty_cache()
    assert meter.current_reserved_bytes == base_reserved
    meter.capacity_bytes = base_reserved + (10 << 20)
    try:
        with pytest.raises(torch.OutOfMemoryError, match="CPU memory cap exceeded.*bytes reserved"):
            torch.empty(3 << 20, dtype=torch.uint8)  # 3 MiB allocated would fit; its 20 MiB segment does not
    finally:
        meter.capacity_bytes = 0


def test_bad_caching_arguments_are_refused_in_one_line(meter: xpm.CpuMeter) -> None:
    with pytest.raises(ValueError, match="caching must be True, False or None, got 'yes'"):
        xpm.CpuMeter.install(caching="yes")
    with pytest.raises(ValueError, match="enabled must be True or False, got 'no'"):
        meter.set_caching("no")
    with pytest.raises(ValueError, match="expandable_segments=True needs caching=True"):
        xpm.CpuMeter.install(expandable_segments=True)
    assert xpm.CpuMeter.install(caching=True).caching == "segments"  # as it is: a second install changes nothing
    assert xpm.CpuMeter.install() is meter is xpm.CpuMeter.installed()  # the same meter, not a second view of it
    assert xpm.meters.allocator_settings({"PYTORCH_ALLOC_CONF": "roundup_power2_divisions:[256:1,>:8]"}) == \
        {"roundup_power2_divisions": "[256:1,>:8]"}
    with pytest.raises(ValueError, match="PYTORCH_ALLOC_CONF='expandable_segments:maybe'"):
        xpm.meters.allocator_settings({"PYTORCH_ALLOC_CONF": "expandable_segments:maybe"})
    assert "expandable_segments:True" in xpm.meters.allocator_settings_line(
        {"PYTORCH_ALLOC_CONF": "expandable_segments:True"})


def test_probes_out_of_memory_on_reserved_bytes_bound_the_fit_by_what_they_allocated(meter: xpm.CpuMeter) -> None:
    torch.manual_seed(0)
    meter.capacity_bytes = 0
    model = torch.nn.Sequential(torch.nn.Embedding(96, 64), torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 96))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss_fn(dims: List[float]) -> torch.Tensor:
        tokens = torch.randint(0, 96, (int(dims[0]), int(dims[1])))
        return torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten(), reduction="sum")

    meter.capacity_bytes = 60_000_000
    try:
        outcome = xpm.probe(model, optimizer, loss_fn, xpm.CostFormula("a*bs*l + d*bs + c", ["bs", "l"]), meter=meter,
                            variable_max={"bs": 64, "l": 256})
    finally:
        meter.capacity_bytes = 0
    out_of_memory = [p for p in outcome.probes if not p.feasible]
    assert out_of_memory and all(p.capacity_bytes < 60_000_000 for p in out_of_memory)  # bound: allocated bytes
    assert abs(outcome.fit.max_rel_error) < 0.05


def test_plans_of_a_model_with_a_reserved_gap_fit_the_reserved_budget() -> None:
    model, _ = xpm.fit(xpm.CostFormula("a*bs*l + c", ["bs", "l"]), [[1, 10], [2, 10], [4, 20], [8, 20], [3, 30]],
                       [1.1e6, 1.2e6, 1.8e6, 2.6e6, 2.0e6])
    gapped = model._with_reserved_gap(100_000.0, 0.05, 5)
    lengths = np.arange(4, 40)
    budget = 3_000_000
    inner = gapped._native.prediction_budget_bytes(budget)
    assert inner == int((budget - 100_000) / 1.05)
    planned = xpm.plan(xpm.record_dims_from_lengths(lengths), gapped, budget)
    assert max(planned.predicted_bytes) <= inner
    again = xpm.plan(xpm.record_dims_from_lengths(lengths), model, inner)
    assert np.array_equal(planned.indices, again.indices) and np.array_equal(planned.offsets, again.offsets)
    assert gapped.max_batch([1, 20], budget) == model.max_batch([1, 20], inner) < model.max_batch([1, 20], budget)


class TokenModel(torch.nn.Module):
    """Tokens in, the next token out: embedding, a 4x-wide MLP block, an output layer."""

    def __init__(self, width: int = 512) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCABULARY, width)
        self.block = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                         torch.nn.Linear(4 * width, width))
        self.out = torch.nn.Linear(width, VOCABULARY)

    def loss_sum(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens[:, :-1])
        logits = self.out(hidden + self.block(hidden))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCABULARY), tokens[:, 1:].reshape(-1),
                                                 reduction="sum")


class HiddenSegments:
    """The caching meter seen as if it had no segments: plans then bound allocated bytes."""

    def __init__(self, meter: xpm.CpuMeter) -> None:
        object.__setattr__(self, "_meter", meter)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._meter, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._meter, name, value)

    reserves_segments = False


@dataclass
class Run:
    """What one planned training run measured."""

    ooms: int = 0
    steps: int = 0
    microbatches: List[Tuple[int, float, float]] = field(default_factory=list)  # step, planned, measured
    usable_bytes: int = 0


def batch(generator: torch.Generator, dims: np.ndarray) -> torch.Tensor:
    return torch.randint(0, VOCABULARY, (int(dims[0]), int(dims[1])), generator=generator)


def fresh_model(meter: xpm.CpuMeter, capacity_bytes: int) -> Tuple[TokenModel, torch.optim.Optimizer]:
    """The token model and its optimizer from seed 0, built without a cap, then capped."""
    torch.manual_seed(0)
    meter.capacity_bytes = 0
    model = TokenModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    meter.empty_cache()
    meter.capacity_bytes = capacity_bytes
    return model, optimizer


def probed_model(meter: xpm.CpuMeter, capacity_bytes: int) -> Tuple[xpm.MemoryModel, int]:
    """The token model probed under the cap on reserved bytes: its memory model (allocated peaks
    fitted, the probes' reserved gap kept) and the budget's usable bytes."""
    model, optimizer = fresh_model(meter, capacity_bytes)
    generator = torch.Generator().manual_seed(1)
    budget = xpm.MemoryBudget(capacity_bytes, memory_fraction=MEMORY_FRACTION)
    try:
        outcome = xpm.probe(model, optimizer, lambda dims: model.loss_sum(batch(generator, np.array(dims))),
                            xpm.CostFormula("a*bs*l + b*bs + c", ["bs", "l"]), meter=meter, budget=budget,
                            variable_max=VARIABLE_MAX)
    finally:
        meter.capacity_bytes = 0
    assert outcome.planned_bytes == "reserved" and outcome.model.reserved_gap is not None
    # A step's first microbatch peaks below the optimizer step's floor at every probed shape (the
    # weights' and AdamW's bytes dwarf the activations): its phase is fitted all the same.
    assert "without_gradients" in outcome.model.phases
    print(f"\n{outcome.reserved_report}; reserved gap {outcome.model.reserved_gap}")
    return outcome.model, int(budget.usable_bytes)


def without_reserved_gap(model: xpm.MemoryModel) -> xpm.MemoryModel:
    """The same fit of allocated bytes, without the line to reserved bytes."""
    parsed = json.loads(model.to_json())
    del parsed["metadata"]["reserved_gap"]
    return xpm.MemoryModel.from_json(json.dumps(parsed))


def train(meter: xpm.CpuMeter, plan_meter: Any, memory_model: xpm.MemoryModel, capacity_bytes: int,
          usable_bytes: int) -> Run:
    """Trains the token model from seed 0 under ``capacity_bytes`` with ``memory_model``'s plans,
    calibrated by what ``plan_meter`` measures; stops at the first out-of-memory error."""
    model, optimizer = fresh_model(meter, capacity_bytes)
    generator = torch.Generator().manual_seed(1)
    run = Run(usable_bytes=usable_bytes)
    try:
        lengths = np.random.default_rng(2).integers(4, VARIABLE_MAX["l"] + 1, OUTER_BATCH * STEPS)
        records = np.stack([np.ones_like(lengths), lengths], axis=1)
        sampler = xpm.PredictiveBatchSampler(records, memory_model, usable_bytes, outer_batch_size=OUTER_BATCH,
                                             seed=3, drop_last=True)
        # Reserved peaks move by whole segments from step to step: lowered only once settled.
        assert sampler.calibration.lower_early == (memory_model.reserved_gap is None)
        before = meter.oom_count
        optimizer.zero_grad()
        for microbatch, weight, last in xpm.microbatch_loop(iter(sampler), sampler, meter=plan_meter, module=model):
            try:
                loss = model.loss_sum(batch(generator, microbatch.dims)) * (weight / OUTER_BATCH)
                loss.backward()
                del loss
                if last:
                    optimizer.step()
            except torch.OutOfMemoryError:
                run.ooms = meter.oom_count - before
                return run
            run.microbatches.append((microbatch.step, microbatch.predicted_bytes + microbatch.correction_bytes,
                                     float(meter.peak_reserved_bytes)))
            if last:
                optimizer.zero_grad()
                run.steps += 1
        run.ooms = meter.oom_count - before
        return run
    finally:
        meter.capacity_bytes = 0


def test_a_calibration_fed_reserved_peaks_lowers_only_once_settled(meter: xpm.CpuMeter) -> None:
    """Reserved peaks move by whole segments with what the cache kept: a calibration that records
    a caching meter's peak turns its early lowering off."""
    calibration = xpm.Calibration(10_000_000)
    assert calibration.lower_early
    xpm.meters.start_peak(meter)
    kept = torch.empty(1_000_000, dtype=torch.uint8)
    calibration.record_meter_peak(1_000_000, meter, "first")
    del kept
    assert not calibration.lower_early
    calibration.end_step(0)
    calibration.record_peak(2_000_000, 1_700_000, "first")  # 15 % over-predicted
    assert calibration.end_step(1) is None                   # not lowered after one step


def binding_capacity(meter: xpm.CpuMeter) -> int:
    """Weights and optimizer state, plus 40 % of what a step at the largest shape adds, in
    reserved bytes measured from an emptied cache."""
    torch.manual_seed(0)
    model = TokenModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.loss_sum(torch.zeros(1, 2, dtype=torch.long)).backward()
    optimizer.step()
    meter.empty_cache()
    static = meter.current_reserved_bytes
    xpm.meters.start_peak(meter)
    model.loss_sum(torch.zeros(VARIABLE_MAX["bs"], VARIABLE_MAX["l"], dtype=torch.long)).backward()
    peak = meter.peak_reserved_bytes
    del model, optimizer
    meter.empty_cache()
    return int(static + 0.4 * (peak - static))


def test_planning_reserved_bytes_never_runs_out_where_allocated_planning_does(meter: xpm.CpuMeter) -> None:
    capacity = binding_capacity(meter)
    memory_model, usable_bytes = probed_model(meter, capacity)
    reserved = train(meter, meter, memory_model, capacity, usable_bytes)
    assert reserved.ooms == 0 and reserved.steps == STEPS, reserved
    assert len(reserved.microbatches) >= 2 * STEPS, "the cap does not bind"
    errors = [(planned - measured) / measured for step, planned, measured in reserved.microbatches
              if step >= 2 and measured > reserved.usable_bytes / 2]
    highest = max(measured for _, _, measured in reserved.microbatches)
    print(f"\nreserved planning: {len(reserved.microbatches)} microbatches in {reserved.steps} steps, 0 out of memory, "
          f"highest reserved peak {highest / capacity:.2%} of the cap; from step 3 above half the budget planned "
          f"{min(errors):+.2%} to {max(errors):+.2%} of the measured reserved peak ({len(errors)} microbatches)")
    # Under-prediction is what runs out of memory: at most 1 % from the third step (the goal). The
    # over-prediction is reported: one line from allocated to reserved bytes for every phase and
    # shape covers the largest gap the probes and the window saw (whole 20 MiB segments here).
    assert errors and min(errors) >= -0.01, errors

    allocated = train(meter, HiddenSegments(meter), without_reserved_gap(memory_model), capacity, usable_bytes)
    print(f"allocated planning at the same cap: {allocated.ooms} out-of-memory error(s) after {allocated.steps} "
          f"step(s), {len(allocated.microbatches)} microbatches")
    assert allocated.ooms > 0, allocated
