"""A signal stops xpm-train gracefully: every rank finishes its step, the ranks agree through the
step's status, a checkpoint and summary.json ("interrupted": true) are written, the exit code is
4, and --resume ends with the parameters of an uninterrupted run. A second signal ends the
process at once. World 1 and 2; the signal to rank 0 only, rank 1 only, and to both."""
import json
import os
import pathlib
import signal
import subprocess
import time

import pytest

from run_files import digest, steps_written

BIN = pathlib.Path(os.environ.get("XPM_BIN_DIR", "build/bin"))
DATA = os.environ.get("XPM_DATA_DIR", "data/brown")
WORK = pathlib.Path(os.environ.get("XPM_WORK_DIR", "/tmp")) / "xpm_graceful_stop"
STEPS = 8


def command(run_dir, *extra, steps=STEPS, outer_batch_size=16):
    return [str(BIN / "xpm-train"), "--data-dir", DATA, "--run-dir", str(run_dir), "--max-steps", str(steps),
            "--outer-batch-size", str(outer_batch_size), "--threads", "1", "--memory-cap-factor", "2.0", "--dropout", "0",
            "--max-validation-sentences", "100", "--validate-every", "4", "--warmup-steps", "2",
            "--memory-model-cache", str(WORK / "cache"), "--quiet", *extra]


def run(run_dir, *extra):
    done = subprocess.run(command(run_dir, *extra), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done


def workers_of(launcher):
    """Rank -> pid of the launcher's children."""
    ranks = {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) != launcher.pid:
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        for item in environ:
            if item.startswith(b"RANK="):
                ranks[int(item[5:])] = int(entry.name)
    return ranks


def interrupt(run_dir, nproc, targets, sig, after_steps=3):
    """Starts a run, sends `sig` to `targets` ("launcher" or ranks) after `after_steps` steps;
    returns (exit code, stderr, seconds from the signal to the exit)."""
    process = subprocess.Popen(command(run_dir, "--nproc", str(nproc)), stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while steps_written(run_dir) < after_steps:
        assert process.poll() is None, process.stderr.read()
        assert time.monotonic() < deadline, "the run did not reach its first steps"
        time.sleep(0.05)
    pids = [process.pid] if targets == "launcher" else [workers_of(process)[rank] for rank in targets]
    sent = time.monotonic()
    for pid in pids:
        os.kill(pid, sig)
    _, err = process.communicate(timeout=240)
    return process.returncode, err, time.monotonic() - sent


@pytest.fixture(scope="module")
def uninterrupted(remove_when_module_passed):
    WORK.mkdir(parents=True, exist_ok=True)
    a1, a2 = remove_when_module_passed(WORK / "a1"), remove_when_module_passed(WORK / "a2")
    subprocess.run(["rm", "-rf", str(a1), str(a2)], check=True)
    run(a1)
    run(a2, "--nproc", "2")
    return {1: digest(a1 / "final_parameters.pt"), 2: digest(a2 / "final_parameters.pt")}


def check_interrupted(run_dir, code, err):
    assert code == 4, err
    summary = json.loads((pathlib.Path(run_dir) / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["finished"] is False
    step = summary["train_steps"]
    assert 3 <= step < STEPS
    assert (pathlib.Path(run_dir) / "checkpoints" / f"step-{step:08d}").is_dir()
    assert not (pathlib.Path(run_dir) / "final_parameters.pt").exists()
    return summary


@pytest.mark.parametrize("nproc, targets, sig, resume", [
    (1, "launcher", signal.SIGTERM, True),   # world 1: the process itself
    (2, [1], signal.SIGTERM, True),          # rank 1 only
    (2, [0], signal.SIGUSR1, False),         # rank 0 only, the preemption signal
    (2, "launcher", signal.SIGINT, False),   # both: the launcher passes it to every rank
])
def test_a_signal_stops_every_rank_at_one_step_with_a_checkpoint(uninterrupted, nproc, targets, sig, resume,
                                                                 remove_when_passed):
    run_dir = WORK / f"stop-{nproc}-{targets if isinstance(targets, str) else '-'.join(map(str, targets))}-{sig.name}"
    remove_when_passed(run_dir)
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    code, err, exit_s = interrupt(run_dir, nproc, targets, sig)
    summary = check_interrupted(run_dir, code, err)
    print(f"world {nproc}, {sig.name} to {targets}: stopped after step {summary['train_steps']}, "
          f"exit {exit_s:.2f} s after the signal")
    if nproc == 2:
        assert summary["stop_signal"] == ("another rank's" if targets == [1] else sig.name)
        assert err.count(f"stopped after a signal") == 2, err  # both ranks, the same way
    if resume:
        run(run_dir, "--nproc", str(nproc), "--resume")
        assert digest(run_dir / "final_parameters.pt") == uninterrupted[nproc]


def test_a_second_signal_ends_the_process_at_once(remove_when_passed):
    run_dir = remove_when_passed(WORK / "twice")
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    # Outer batches of 4,096 sentences under the cap: a step takes seconds, so the second signal
    # (1.2 s after the first, past the 1 s in which a repeat counts as the same delivery) comes
    # while the step the first one let finish is still running.
    process = subprocess.Popen(command(run_dir, steps=40, outer_batch_size=4096), stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    while steps_written(run_dir) < 1:
        assert process.poll() is None, process.stderr.read()
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    time.sleep(1.2)
    assert process.poll() is None, "the step in progress ended within 1.2 s: the test needs longer steps"
    process.send_signal(signal.SIGTERM)
    process.communicate(timeout=60)
    assert process.returncode == -signal.SIGTERM
