"""xpm-train --nproc N --max-restarts K restarts every rank from the newest valid checkpoint when
a rank fails (as torchrun --max-restarts does): each restart is logged and counted in
summary.json, and the final parameters equal those of an uninterrupted run. Bad input and a
stop by a signal are not restarted; a fault that comes back every attempt gives up after K."""
import json
import os
import pathlib
import subprocess

import pytest

from run_files import digest

BIN = pathlib.Path(os.environ.get("XPM_BIN_DIR", "build/bin"))
DATA = os.environ.get("XPM_DATA_DIR", "data/brown")
WORK = pathlib.Path(os.environ.get("XPM_WORK_DIR", "/tmp")) / "xpm_restarts"
STEPS = 8


def command(run_dir, *extra):
    return [str(BIN / "xpm-train"), "--data-dir", DATA, "--run-dir", str(run_dir), "--max-steps", str(STEPS),
            "--outer-batch-size", "16", "--threads", "1", "--memory-cap-factor", "2.0", "--dropout", "0",
            "--max-validation-sentences", "100", "--validate-every", "4", "--warmup-steps", "2",
            "--checkpoint-every-steps", "2", "--collective-timeout-s", "20",
            "--memory-model-cache", str(WORK / "cache"), "--quiet", *extra]


def run(run_dir, *extra, env=None):
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    return subprocess.run(command(run_dir, *extra), capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, **(env or {})))


def summary_of(run_dir):
    return json.loads((pathlib.Path(run_dir) / "summary.json").read_text())


@pytest.fixture(scope="module")
def uninterrupted(remove_when_module_passed):
    WORK.mkdir(parents=True, exist_ok=True)
    whole = remove_when_module_passed(WORK / "whole")
    done = run(whole, "--nproc", "2")
    assert done.returncode == 0, done.stderr
    assert summary_of(whole)["restarts"] == 0
    return digest(whole / "final_parameters.pt")


@pytest.mark.parametrize("fault", ["1:5", "0:6:kill"])
def test_a_failed_rank_restarts_the_group_from_the_newest_checkpoint(uninterrupted, fault, remove_when_passed):
    run_dir = remove_when_passed(WORK / f"restart-{fault.replace(':', '-')}")
    done = run(run_dir, "--nproc", "2", "--max-restarts", "2", env={"XPM_FAULT_EXIT_AT": fault})
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("restarting all 2 ranks from the newest checkpoint (restart 1 of 2)") == 1, done.stderr
    summary = summary_of(run_dir)
    print(f"fault {fault}: {summary['restarts']} restart, resumed from step {summary['resumed_from_step']}")
    assert summary["restarts"] == 1 and summary["finished"] is True
    assert summary["resumed_from_step"] == 4  # the checkpoint before the failed step
    assert digest(run_dir / "final_parameters.pt") == uninterrupted


def test_a_fault_in_every_attempt_gives_up_after_max_restarts(remove_when_passed):
    done = run(remove_when_passed(WORK / "exhausted"), "--nproc", "2", "--max-restarts", "1",
               env={"XPM_FAULT_EXIT_AT": "1:3", "XPM_FAULT_ATTEMPTS": "9"})
    assert done.returncode == 17, done.stderr
    assert done.stderr.count("restarting all 2 ranks") == 1, done.stderr
    assert "giving up after 1 restart (--max-restarts 1)" in done.stderr


def test_bad_input_is_not_restarted(remove_when_passed):
    done = run(remove_when_passed(WORK / "bad"), "--nproc", "2", "--max-restarts", "3",
               env={"XPM_FAULT_EXIT_AT": "1:x"})
    assert done.returncode == 2, done.stderr
    assert "restarting" not in done.stderr
    assert "XPM_FAULT_EXIT_AT='1:x'" in done.stderr


def test_max_restarts_is_checked(remove_when_passed):
    done = run(remove_when_passed(WORK / "negative"), "--max-restarts", "-1")
    assert done.returncode == 2 and "--max-restarts must be >= 0, got -1" in done.stderr, done.stderr
    # A worker of another launcher is restarted by it: torchrun's own --max-restarts.
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "29599"}
    done = run(remove_when_passed(WORK / "foreign"), "--max-restarts", "2", env=env)
    assert done.returncode == 2 and "torchrun --max-restarts" in done.stderr, done.stderr
    done = run(WORK / "foreign", "--max-restarts", "2", env=dict(env, TORCHELASTIC_MAX_RESTARTS="1"))
    assert done.returncode == 2 and "disagrees with TORCHELASTIC_MAX_RESTARTS=1" in done.stderr, done.stderr
