"""FSDP2 (``torch.distributed.fsdp.fully_shard``) planned by xpm, on 2 CPU ranks (gloo) under
torchrun: lockstep probing on every rank and the lockstep batch sampler (fsdp2_worker.py).

- ``xpm.probe(..., lockstep=True)``: both ranks run the same probes and fit the same model
  (coefficients, floor, ranges: the JSON but for the timing metadata); the held-out shapes,
  measured in lockstep too, are never under-predicted by more than 1 % or the fit's own error;
  without ``lockstep`` the sharded model is refused in one line on every rank.
- the same with FSDP2's collectives settled (``SettledGlooCollective`` in fsdp2_worker.py: each
  returns once gloo has let go of its tensors, so a microbatch peaks alike every time): the fit
  and the held-out shapes within 1 %; calibrated training from the third step on within -1 % /
  +3 % of every microbatch's peak. Without it, gloo frees a collective's buffers a moment after
  the collective ends, at a time of its own, and the same microbatch peaks up to one layer's
  gathered parameters apart: those runs are held to the noise, not to the 1 %.
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
    # Probed without lockstep, each rank's design could go its own way: refused in one line.
    for rank in ranks:
        assert rank["refusal_without_lockstep"] == (
            "probe: an FSDP-sharded model gathers its parameters from all 2 ranks in every forward and backward, so "
            "each rank's probes must run with the others': call probe on every rank with lockstep=True")
    errors = ranks[0]["held_out_rel_errors"]
    fit_error = ranks[0]["model"]["metadata"]["fit"]["max_rel_error"]
    print(f"\nFSDP2 at world 2: {ranks[0]['probes']} probes in {ranks[0]['probe_s']:.2f} s, floor "
          f"{ranks[0]['floor_bytes']:.0f} bytes, local parameters {ranks[0]['local_parameter_bytes']} bytes per rank, "
          f"fit max error {100 * fit_error:.2f} %, held-out errors {', '.join(f'{100 * e:+.2f} %' for e in errors)}")
    # Shapes not probed, measured with the optimizer's state as training has it, are predicted
    # within the fit's error at its probes or gloo's noise: a collective's buffers freed late
    # leave at most the model's gathered parameters (920,576 bytes) allocated at a peak, 5 % of
    # a small shape here. The settled test below holds them to 1 %.
    noise = [ranks[0]["gathered_parameter_bytes"] / measured for measured in ranks[0]["held_out_peak_bytes"]]
    assert all(e > -max(0.01, fit_error, n) for e, n in zip(errors, noise)), \
        f"a held-out shape was under-predicted: {errors}"


# What fsdp2_worker.SettledGlooCollective uses: FSDP2's custom collectives, storages' use counts.
settled = pytest.mark.skipif(
    not hasattr(torch.distributed.fsdp.FSDPModule, "set_custom_all_gather") or
    not hasattr(torch._C, "_storage_Use_Count"),
    reason=f"torch {torch.__version__}: no FSDP2 custom collectives to settle")


@settled
def test_with_settled_collectives_the_fit_and_held_out_shapes_are_within_1_percent(tmp_path):
    ranks = run_ranks("probe-settled", tmp_path)
    assert without_timing(ranks[0]["model"]) == without_timing(ranks[1]["model"])
    errors = ranks[0]["held_out_rel_errors"]
    fit_error = ranks[0]["model"]["metadata"]["fit"]["max_rel_error"]
    print(f"\nFSDP2 settled at world 2: {ranks[0]['probes']} probes, fit max error {100 * fit_error:.2f} %, "
          f"held-out errors {', '.join(f'{100 * e:+.2f} %' for e in errors)}")
    assert fit_error < 0.01
    assert all(-0.01 <= e <= 0.01 for e in errors), errors


@settled
def test_with_settled_collectives_every_microbatch_is_planned_within_1_and_3_percent(tmp_path):
    """The calibrated epoch below with the collectives settled: from the third step on, no
    microbatch peaks more than 1 % above its plan nor 3 % below it. The first step runs without
    the optimizer's state, which the plans include (over, never under)."""
    ranks = run_ranks("calibrated-settled", tmp_path)
    assert [r["ooms"] for r in ranks] == [0, 0] and ranks[0]["log"] == ranks[1]["log"]
    later = [(predicted + correction - peak) / peak for r in ranks
             for step, peak, predicted, correction, _ in r["rows"] if step >= 2]
    first = [(predicted - peak) / peak for r in ranks for step, peak, predicted, _, _ in r["rows"] if step == 0]
    print(f"\nFSDP2 settled, calibrated at world 2: first step {100 * min(first):+.2f} % to {100 * max(first):+.2f} %; "
          f"from step 3, {len(later)} microbatches {100 * min(later):+.2f} % to {100 * max(later):+.2f} %; "
          f"{ranks[0]['log']}")
    assert len(later) >= 8
    assert all(-0.01 <= e <= 0.03 for e in later), [f"{100 * e:+.2f} %" for e in later]


def test_calibrated_from_training_no_microbatch_is_under_planned(tmp_path):
    """An epoch of 8 steps through microbatch_loop(meter=...), gradients set to None between
    steps, with gloo's collectives as they come: the sampler predicts each microbatch's phase
    (the first without gradients, the last synchronised); the calibration agrees the same
    corrections on both ranks, 0 OOM, and from the third step on no microbatch peaks above its
    plan by more than 1 % of the budget, the fit's own error at its probes or, where more, the
    model's gathered parameters: gloo frees a collective's buffers a moment after it ends, at a
    time of its own, so one shape peaks up to that far apart between microbatches (one noisy
    peak can raise the calibration's correction by several per cent). The settled test above
    measures the same epoch without that noise, to the 1 %."""
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
    fit_error, noise_bytes = ranks[0]["fit_max_rel_error"], ranks[0]["gathered_parameter_bytes"]
    under = [(planned - peak, max(0.01 * usable, fit_error * peak, noise_bytes)) for peak, planned, _ in later]
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
