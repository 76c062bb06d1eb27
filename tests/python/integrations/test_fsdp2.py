"""FSDP2 (``torch.distributed.fsdp.fully_shard``) planned by xpm, on 2 CPU ranks (gloo) under
torchrun: lockstep probing on every rank and the lockstep batch sampler (fsdp2_worker.py).

- ``xpm.probe(..., lockstep=True)``: both ranks run the same probes and fit the same model
  (coefficients, floor, ranges: the JSON but for the timing metadata); the held-out shapes,
  measured in lockstep too, are never under-predicted by more than 1 %.
- ``PredictiveBatchSampler(lockstep=True)`` with ``set_requires_gradient_sync(False)`` on all
  but each step's last microbatch: both ranks run the same number of microbatches (no
  deadlock by construction), 0 out-of-memory errors under the cap, and the accumulated,
  reduce-scattered gradient equals the unsharded gradient of the whole outer batch to 1e-5.
- a sharded checkpoint (``torch.distributed.checkpoint``: model and optimizer) with the sampler's
  ``state_dict`` beside it, loaded into fresh objects, ends 2 more steps with the parameters of
  an uninterrupted 4-step run, exactly;
- an out-of-memory error on rank 1 inside ``xpm.stop_together()`` stops both ranks within
  seconds, rank 0 with rank 1's message.
"""
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.fsdp")
if not hasattr(torch.distributed.fsdp, "fully_shard"):
    pytest.skip(f"torch {torch.__version__} has no torch.distributed.fsdp.fully_shard (FSDP2)", allow_module_level=True)

WORKER = pathlib.Path(__file__).with_name("fsdp2_worker.py")
# Variables of an enclosing launcher that would leak into the runs started here.
LAUNCH_VARIABLES = re.compile(r"RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|ROLE_RANK|MASTER_ADDR|"
                              r"MASTER_PORT|TORCHELASTIC_.*")


def run_ranks(mode, out, expected_exit_code=0):
    script = pathlib.Path(sys.executable).parent / "torchrun"
    launcher = [str(script)] if script.exists() else [sys.executable, "-m", "torch.distributed.run"]
    env = {k: v for k, v in os.environ.items() if not LAUNCH_VARIABLES.fullmatch(k)}
    # A rank that fails ends with exit code 1 and torchrun then ends the others: checking its
    # workers every 2 s (not every 0.1 s) leaves the others the time to write their result.
    monitor = ["--monitor-interval", "2"] if expected_exit_code else []
    done = subprocess.run([*launcher, "--standalone", "--nproc-per-node", "2", *monitor, str(WORKER), mode, str(out)],
                          capture_output=True, text=True, timeout=600, env=dict(env, OMP_NUM_THREADS="1"))
    assert done.returncode == expected_exit_code, (f"{mode}: exit code {done.returncode}\n{done.stdout[-3000:]}\n"
                                                   f"{done.stderr[-6000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def without_timing(model):
    model = dict(model)
    model.pop("metadata")
    return model


def test_lockstep_probing_fits_the_same_model_on_every_rank(tmp_path):
    ranks = run_ranks("probe", tmp_path)
    assert without_timing(ranks[0]["model"]) == without_timing(ranks[1]["model"])
    assert ranks[0]["probes"] == ranks[1]["probes"] > 0
    assert ranks[0]["local_parameter_bytes"] == ranks[1]["local_parameter_bytes"]
    errors = ranks[0]["held_out_rel_errors"]
    fit_error = ranks[0]["model"]["metadata"]["fit"]["max_rel_error"]
    print(f"\nFSDP2 at world 2: {ranks[0]['probes']} probes in {ranks[0]['probe_s']:.2f} s, floor "
          f"{ranks[0]['floor_bytes']:.0f} bytes, local parameters {ranks[0]['local_parameter_bytes']} bytes per rank, "
          f"fit max error {100 * fit_error:.2f} %, held-out errors {', '.join(f'{100 * e:+.2f} %' for e in errors)}")
    # Shapes not probed, measured with the optimizer's state as training has it, are predicted
    # within the fit's own error at its probes (this tagger's small shapes vary by up to 6 %
    # between runs); the training's microbatches are held closer by the calibration (below).
    assert min(errors) > -max(0.01, fit_error), f"a held-out shape was under-predicted: {errors}"


def test_calibrated_from_training_no_microbatch_is_under_planned(tmp_path):
    """An epoch of 8 steps through microbatch_loop(meter=...), gradients set to None between
    steps: the probe fitted the first microbatch's phase (no gradient, no unsharded gradient
    held); the calibration agrees the same corrections on both ranks, 0 OOM, and from the third
    step on no microbatch peaks above what its plan fits by more than 1 % of the budget or, where
    more, the fit's own error at its probes: this tagger's peaks at one shape vary by up to 6 %
    between runs (gloo's collectives on the CPU free their buffers when their threads get to it),
    so a shape not seen yet can peak that far above a model fitted to another run's probes, and
    the calibration corrects the steps after it. The over-planning is printed, not asserted: the
    microbatches over half the budget (those it binds) measured +0.01 % to +1.75 % above their
    peaks in unloaded runs, up to +4.5 % with both cores loaded (a small microbatch's noise raised
    the correction); the small ones, each step's last here, predicted by the probe's
    "synchronised" phase, -5.8 % to +17 % before calibration in four runs (the same shape peaks
    one layer's unsharded parameters apart between runs on this CPU)."""
    ranks = run_ranks("calibrated", tmp_path)
    assert [r["ooms"] for r in ranks] == [0, 0] and ranks[0]["log"] == ranks[1]["log"]
    assert ranks[0]["phases"] == ["with_gradients", "without_gradients", "synchronised"]
    usable = ranks[0]["usable_bytes"]
    later = [(peak, predicted + correction, last) for r in ranks for step, peak, predicted, correction, last in r["rows"]
             if step >= 2]
    large = [(planned - peak) / peak for peak, planned, _ in later if peak > usable / 2]
    small = [(planned - peak) / peak for peak, planned, _ in later if peak <= usable / 2]
    raw = [(predicted - peak) / peak for r in ranks for _, peak, predicted, _, _ in r["rows"]]
    print(f"\nFSDP2 calibrated at world 2: raw {100 * min(raw):+.2f} % to {100 * max(raw):+.2f} %; from step 3, "
          f"{len(large)} microbatches over half the budget {100 * min(large):+.2f} % to {100 * max(large):+.2f} %, "
          f"{len(small)} others {100 * min(small, default=0):+.2f} % to {100 * max(small, default=0):+.2f} %; "
          f"fit max error {100 * ranks[0]['fit_max_rel_error']:.2f} %; {ranks[0]['log']}")
    assert len(large) >= 8
    fit_error = ranks[0]["fit_max_rel_error"]
    under = [(planned - peak, max(0.01 * usable, fit_error * peak)) for peak, planned, _ in later]
    assert all(gap > -allowed for gap, allowed in under), \
        f"under-planned: {[(round(g), round(a)) for g, a in under if g <= -a]} (fit max error {100 * fit_error:.2f} %)"


def test_the_lockstep_sampler_trains_fsdp2_without_oom_and_accumulates_exactly(tmp_path):
    ranks = run_ranks("train", tmp_path)
    print(f"\nFSDP2 training at world 2: microbatches per step {ranks[0]['microbatches_per_step']}, worst "
          f"under-prediction {100 * min(r['worst_under'] for r in ranks):.2f} %, gradient max abs error "
          f"{ranks[0]['gradient_max_abs_error']:.2e}")
    assert ranks[0]["microbatches_per_step"] == ranks[1]["microbatches_per_step"]
    assert max(ranks[0]["microbatches_per_step"]) > 1
    assert ranks[0]["ooms"] == ranks[1]["ooms"] == 0
    assert ranks[0]["gradient_max_abs_error"] <= 1e-5


def test_a_sharded_checkpoint_with_the_samplers_state_resumes_exactly(tmp_path):
    ranks = run_ranks("resume", tmp_path)
    print(f"\nFSDP2 resume at world 2: largest parameter difference to the uninterrupted run "
          f"{ranks[0]['max_parameter_difference']:g} (training moved them by up to {ranks[0]['parameters_moved_by']:.3g})")
    for rank in ranks:
        assert rank["parameters_moved_by"] > 1e-3
        assert rank["max_parameter_difference"] == 0.0


def test_an_out_of_memory_error_on_one_rank_stops_both_with_its_message(tmp_path):
    ranks = run_ranks("oom", tmp_path, expected_exit_code=1)
    print(f"\nFSDP2 forced OOM on rank 1: rank 0 stopped after {ranks[0]['stopped_after_s']:.2f} s with: "
          f"{ranks[0]['error'][:120]}")
    assert ranks[1]["error"].startswith("OutOfMemoryError: CPU memory cap exceeded")
    assert ranks[0]["error"] == "RuntimeError: rank 1 failed: " + ranks[1]["error"]
    assert ranks[0]["stopped_after_s"] < 60
