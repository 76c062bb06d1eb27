"""xpm-train workers under the agent store of the real torchrun (the installed torch's). With
the c10d rendezvous, torchrun's agent hosts the TCPStore at MASTER_ADDR:MASTER_PORT itself and
sets TORCHELASTIC_USE_AGENT_STORE=True, so every rank, rank 0 included, must connect to it as a
client (rank 0 binding that port fails). The agent keeps the store across restarts, with the
failed attempt's keys in it, so each attempt keeps its keys under /worker/attempt_<k>: here rank 1
exits at step 5 of attempt 0 and starts 3 s after rank 0 in attempt 1, when rank 0 would
otherwise find rank 1's keys of attempt 0 and wait for, or connect to, a process that is gone.
The job must give the parameters of `xpm-train --nproc 2`."""
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from run_files import digest

pytest.importorskip("torch.distributed.run")

BIN = pathlib.Path(os.environ.get("XPM_BIN_DIR", "build/bin"))
DATA = os.environ.get("XPM_DATA_DIR", "data/brown")
WORK = pathlib.Path(os.environ.get("XPM_WORK_DIR", "/tmp")) / "xpm_agent_store"
# Variables of an enclosing launcher or test hook that would leak into the runs started here.
LAUNCH_VARIABLES = re.compile(r"RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|ROLE_RANK|MASTER_ADDR|"
                              r"MASTER_PORT|TORCHELASTIC_.*|TORCH_DISABLE_SHARE_RDZV_TCP_STORE|XPM_FAULT_.*")
# torchrun --no-python runs this shell line on each rank: rank 1 of attempt 1 starts 3 s late.
LATE_RANK_1 = ('echo "attempt $TORCHELASTIC_RESTART_COUNT rank $RANK: agent store $TORCHELASTIC_USE_AGENT_STORE"; '
               'if [ "$TORCHELASTIC_RESTART_COUNT" = 1 ] && [ "$RANK" = 1 ]; then sleep 3; fi; exec "$0" "$@"')


def command(run_dir, *extra):
    return [str(BIN / "xpm-train"), "--data-dir", DATA, "--run-dir", str(run_dir), "--max-steps", "8",
            "--outer-batch-size", "16", "--threads", "1", "--memory-cap-factor", "2.0", "--dropout", "0",
            "--max-validation-sentences", "100", "--validate-every", "4", "--warmup-steps", "2",
            "--checkpoint-every-steps", "2", "--collective-timeout-s", "30", "--rendezvous-timeout-s", "60",
            "--memory-model-cache", str(WORK / "cache"), "--quiet", *extra]


def run(arguments, **env):
    base = {k: v for k, v in os.environ.items() if not LAUNCH_VARIABLES.fullmatch(k)}
    return subprocess.run(arguments, capture_output=True, text=True, timeout=300, env=dict(base, **env))


def torchrun(*args):
    """The installed torch's torchrun (its console script beside this interpreter, else the
    same entry point as ``python -m torch.distributed.run``) on 2 local ranks."""
    script = pathlib.Path(sys.executable).parent / "torchrun"
    launcher = [str(script)] if script.exists() else [sys.executable, "-m", "torch.distributed.run"]
    return [*launcher, "--standalone", "--nproc-per-node", "2", *args]


def test_every_rank_joins_the_agents_store_and_a_late_restarted_rank_trains_like_nproc_2(remove_when_passed):
    WORK.mkdir(parents=True, exist_ok=True)
    reference, restarted = remove_when_passed(WORK / "nproc2"), remove_when_passed(WORK / "torchrun")
    subprocess.run(["rm", "-rf", str(reference), str(restarted)], check=True)
    done = run(command(reference, "--nproc", "2"))
    assert done.returncode == 0, done.stderr
    done = run(torchrun("--max-restarts", "1", "--no-python", "sh", "-c", LATE_RANK_1, *command(restarted)),
               XPM_FAULT_EXIT_AT="1:5", OMP_NUM_THREADS="1")
    assert done.returncode == 0, done.stderr[-6000:]
    assert "exitcode: 17" in done.stderr, done.stderr[-3000:]  # torchrun saw rank 1 fail in attempt 0
    for attempt in (0, 1):
        for rank in (0, 1):
            assert f"attempt {attempt} rank {rank}: agent store True" in done.stdout, done.stdout
    summary = json.loads((restarted / "summary.json").read_text())
    print(f"\nunder torchrun's agent store: rank 1 exited at step 5, restarts {summary['restarts']}, "
          f"resumed from step {summary['resumed_from_step']} with rank 1 3 s late")
    assert summary["restarts"] == 1 and summary["resumed_from_step"] == 4 and summary["finished"] is True
    assert digest(restarted / "final_parameters.pt") == digest(reference / "final_parameters.pt")
