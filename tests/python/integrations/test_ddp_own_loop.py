"""An own training loop under DistributedDataParallel, torchrun on 2 CPU processes (gloo): the
model wrapped before probing and probed in lockstep, the sampler's plans calibrated from the
training microbatches (ddp_own_loop_worker.py). Measured against every microbatch's real peak."""
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")

WORKER = pathlib.Path(__file__).with_name("ddp_own_loop_worker.py")
LAUNCH_VARIABLES = re.compile(r"RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|ROLE_RANK|MASTER_ADDR|"
                              r"MASTER_PORT|TORCHELASTIC_.*")


def test_ddp_probed_after_wrapping_and_calibrated_predicts_every_microbatch_from_step_3(tmp_path):
    script = pathlib.Path(sys.executable).parent / "torchrun"
    launcher = [str(script)] if script.exists() else [sys.executable, "-m", "torch.distributed.run"]
    env = {k: v for k, v in os.environ.items() if not LAUNCH_VARIABLES.fullmatch(k)}
    done = subprocess.run([*launcher, "--standalone", "--nproc-per-node", "2", str(WORKER), str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env=dict(env, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, f"torchrun exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-6000:]}"
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    models = [json.loads(r["model"]) for r in ranks]
    assert models[0]["coefficients"] == models[1]["coefficients"], "lockstep probing fitted different models"
    assert ranks[0]["log"] == ranks[1]["log"], "the ranks' calibrations disagree"
    assert [r["ooms"] for r in ranks] == [0, 0]
    for r in ranks:
        assert r["mismatch"] == (f"probe: the formula and options differ between the ranks (this is rank {r['rank']}): "
                                 "in lockstep every rank must give the same, or their probes' collectives would not "
                                 "match")
    for r in ranks:  # the wrapped model's buckets are in the probes; the plain one's named outside
        assert r["outside_wrapped"] == []
        assert [(p["kind"], p["bytes"]) for p in r["outside_plain"]] == [("gradient_buckets", r["gradient_bytes"])]
    raw, calibrated = [], []
    for r in ranks:
        for step, peak, predicted, correction in r["rows"]:
            if peak > r["floor_bytes"]:
                raw.append((predicted - peak) / peak)
                if step >= 2:  # from the third optimizer step on
                    calibrated.append((predicted + correction - peak) / peak)
    assert calibrated, "no microbatch above the floor from step 3 on"
    assert min(calibrated) > -0.01, f"under-predicted by {-100 * min(calibrated):.2f} %"
    assert max(calibrated) < 0.03, f"over-predicted by {100 * max(calibrated):.2f} %"
    step_s = sorted(s for r in ranks for s in r["step_s"])[len(ranks[0]["step_s"])]  # the median
    calibration_s = max(r["calibration_s"] for r in ranks)
    print(f"\nddp own loop: {ranks[0]['probes']} probes in {ranks[0]['probe_s']:.1f} s; raw {100 * min(raw):+.2f} % "
          f"to {100 * max(raw):+.2f} %; from step 3 calibrated {100 * min(calibrated):+.2f} % to "
          f"{100 * max(calibrated):+.2f} % over {len(calibrated)} microbatches; {ranks[0]['log']}; calibration "
          f"{1e3 * calibration_s:.2f} ms a step against a median step of {1e3 * step_s:.0f} ms; plain module: "
          f"{ranks[0]['outside_report']}")
