"""One rank of an own training loop under DistributedDataParallel (test_ddp_own_loop.py), started
by torchrun on 2 CPU processes (gloo): a character GRU wrapped in DDP *before* probing, probed in
lockstep on both ranks (DDP's gradient buckets and its all-reduce are in the probes), then planned
by ``PredictiveBatchSampler`` (lockstep, the default at world size 2; calibrated from every
microbatch's peak by ``microbatch_loop(meter=...)``) and trained for an epoch under a CPU cap, all
but each step's last microbatch inside ``no_sync()``. Writes rank<r>.json into OUT_DIR: every
microbatch's step, measured peak, prediction and the correction its step was planned with; the
calibration's log; OOMs; probe and step times.

    torchrun --standalone --nproc-per-node 2 ddp_own_loop_worker.py OUT_DIR
"""
import contextlib
import dataclasses
import json
import pathlib
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

torch.set_num_threads(1)
import xpm  # noqa: E402

METER = xpm.CpuMeter.install()  # before the model: the meter must see the weights
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from char_gru import VOCAB, CharGru  # noqa: E402
from rank_exit import exit_rank  # noqa: E402


def padded(texts, indices):
    batch = torch.zeros(len(indices), max(len(texts[i]) for i in indices), dtype=torch.long)
    for row, i in enumerate(indices):
        batch[row, :len(texts[i])] = texts[i]
    return batch


def main(out: pathlib.Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = CharGru()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # Ranks giving different formulas in lockstep: one line on each, before any probe runs.
    try:
        xpm.probe(model, optimizer, lambda dims: model(torch.randint(1, VOCAB, (int(dims[0]), int(dims[1])))),
                  xpm.CostFormula("a*bs*l + c" if rank == 0 else "a*bs*l + b*bs + c", ["bs", "l"]), meter=METER,
                  lockstep=True, budget=xpm.MemoryBudget(100_000_000), variable_max={"bs": 4, "l": 32})
        mismatch = None
    except ValueError as error:
        mismatch = str(error)
    # Probed before wrapping too (a few fixed points, both ranks): the buckets are named outside.
    unwrapped = xpm.probe(model, optimizer, lambda dims: model(torch.randint(1, VOCAB, (int(dims[0]), int(dims[1])))),
                          xpm.CostFormula("a*bs*l + b*bs + c", ["bs", "l"]), meter=METER, lockstep=True,
                          budget=xpm.MemoryBudget(100_000_000),
                          probe_points=[{"bs": b, "l": n} for b, n in ((1, 16), (2, 32), (4, 16), (4, 48))])
    wrapped = torch.nn.parallel.DistributedDataParallel(model)  # before probing: its buckets are probed
    cap = torch.tensor([METER.current_allocated_bytes + 14_000_000], dtype=torch.float64)
    dist.all_reduce(cap, op=dist.ReduceOp.MAX)  # one cap for every rank: the same budget, the same plans
    cap = int(cap[0])
    METER.capacity_bytes = cap
    start = time.perf_counter()
    probed = xpm.probe(wrapped, optimizer,
                       lambda dims: wrapped(torch.randint(1, VOCAB, (int(dims[0]), int(dims[1])))),
                       xpm.CostFormula("a*bs*l + b*bs + c", ["bs", "l"]), meter=METER,
                       variable_max={"bs": 32, "l": 120}, lockstep=True)
    probe_s = time.perf_counter() - start
    lengths = np.random.default_rng(4).integers(4, 120, 768)
    texts = [torch.randint(1, VOCAB, (int(n),)) for n in lengths]
    budget = xpm.MemoryBudget(cap)
    sampler = xpm.PredictiveBatchSampler(lengths, probed.model, budget.usable_bytes, outer_batch_size=64, seed=1,
                                         units=lengths - 1)
    rows, step_s, calibration_s = [], [], 0.0
    ooms = METER.oom_count
    clock = time.perf_counter()
    for indices, weight, last in xpm.microbatch_loop(iter(sampler), sampler, meter=METER):
        microbatch = indices  # iter(sampler) yields the Microbatch itself
        with contextlib.nullcontext() if last else wrapped.no_sync():
            if len(indices):
                units = float(sum(len(texts[i]) - 1 for i in indices))
                (weight * wrapped(padded(texts, indices)) / units).backward()
            else:  # an empty microbatch of the lockstep plan: join the all-reduce with zeros
                (0.0 * wrapped(torch.tensor([[1, 1]]))).backward()
        if last:
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
        if len(indices):
            rows.append([microbatch.step, METER.peak_allocated_bytes, microbatch.predicted_bytes,
                         microbatch.correction_bytes])
        if last:
            step_s.append(time.perf_counter() - clock)
            clock = time.perf_counter()
    # What calibration costs per step: end_step's all-reduce and bookkeeping alone.
    timing = xpm.Calibration(budget.usable_bytes)
    begin = time.perf_counter()
    for step in range(20):
        timing.record_peak(1.0, 1.0)
        timing.end_step(step)
    calibration_s = (time.perf_counter() - begin) / 20
    result = {"rank": rank, "rows": rows, "log": sampler.calibration.log, "probe_s": probe_s,
              "probes": len(probed.probes), "floor_bytes": probed.model.floor_bytes, "ooms": METER.oom_count - ooms,
              "step_s": step_s, "calibration_s": calibration_s, "model": probed.model.to_json(),
              "outside_wrapped": [dataclasses.asdict(p) for p in probed.outside_probes],
              "outside_plain": [dataclasses.asdict(p) for p in unwrapped.outside_probes],
              "gradient_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
              "outside_report": unwrapped.outside_report, "mismatch": mismatch}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    exit_rank()  # DDP still holds the process group: see rank_exit.py


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
