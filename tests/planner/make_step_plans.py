#!/usr/bin/env python3
"""Writes tests/planner/step_plans.json: the table of step plans that the C++ plan_step test
(tests/planner/step_plan_test.cpp) and the Python sampler test (tests/python/test_step_plans.py)
both check, so that the C++ data-parallel step and the Python sampler plan every step alike.

Each case: an outer batch's record lengths (dims [1, l]), a memory model, the packer, the
planning budget, the world size and lockstep; expected: each rank's share and microbatches
(indices into the outer batch), their dims and predicted bytes. The cases marked "phases" plan
with PHASE_MODEL, which has a floor and fits of the gradient phases (a step's first microbatch
without gradients held, FSDP2's synchronised last one): their expected plans are the sampler's
(gradients set to None between steps), and "phase_models" holds each phase as the model the C++
plan_step takes (StepPhaseModels). Run it only when the policy
changes on purpose, and read the diff:

    PYTHONPATH=build/python python tests/planner/make_step_plans.py > tests/planner/step_plans.json
"""
import json
import sys

import numpy as np

import xpm
from xpm import _planner

# A fitted model of the shape the bundled tagger has: a*bs*l + b*bs*l^2 + c.
FORMULA = xpm.CostFormula("a*bs*l + b*bs*l^2 + c", ["bs", "l"])
PROBES = np.array([[bs, l] for bs in (1, 2, 4, 8, 16) for l in (8, 32, 64, 128)], dtype=float)
MODEL, _ = xpm.fit(FORMULA, PROBES, 900 * PROBES[:, 0] * PROBES[:, 1] + 3 * PROBES[:, 0] * PROBES[:, 1] ** 2 + 1e6)
# The same fit with a floor (the optimizer step's peak) and fits of the phases, as xpm.probe
# records them: a first microbatch without gradients held 8 % lower, a synchronised last one 5 %.
def _phase_model():
    parsed = json.loads(MODEL.to_json())
    parsed["floor_bytes"] = 1.05e6
    model = xpm.MemoryModel.from_json(json.dumps(parsed))
    steady = [parsed["coefficients"][name] for name in model.formula.coefficient_names]
    model = model._with_phase("without_gradients", [0.92 * c for c in steady], 1.0, 0.01, 20)
    return model._with_phase("synchronised", [0.95 * c for c in steady], 1.0, 0.01, 20)


PHASE_MODEL = _phase_model()
LENGTHS = [37, 5, 120, 64, 64, 9, 88, 17, 3, 128, 45, 72, 30, 101, 12, 56]

CASES = [
    {"name": "one rank, adaptive", "lengths": LENGTHS, "packer": "adaptive", "planning_bytes": 2_500_000,
     "world_size": 1, "lockstep": False},
    {"name": "two ranks, adaptive", "lengths": LENGTHS, "packer": "adaptive", "planning_bytes": 2_500_000,
     "world_size": 2, "lockstep": False},
    {"name": "two ranks in lockstep: shares halved to one count", "lengths": LENGTHS, "packer": "ffd",
     "planning_bytes": 1_400_000, "world_size": 2, "lockstep": True},
    {"name": "three ranks in lockstep, tighter", "lengths": LENGTHS + [90, 2, 77], "packer": "adaptive",
     "planning_bytes": 1_250_000, "world_size": 3, "lockstep": True},
    {"name": "four ranks, three records, lockstep: empty microbatches", "lengths": [100, 7, 50], "packer": "adaptive",
     "planning_bytes": 2_000_000, "world_size": 4, "lockstep": True},
    {"name": "four ranks, five records, lockstep: one-record shares padded with empty microbatches",
     "lengths": [128, 120, 100, 110, 90], "packer": "adaptive", "planning_bytes": 1_200_000, "world_size": 4,
     "lockstep": True},
    {"name": "a record over the budget alone", "lengths": [128, 20, 30, 10], "packer": "uniform",
     "planning_bytes": 1_150_000, "world_size": 2, "lockstep": False},
    {"name": "phases: two ranks in lockstep, first microbatches without gradients, last ones synchronised",
     "lengths": LENGTHS, "packer": "ffd", "planning_bytes": 1_450_000, "world_size": 2, "lockstep": True,
     "phases": True},
    {"name": "phases: one microbatch per rank, the larger of its two phases", "lengths": [128, 120, 110, 100],
     "packer": "adaptive", "planning_bytes": 2_500_000, "world_size": 2, "lockstep": False, "phases": True},
]


def expected_with_phases(case):
    """Each rank's step as the sampler plans it with PHASE_MODEL."""
    dims = np.array([[1.0, float(l)] for l in case["lengths"]])
    ranks = []
    for rank in range(case["world_size"]):
        sampler = xpm.PredictiveBatchSampler(dims, PHASE_MODEL, case["planning_bytes"], outer_batch_size=len(dims),
                                             rank=rank, world_size=case["world_size"], shuffle=False,
                                             packer=case["packer"], lockstep=case["lockstep"], calibrate=False)
        step = next(iter(sampler.steps()))
        microbatches = [[int(i) for i in mb] for mb in step.microbatches]
        ranks.append({"share": sorted(i for mb in microbatches for i in mb), "microbatches": microbatches,
                      "dims": [row.tolist() for row in step.dims], "predicted_bytes": list(step.predicted_bytes),
                      "over_budget": [False] * len(microbatches)})
    return ranks


def expected(case):
    if case.get("phases"):
        return expected_with_phases(case)
    dims = np.array([[1.0, float(l)] for l in case["lengths"]])
    shares, plans = _planner.plan_step(case["packer"], "l", dims, MODEL._native, case["planning_bytes"],
                                       case["world_size"], case["lockstep"], -1)
    ranks = []
    for share, plan in zip(shares, plans):
        plan = xpm.planning.Plan(*plan)
        ranks.append({"share": [int(i) for i in share],
                      "microbatches": [[int(i) for i in mb] for mb in plan.microbatches],
                      "dims": plan.dims.tolist(), "predicted_bytes": plan.predicted_bytes.tolist(),
                      "over_budget": [bool(b) for b in plan.over_budget]})
    return ranks


def main():
    phase_models = {"first_of_several": PHASE_MODEL._phase_native("without_gradients", floor=False),
                    "first_alone": PHASE_MODEL._phase_native("without_gradients"),
                    "synchronised": PHASE_MODEL._phase_native("synchronised")}
    table = {"model": json.loads(MODEL.to_json()), "phase_model": json.loads(PHASE_MODEL.to_json()),
             "phase_models": {name: json.loads(native.to_json()) for name, native in phase_models.items()},
             "cases": [dict(case, ranks=expected(case)) for case in CASES]}
    json.dump(table, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
