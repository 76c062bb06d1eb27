"""The shared table of step plans (tests/planner/step_plans.json, written by
tests/planner/make_step_plans.py): the Python sampler plans each step as the C++ plan_step does
(tests/planner/step_plan_test.cpp checks the same table), so the sampler and the C++
data-parallel step give the same shares and microbatches, and predict the gradient phases alike."""
import json
import pathlib

import numpy as np
import pytest

import xpm

TABLE = json.loads((pathlib.Path(__file__).resolve().parents[1] / "planner" / "step_plans.json").read_text())


@pytest.mark.parametrize("case", TABLE["cases"], ids=[c["name"] for c in TABLE["cases"]])
def test_the_sampler_plans_each_rank_as_the_shared_table_says(case):
    model = xpm.MemoryModel.from_json(json.dumps(TABLE["phase_model" if case.get("phases") else "model"]))
    dims = np.array([[1.0, float(length)] for length in case["lengths"]])
    for rank, expected in enumerate(case["ranks"]):
        sampler = xpm.PredictiveBatchSampler(dims, model, case["planning_bytes"], outer_batch_size=len(dims),
                                             rank=rank, world_size=case["world_size"], shuffle=False,
                                             packer=case["packer"], lockstep=case["lockstep"], calibrate=False)
        step = next(iter(sampler.steps()))
        planned = [[int(i) for i in mb] for mb in step.microbatches]
        assert planned == (expected["microbatches"] or [[]]), f"rank {rank}"
        assert sorted(i for mb in planned for i in mb) == expected["share"]
        if expected["microbatches"]:
            np.testing.assert_array_equal(np.array(step.dims), np.array(expected["dims"]))
            np.testing.assert_allclose(step.predicted_bytes, expected["predicted_bytes"], rtol=1e-12)
