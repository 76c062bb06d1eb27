#!/usr/bin/env python3
"""Writes tests/planner/step_plans.json: the table of step plans that the C++ plan_step test
(tests/planner/step_plan_test.cpp) and the Python sampler test (tests/python/test_step_plans.py)
both check, so that the C++ data-parallel step and the Python sampler plan every step alike.

Each case: an outer batch's record lengths (dims [1, l]), a memory model, the packer, the
planning budget, the world size and lockstep; expected: each rank's share and microbatches
(indices into the outer batch), their dims and predicted bytes. Run it only when the policy
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
]


def expected(case):
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
    table = {"model": json.loads(MODEL.to_json()),
             "cases": [dict(case, ranks=expected(case)) for case in CASES]}
    json.dump(table, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
