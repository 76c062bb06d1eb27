"""Workers under torchrun's agent store: torchrun's agent hosts the TCPStore at
MASTER_ADDR:MASTER_PORT itself and sets TORCHELASTIC_USE_AGENT_STORE=True, so every rank,
rank 0 included, must connect to it as a client, with each attempt's keys under
/worker/attempt_<k>. Here the agent is stood in for by a TCPStore of PyTorch's Python API
(Debian's torchrun itself does not start under Python 3.11); the job must give the parameters
of `--nproc 2`, and a second attempt on the same store must not see the first one's keys."""
import os
import pathlib
import socket
import subprocess
from datetime import timedelta

import pytest

from run_files import digest

torch_distributed = pytest.importorskip("torch.distributed")

BIN = pathlib.Path(os.environ.get("XPM_BIN_DIR", "build/bin"))
DATA = os.environ.get("XPM_DATA_DIR", "data/brown")
WORK = pathlib.Path(os.environ.get("XPM_WORK_DIR", "/tmp")) / "xpm_agent_store"


def command(run_dir, *extra):
    return [str(BIN / "xpm-train"), "--data-dir", DATA, "--run-dir", str(run_dir), "--max-steps", "6",
            "--outer-batch-size", "16", "--threads", "1", "--memory-cap-factor", "2.0", "--dropout", "0",
            "--max-validation-sentences", "100", "--validate-every", "3", "--warmup-steps", "2",
            "--collective-timeout-s", "30", "--rendezvous-timeout-s", "60",
            "--memory-model-cache", str(WORK / "cache"), "--quiet", *extra]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_under_agent_store(run_dir, port, attempt):
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    processes = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
                   TORCHELASTIC_RESTART_COUNT=str(attempt), TORCHELASTIC_MAX_RESTARTS="3")
        processes.append(subprocess.Popen(command(run_dir), env=env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE, text=True))
    results = [(p.wait(timeout=300), p.stderr.read()) for p in processes]
    assert [code for code, _ in results] == [0, 0], [err for _, err in results]


def test_every_rank_joins_the_agents_store_and_trains_like_nproc_2():
    WORK.mkdir(parents=True, exist_ok=True)
    reference = WORK / "nproc2"
    subprocess.run(["rm", "-rf", str(reference)], check=True)
    done = subprocess.run(command(reference, "--nproc", "2"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    port = free_port()
    agent = torch_distributed.TCPStore("127.0.0.1", port, 1, True, timedelta(seconds=60), wait_for_workers=False)
    for attempt in (0, 1):  # the second attempt finds the first one's keys in the store
        run_dir = WORK / f"attempt-{attempt}"
        run_under_agent_store(run_dir, port, attempt)
        assert digest(run_dir / "final_parameters.pt") == digest(reference / "final_parameters.pt")
    agent.set_timeout(timedelta(seconds=5))  # each attempt shared under its own prefix (get raises if not)
    for attempt in (0, 1):
        agent.get(f"/worker/attempt_{attempt}/xpm/share/0")
