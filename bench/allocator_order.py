#!/usr/bin/env python3
"""What the order of a step's microbatches does to the caching allocator's reserved bytes, on
the CPU meter's emulation of CUDA's caching allocator (``xpm.CpuMeter.install(caching=True)``).

A token model (embedding, a 4x-wide MLP block, an output layer over an 8,192-token vocabulary)
trains on records of 4 to 128 tokens; ``xpm.PredictiveBatchSampler`` splits each outer batch
of 32 records into microbatches under a budget (the model probed by ``xpm.probe``). The same
steps then run with their microbatches in three orders:

- packed: as the sampler hands them out (its packers sort records longest first, so the
  step's first microbatches hold the longest records and the last the leftovers);
- reversed: the same microbatches, the last first;
- shuffled: a fixed random order per step.

Each order runs three times (``CACHE_MODES``): keeping the cache between microbatches (what a
plain training loop does), emptying it before each microbatch (what ``xpm.microbatch_loop``
does with a meter that reserves segments, to measure each microbatch's own reserved peak), and
emptying it before the optimizer step as well (what the C++ Learner does). Per step it records
the reserved and allocated peaks over the microbatches and the optimizer step's reserved peak
(the meter's, reset before each); it prints a table of each configuration's largest and mean
reserved peaks and their ratio to the allocated ones, and writes JSON (``--json``). Every run starts from the same weights and optimizer state; the
emulation is deterministic, so the figures repeat.

    PYTHONPATH=build/python python bench/allocator_order.py --steps 8 --json runs/bench/allocator-order.json
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from typing import Dict, List

import numpy as np
import torch

import xpm

VOCABULARY, WIDTH, OUTER_BATCH, MAX_LENGTH = 8192, 512, 32, 128
ORDERS = ("packed", "reversed", "shuffled")


class TokenModel(torch.nn.Module):
    """Tokens in, the next token out: embedding, a 4x-wide MLP block, an output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCABULARY, WIDTH)
        self.block = torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(),
                                         torch.nn.Linear(4 * WIDTH, WIDTH))
        self.out = torch.nn.Linear(WIDTH, VOCABULARY)

    def loss_sum(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens[:, :-1])
        logits = self.out(hidden + self.block(hidden))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCABULARY), tokens[:, 1:].reshape(-1),
                                                 reduction="sum")


def fresh(meter: xpm.CpuMeter) -> tuple:
    """The model and AdamW from seed 0, the cache emptied."""
    torch.manual_seed(0)
    model = TokenModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    meter.empty_cache()
    return model, optimizer


def batch(lengths: np.ndarray, records: List[int], generator: torch.Generator) -> torch.Tensor:
    """The records' tokens, padded to the longest (random tokens: memory depends on shapes only)."""
    return torch.randint(0, VOCABULARY, (len(records), int(lengths[records].max())), generator=generator)


def planned_steps(meter: xpm.CpuMeter, lengths: np.ndarray, budget_bytes: int, steps: int) -> List[List[List[int]]]:
    """The sampler's first ``steps`` steps, each a list of microbatches (record indices)."""
    model, optimizer = fresh(meter)
    generator = torch.Generator().manual_seed(1)
    outcome = xpm.probe(model, optimizer, lambda dims: model.loss_sum(
        torch.randint(0, VOCABULARY, (int(dims[0]), int(dims[1])), generator=generator)),
        xpm.CostFormula("a*bs*l + b*bs + c", ["bs", "l"]), meter=meter,
        budget=xpm.MemoryBudget(budget_bytes, memory_fraction=1.0), variable_max={"bs": 16, "l": MAX_LENGTH})
    del model, optimizer
    sampler = xpm.PredictiveBatchSampler(np.stack([np.ones_like(lengths), lengths], axis=1), outcome.model,
                                         budget_bytes, outer_batch_size=OUTER_BATCH, seed=3, drop_last=True)
    return [[list(map(int, mb)) for mb in step.microbatches] for step in list(sampler.steps())[:steps]]


CACHE_MODES = ("kept", "emptied per microbatch", "emptied before each")
"""Between microbatches the cache is kept (a plain loop), emptied before each microbatch (what
``xpm.microbatch_loop`` does with a meter that reserves segments), or emptied before each
microbatch and before the optimizer step (what the C++ Learner does)."""


def run(meter: xpm.CpuMeter, lengths: np.ndarray, steps: List[List[List[int]]], order: str,
        cache: str) -> Dict[str, List[int]]:
    """Trains the steps with their microbatches in ``order``; each step's reserved and allocated
    peak over its microbatches, and its optimizer step's reserved peak."""
    model, optimizer = fresh(meter)
    generator, shuffler = torch.Generator().manual_seed(1), np.random.default_rng(5)
    peaks: Dict[str, List[int]] = {"reserved_bytes": [], "allocated_bytes": [], "optimizer_step_reserved_bytes": []}
    for step in steps:
        microbatches = list(step)
        if order == "reversed":
            microbatches.reverse()
        elif order == "shuffled":
            microbatches = [microbatches[i] for i in shuffler.permutation(len(microbatches))]
        meter.reset_peak()
        for records in microbatches:
            if cache != "kept":
                meter.empty_cache()
            loss = model.loss_sum(batch(lengths, records, generator)) / OUTER_BATCH
            loss.backward()
            del loss
        peaks["reserved_bytes"].append(meter.peak_reserved_bytes)
        peaks["allocated_bytes"].append(meter.peak_allocated_bytes)
        if cache == "emptied before each":
            meter.empty_cache()
        meter.reset_peak()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        peaks["optimizer_step_reserved_bytes"].append(meter.peak_reserved_bytes)
    return peaks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run (default 8)")
    parser.add_argument("--budget-bytes", type=int, default=300_000_000,
                        help="the budget the sampler plans each step's microbatches under (default 300,000,000)")
    parser.add_argument("--expandable-segments", action="store_true",
                        help="emulate PYTORCH_ALLOC_CONF=expandable_segments:True")
    parser.add_argument("--json", type=pathlib.Path, help="write the figures here")
    args = parser.parse_args()
    for option, value in (("--steps", args.steps), ("--budget-bytes", args.budget_bytes)):
        if value < 1:
            print(f"allocator_order.py: {option} {value} must be at least 1", file=sys.stderr)
            return 2
    torch.set_num_threads(1)
    meter = xpm.CpuMeter.install(caching=True, expandable_segments=args.expandable_segments)
    lengths = np.random.default_rng(2).integers(4, MAX_LENGTH + 1, OUTER_BATCH * args.steps)
    steps = planned_steps(meter, lengths, args.budget_bytes, args.steps)
    counts = [len(step) for step in steps]
    print(f"{args.steps} steps of {OUTER_BATCH} records in {min(counts)} to {max(counts)} microbatches, "
          f"{'expandable segments' if args.expandable_segments else 'fixed segments'}")
    print(f"{'order':<10} {'cache':<23} {'microbatches: largest reserved':>31} {'mean':>12} "
          f"{'reserved/allocated':>19} {'optimizer step: largest':>24}")
    results = []
    for cache in CACHE_MODES:
        for order in ORDERS:
            peaks = run(meter, lengths, steps, order, cache)
            ratios = [r / a for r, a in zip(peaks["reserved_bytes"], peaks["allocated_bytes"])]
            results.append({"order": order, "cache": cache, **peaks})
            print(f"{order:<10} {cache:<23} {max(peaks['reserved_bytes']):>31,} "
                  f"{int(np.mean(peaks['reserved_bytes'])):>12,} {min(ratios):>9.3f} to {max(ratios):.3f} "
                  f"{max(peaks['optimizer_step_reserved_bytes']):>24,}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        temporary = args.json.with_suffix(args.json.suffix + ".tmp")
        temporary.write_text(json.dumps({"steps": steps, "expandable_segments": args.expandable_segments,
                                         "budget_bytes": args.budget_bytes, "runs": results}, indent=1))
        os.replace(temporary, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
