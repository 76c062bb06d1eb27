"""torchrun, PyTorch's own launcher from the installed torch, starting 2 ranks on CPU (gloo):

- examples/python_char_transformer/train.py under DistributedDataParallel trains on both ranks
  with 0 OOM; with ``--max-restarts 1`` and rank 1 killed by SIGKILL at step 5 (the example's
  ``XPM_FAULT_EXIT_AT`` hook, first attempt only), torchrun restarts both ranks, they resume from
  the step-4 checkpoint, and the final parameters equal the uninterrupted run's (torch.equal);
- a restarted attempt whose ranks start far apart still connects (torchrun's agent keeps its
  store, and the first attempt's keys, across restarts);
- ``torchrun --no-python xpm-train`` trains to the parameters of ``xpm-train --nproc 2``, also
  when rank 1 exits at step 5 of the first attempt under ``--max-restarts 1``.
"""
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

REPO = pathlib.Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "python_char_transformer" / "train.py"
BIN = pathlib.Path(os.environ.get("XPM_BIN_DIR", REPO / "build" / "bin"))
DATA = os.environ.get("XPM_DATA_DIR", str(REPO / "data" / "brown"))
STEPS, CHECKPOINT_EVERY, FAULT_STEP = 6, 2, 5
# Variables of an enclosing launcher or test hook that would leak into the runs started here.
LAUNCH_VARIABLES = re.compile(r"RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|ROLE_RANK|MASTER_ADDR|"
                              r"MASTER_PORT|TORCHELASTIC_.*|TORCH_DISABLE_SHARE_RDZV_TCP_STORE|XPM_FAULT_.*")


def torchrun(*args):
    """The installed torch's torchrun (its console script beside this interpreter, else the
    same entry point as ``python -m torch.distributed.run``) on 2 local ranks."""
    script = pathlib.Path(sys.executable).parent / "torchrun"
    launcher = [str(script)] if script.exists() else [sys.executable, "-m", "torch.distributed.run"]
    return [*launcher, "--standalone", "--nproc-per-node", "2", *args]


def launch(command, **env):
    base = {k: v for k, v in os.environ.items() if not LAUNCH_VARIABLES.fullmatch(k)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=240,
                          env=dict(base, OMP_NUM_THREADS="1", **env))
    assert done.returncode == 0, f"{' '.join(command)} exited with {done.returncode}:\n{done.stdout}\n{done.stderr[-6000:]}"
    return done


def needs_brown():
    if not (pathlib.Path(DATA) / "ca01").exists():
        pytest.skip(f"no Brown corpus in {DATA} (tools/setup.sh fetches it)")


def run_example(work, *extra, **env):
    """The example under torchrun; returns (torchrun's output, the summary line's figures)."""
    done = launch(torchrun("--max-restarts", "1", str(EXAMPLE), "--data-dir", DATA, "--steps", str(STEPS),
                           "--threads", "1", "--outer-batch-size", "32", "--checkpoint-dir", str(work / "checkpoints"),
                           "--checkpoint-every", str(CHECKPOINT_EVERY), "--save-parameters",
                           str(work / "final_parameters.pt"), *extra), **env)
    summary = re.search(r"steps (\d+), microbatches (\d+), OOM (\d+),.*world size (\d+), microbatches per rank "
                        r"\[(\d+), (\d+)\]", done.stdout)
    assert summary, done.stdout
    return done, [int(x) for x in summary.groups()]


def parameters(path):
    return torch.load(path, weights_only=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    needs_brown()
    work = tmp_path_factory.mktemp("example_uninterrupted")
    done, figures = run_example(work)
    return work, done, figures


def test_torchrun_trains_the_example_on_two_ranks_without_oom(uninterrupted):
    work, done, (steps, microbatches, ooms, world_size, rank0, rank1) = uninterrupted
    print(f"\nexample under torchrun: {steps} steps, {microbatches} microbatches (rank 0 {rank0}, rank 1 {rank1}), "
          f"OOM {ooms}")
    assert (steps, ooms, world_size) == (STEPS, 0, 2)
    assert rank0 >= STEPS and rank1 >= STEPS and rank0 + rank1 == microbatches  # every rank joined every step
    assert "resumed" not in done.stdout
    written = sorted(p.name for p in (work / "checkpoints").iterdir())
    assert written == [f"checkpoint-step{s:08d}.pt" for s in (STEPS - CHECKPOINT_EVERY, STEPS)]  # the newest 2


def test_a_killed_rank_restarts_both_from_the_newest_checkpoint_to_the_same_parameters(uninterrupted, tmp_path):
    reference_dir = uninterrupted[0]
    done, (steps, _, ooms, _, rank0, rank1) = run_example(tmp_path, XPM_FAULT_EXIT_AT=f"1:{FAULT_STEP}:kill")
    assert "exitcode: -9" in done.stderr, done.stderr[-3000:]  # torchrun saw rank 1 killed
    resumed = re.search(r"resumed from step (\d+) \(checkpoint-step\d+\.pt, restart (\d+)\)", done.stdout)
    assert resumed, done.stdout
    print(f"\nrank 1 killed at step {FAULT_STEP}: restart {resumed[2]} resumed from step {resumed[1]}, "
          f"then {rank0} + {rank1} microbatches to step {steps}, OOM {ooms}")
    assert (int(resumed[1]), int(resumed[2])) == (FAULT_STEP - 1, 1)  # the checkpoint before the killed step
    assert (steps, ooms) == (STEPS, 0)
    mine, reference = parameters(tmp_path / "final_parameters.pt"), parameters(reference_dir / "final_parameters.pt")
    assert mine.keys() == reference.keys()
    unequal = [name for name in reference if not torch.equal(mine[name], reference[name])]
    assert not unequal, f"parameters differ from the uninterrupted run's: {unequal}"


# Run by torchrun on each rank: the example's process-group set-up, one all-reduce; rank 1
# exits in attempt 0, and starts 3 s after rank 0 in attempt 1, so rank 0 finds rank 1's address
# of attempt 0 in the agent's store unless each attempt has keys of its own.
LATE_RANK_SCRIPT = r'''
import os, sys, time
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
import train
rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if attempt == 1 and rank == 1:
    time.sleep(3)
train.init_process_group(attempt)
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
print(f"attempt {attempt} rank {rank}: all-reduce {total.item():.0f}, agent store "
      f"{os.environ['TORCHELASTIC_USE_AGENT_STORE']}", flush=True)
if attempt == 0 and rank == 1:
    os._exit(17)
dist.barrier()
dist.destroy_process_group()
'''


def test_a_restarted_attempt_connects_when_its_ranks_start_apart(tmp_path):
    script = tmp_path / "late_rank.py"
    script.write_text(LATE_RANK_SCRIPT)
    done = launch(torchrun("--max-restarts", "1", str(script), str(EXAMPLE.parent)))
    for attempt in (0, 1):
        for rank in (0, 1):
            line = f"attempt {attempt} rank {rank}: all-reduce 3, agent store True"
            assert line in done.stdout, done.stdout + done.stderr[-3000:]


# ---- xpm-train under torchrun (settings of tests/distributed/test_restarts.py)
def xpm_train(run_dir, cache, *extra):
    return [str(BIN / "xpm-train"), "--data-dir", DATA, "--run-dir", str(run_dir), "--max-steps", "8",
            "--outer-batch-size", "16", "--threads", "1", "--memory-cap-factor", "2.0", "--dropout", "0",
            "--max-validation-sentences", "100", "--validate-every", "4", "--warmup-steps", "2",
            "--checkpoint-every-steps", "2", "--collective-timeout-s", "20", "--memory-model-cache", str(cache),
            "--quiet", *extra]


def summary_of(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def xpm_train_reference(tmp_path_factory):
    if not (BIN / "xpm-train").exists():
        pytest.skip(f"{BIN / 'xpm-train'} is not built")
    needs_brown()
    work = tmp_path_factory.mktemp("xpm_train")
    launch(xpm_train(work / "nproc2", work / "cache", "--nproc", "2"))
    return work, (work / "nproc2" / "final_parameters.pt").read_bytes()


def test_torchrun_no_python_xpm_train_trains_like_nproc_2(xpm_train_reference):
    work, reference = xpm_train_reference
    launch(torchrun("--no-python", *xpm_train(work / "torchrun", work / "cache")))
    summary = summary_of(work / "torchrun")
    print(f"\nxpm-train under torchrun: {summary['train_steps']} steps, restarts {summary['restarts']}")
    assert summary["finished"] is True and summary["restarts"] == 0
    assert (work / "torchrun" / "final_parameters.pt").read_bytes() == reference


def test_torchrun_restarts_a_failed_xpm_train_rank_to_the_parameters_of_nproc_2(xpm_train_reference):
    work, reference = xpm_train_reference
    done = launch(torchrun("--max-restarts", "1", "--no-python", *xpm_train(work / "restarted", work / "cache")),
                  XPM_FAULT_EXIT_AT=f"1:{FAULT_STEP}")
    assert "exitcode: 17" in done.stderr, done.stderr[-3000:]  # torchrun saw rank 1 fail
    summary = summary_of(work / "restarted")
    print(f"\nxpm-train rank 1 exited at step {FAULT_STEP}: restarts {summary['restarts']}, resumed from step "
          f"{summary['resumed_from_step']}")
    assert summary["restarts"] == 1 and summary["finished"] is True
    assert summary["resumed_from_step"] == FAULT_STEP - 1
    assert (work / "restarted" / "final_parameters.pt").read_bytes() == reference
