#!/usr/bin/env python3
"""How close plans of reserved bytes come to the reserved peaks, as the tensors grow, on the CPU
meter's emulation of CUDA's caching allocator (``xpm.CpuMeter.install(caching=True)``).

A model of wide elementwise layers (an embedding of ``--width`` features, ``--layers`` residual
GELU layers scaled per feature, an output layer over a 1,024-token vocabulary: little
arithmetic per byte, so a step of hundreds of MB runs in a second on one core) trains on
records of 4 to 128 tokens. Its memory is probed by ``xpm.probe`` under a cap on reserved bytes
(the weights and AdamW's state plus 40 % of what a step of 16 x 128 tokens adds),
``xpm.PredictiveBatchSampler`` plans outer batches of 32 records by reserved bytes
(``memory_fraction`` 1.0) and ``xpm.microbatch_loop`` runs them, calibrating from what the
emulated allocator reserved. Printed: every microbatch's reserved peak and (planned -
measured) / measured; the distinct reserved peaks (a reserved peak moves by whole segments or,
with expandable segments, by 20 MiB pages); from the third step, the range over the
microbatches above half the budget; and whether planning by allocated bytes alone at the same
cap runs out of memory. The emulation is deterministic: the figures repeat.

    PYTHONPATH=build/python python bench/reserved_planning_scale.py --width 8192 --steps 12
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Tuple

import numpy as np
import torch

import xpm

VOCABULARY, OUTER_BATCH, MAX_RECORDS, MAX_LENGTH = 1024, 32, 16, 128


class WideModel(torch.nn.Module):
    """Tokens in, the next token out, through wide elementwise residual layers."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCABULARY, width)
        self.scales = torch.nn.Parameter(torch.ones(layers, width))
        self.out = torch.nn.Linear(width, VOCABULARY)

    def loss_sum(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens[:, :-1])
        for scale in self.scales:
            hidden = hidden + torch.nn.functional.gelu(hidden * scale)
        logits = self.out(hidden)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCABULARY), tokens[:, 1:].reshape(-1),
                                                 reduction="sum")


def tokens(generator: torch.Generator, dims) -> torch.Tensor:
    """Random tokens of the shape (records, tokens): memory depends on shapes only."""
    return torch.randint(0, VOCABULARY, (int(dims[0]), int(dims[1])), generator=generator)


def fresh(meter: xpm.CpuMeter, args: argparse.Namespace, capacity_bytes: int) -> Tuple[WideModel, torch.optim.Optimizer]:
    """The model and AdamW from seed 0, built without a cap, the cache emptied, then capped."""
    torch.manual_seed(0)
    meter.capacity_bytes = 0
    model = WideModel(args.width, args.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    meter.empty_cache()
    meter.capacity_bytes = capacity_bytes
    return model, optimizer


def binding_capacity(meter: xpm.CpuMeter, args: argparse.Namespace) -> int:
    """The weights and optimizer state plus 40 % of what a step at the largest shape adds."""
    model, optimizer = fresh(meter, args, 0)
    model.loss_sum(torch.zeros(1, 2, dtype=torch.long)).backward()
    optimizer.step()
    meter.empty_cache()
    static_bytes = meter.current_reserved_bytes
    xpm.meters.start_peak(meter)
    model.loss_sum(torch.zeros(MAX_RECORDS, MAX_LENGTH, dtype=torch.long)).backward()
    peak_bytes = meter.peak_reserved_bytes
    del model, optimizer
    meter.empty_cache()
    return int(static_bytes + 0.4 * (peak_bytes - static_bytes))


def probed(meter: xpm.CpuMeter, args: argparse.Namespace, capacity_bytes: int) -> Tuple[xpm.MemoryModel, int]:
    """The model's memory model probed under the cap, and the budget's usable bytes."""
    model, optimizer = fresh(meter, args, capacity_bytes)
    generator = torch.Generator().manual_seed(1)
    budget = xpm.MemoryBudget(capacity_bytes, memory_fraction=1.0)
    try:
        outcome = xpm.probe(model, optimizer, lambda dims: model.loss_sum(tokens(generator, dims)),
                            xpm.CostFormula("a*bs*l + b*bs + c", ["bs", "l"]), meter=meter, budget=budget,
                            variable_max={"bs": MAX_RECORDS, "l": MAX_LENGTH})
    finally:
        meter.capacity_bytes = 0
    print(outcome.reserved_report)
    return outcome.model, int(budget.usable_bytes)


def without_reserved_gap(model: xpm.MemoryModel) -> xpm.MemoryModel:
    """The same fit of allocated bytes, without the line to reserved bytes."""
    parsed = json.loads(model.to_json())
    del parsed["metadata"]["reserved_gap"]
    return xpm.MemoryModel.from_json(json.dumps(parsed))


class AllocatedOnly:
    """The caching meter seen as if it had no segments: plans then bound allocated bytes."""

    def __init__(self, meter: xpm.CpuMeter) -> None:
        object.__setattr__(self, "_meter", meter)

    def __getattr__(self, name: str):
        return getattr(self._meter, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._meter, name, value)

    reserves_segments = False


def train(meter: xpm.CpuMeter, plan_meter, memory_model: xpm.MemoryModel, args: argparse.Namespace,
          capacity_bytes: int, usable_bytes: int) -> Tuple[List[Tuple[int, float, float]], int]:
    """Trains under the cap with the model's plans; (step, planned, measured reserved) per
    microbatch, and the out-of-memory errors (the run stops at the first)."""
    model, optimizer = fresh(meter, args, capacity_bytes)
    generator = torch.Generator().manual_seed(1)
    lengths = np.random.default_rng(2).integers(4, MAX_LENGTH + 1, OUTER_BATCH * args.steps)
    sampler = xpm.PredictiveBatchSampler(np.stack([np.ones_like(lengths), lengths], axis=1), memory_model,
                                         usable_bytes, outer_batch_size=OUTER_BATCH, seed=3, drop_last=True)
    rows: List[Tuple[int, float, float]] = []
    before = meter.oom_count
    try:
        for microbatch, weight, last in xpm.microbatch_loop(iter(sampler), sampler, meter=plan_meter, module=model):
            try:
                loss = model.loss_sum(tokens(generator, microbatch.dims)) * (weight / OUTER_BATCH)
                loss.backward()
                del loss
                if last:
                    optimizer.step()
                    optimizer.zero_grad()
            except torch.OutOfMemoryError:
                break
            rows.append((microbatch.step, microbatch.predicted_bytes + microbatch.correction_bytes,
                         float(meter.peak_reserved_bytes)))
    finally:
        meter.capacity_bytes = 0
    return rows, meter.oom_count - before


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=8192, help="features per token (default 8192)")
    parser.add_argument("--layers", type=int, default=6, help="elementwise layers (default 6)")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps (default 12)")
    parser.add_argument("--expandable-segments", action="store_true",
                        help="emulate PYTORCH_ALLOC_CONF=expandable_segments:True")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    for option, value in (("--width", args.width), ("--layers", args.layers), ("--steps", args.steps)):
        if value < 1:
            print(f"reserved_planning_scale.py: {option} {value} must be at least 1", file=sys.stderr)
            return 2
    torch.set_num_threads(1)
    meter = xpm.CpuMeter.install(caching=True, expandable_segments=args.expandable_segments)
    capacity_bytes = binding_capacity(meter, args)
    memory_model, usable_bytes = probed(meter, args, capacity_bytes)
    rows, ooms = train(meter, meter, memory_model, args, capacity_bytes, usable_bytes)
    for step, planned, measured in rows:
        print(f"step {step + 1:>2} reserved {measured / 1e6:8.1f} MB planned {100 * (planned - measured) / measured:+7.2f} %")
    levels = sorted({measured for _, _, measured in rows if measured > usable_bytes / 2})
    errors = [(p - m) / m for s, p, m in rows if s >= 2 and m > usable_bytes / 2]
    print(f"{'expandable' if args.expandable_segments else 'fixed'} segments, width {args.width}, cap "
          f"{capacity_bytes:,} bytes: {len(rows)} microbatches, {ooms} out of memory; reserved peaks above half "
          f"the budget at {len(levels)} levels, {min(np.diff(levels)) / 1e6 if len(levels) > 1 else 0:.1f} to "
          f"{max(np.diff(levels)) / 1e6 if len(levels) > 1 else 0:.1f} MB apart; from step 3 planned "
          f"{100 * min(errors):+.2f} % to {100 * max(errors):+.2f} % ({len(errors)} microbatches)")
    allocated_rows, allocated_ooms = train(meter, AllocatedOnly(meter), without_reserved_gap(memory_model), args,
                                           capacity_bytes, usable_bytes)
    print(f"planned by allocated bytes alone: {allocated_ooms} out of memory after {len(allocated_rows)} microbatches")
    if args.json:
        temporary = args.json + ".tmp"
        with open(temporary, "w") as out:
            json.dump({"capacity_bytes": capacity_bytes, "usable_bytes": usable_bytes, "rows": rows,
                       "allocated_planning_ooms": allocated_ooms}, out)
        os.replace(temporary, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
