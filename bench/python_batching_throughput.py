#!/usr/bin/env python3
"""Real tokens per second of three ways to split outer batches under one CPU memory cap, on the
same records and the same model (a causal character Transformer, whose attention makes memory
grow with bs*l^2):

- fixed: every outer batch cut into microbatches of m records, m the largest that trains an
  epoch without running out of memory, found as users find it: start at the outer batch, halve
  after an out-of-memory epoch, then try the values between;
- token budget: each outer batch's records sorted by length and packed greedily while a
  microbatch's padded tokens (records x longest) stay within T (what RL trainers' users set as
  ``ppo_max_token_len_per_gpu`` or ``train_mb_tokens``), T the largest that trains an epoch
  without running out of memory (down by 15 % after each out-of-memory epoch);
- xpm: ``xpm.probe`` of the step, ``PredictiveBatchSampler`` with calibration, the probe's time
  reported apart; once with the default packer (the fewest microbatches that fit) and once with
  ``packer="fastest"`` (the least time by the time model the probe fitted to its own timings).

Every epoch starts from the same weights and optimizer state. An epoch that runs out of memory
is stopped at the first out-of-memory error (a retry, as a user's would be). Prints a table and
writes JSON (``--json``).

    PYTHONPATH=build/python python bench/python_batching_throughput.py --data-dir data/brown \\
        --records 1024 --json runs/bench/python-batching.json
"""
from __future__ import annotations

import argparse
import copy
import json
import pathlib
import random
import sys
import time
from typing import Callable, Dict, List, Optional

import numpy as np
import torch

import xpm

VOCAB, WIDTH, MAX_CHARS = 128, 64, 320
METER = xpm.CpuMeter.install()  # before the model: the meter must see the weights


class CharTransformer(torch.nn.Module):
    """Characters -> 2 causal Transformer layers (64 wide, 4 heads) -> next-character logits;
    ``forward`` returns the summed loss of a [bs, l] batch (0 pads)."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(VOCAB, WIDTH)
        self.position = torch.nn.Embedding(MAX_CHARS, WIDTH)
        layer = torch.nn.TransformerEncoderLayer(WIDTH, 4, 4 * WIDTH, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, chars: torch.Tensor) -> torch.Tensor:
        inputs, targets = chars[:, :-1], chars[:, 1:]
        l = inputs.size(1)
        causal = torch.ones(l, l, dtype=torch.bool).triu(1)
        hidden = self.encoder(self.embedding(inputs) + self.position(torch.arange(l)), mask=causal,
                              src_key_padding_mask=inputs.eq(0))
        return torch.nn.functional.cross_entropy(self.head(hidden).reshape(-1, VOCAB), targets.reshape(-1),
                                                 ignore_index=0, reduction="sum")


def sentences(data_dir: str, count: int) -> List[str]:
    """Brown sentences (words joined by spaces, at most MAX_CHARS), else generated ones."""
    path = pathlib.Path(data_dir)
    texts = []
    for file in sorted(path.glob("c[a-r][0-9][0-9]")) if path.is_dir() else []:
        for line in file.read_text().splitlines():
            text = " ".join(token.rsplit("/", 1)[0] for token in line.split())
            if len(text) >= 5:
                texts.append(text[:MAX_CHARS])
    if len(texts) < count:
        rng = random.Random(7)
        words = ["".join(rng.choice("etaoinshrdlucmfwyp") for _ in range(rng.randint(1, 9))) for _ in range(300)]
        texts = [" ".join(rng.choice(words) for _ in range(3 + int(rng.expovariate(1 / 20))))[:MAX_CHARS]
                 for _ in range(count)]
    return random.Random(1).sample(texts, count)


def collate(texts: List[str]) -> torch.Tensor:
    chars = torch.zeros(len(texts), max(len(t) for t in texts), dtype=torch.long)
    for row, text in enumerate(texts):
        chars[row, :len(text)] = torch.tensor([ord(c) & 127 or 1 for c in text])
    return chars


class Trainer:
    """The model and optimizer, reset to the same start before each epoch."""

    def __init__(self, texts: List[str]):
        torch.manual_seed(0)
        self.texts = texts
        self.model = CharTransformer()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.model(collate(texts[:2])).backward()  # optimizer state allocated: the steady state
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.start = (copy.deepcopy(self.model.state_dict()), copy.deepcopy(self.optimizer.state_dict()))

    def reset(self) -> None:
        self.model.load_state_dict(self.start[0])
        self.optimizer.load_state_dict(self.start[1])
        self.optimizer.zero_grad()

    def epoch(self, steps: List[List[List[int]]], loop: Optional[Callable] = None) -> Dict[str, float]:
        """Trains ``steps`` (per step, its microbatches' record indices); stops at the first out of
        memory. Returns seconds, real tokens, microbatches, ooms."""
        self.reset()
        METER.reset_peak()
        tokens, microbatches, start = 0, 0, time.perf_counter()
        try:
            for step in steps:
                units = float(sum(len(self.texts[i]) - 1 for mb in step for i in mb))
                for microbatch in step:
                    (self.model(collate([self.texts[i] for i in microbatch])) / units).backward()
                    microbatches += 1
                self.optimizer.step()
                self.optimizer.zero_grad()
                tokens += int(units)
        except torch.OutOfMemoryError:
            # A retry starts clean, as a restarted job would: the failed graph and the autograd
            # engine's buffers of the failed backward go (a tiny backward without the cap).
            self.optimizer.zero_grad()
            cap, METER.capacity_bytes = METER.capacity_bytes, 0
            torch.zeros(1, requires_grad=True).sum().backward()
            METER.capacity_bytes = cap
            return {"seconds": time.perf_counter() - start, "tokens": tokens, "microbatches": microbatches, "ooms": 1}
        return {"seconds": time.perf_counter() - start, "tokens": tokens, "microbatches": microbatches, "ooms": 0,
                "peak_bytes": METER.peak_allocated_bytes}


def outer_batches(count: int, outer: int, seed: int = 1) -> List[np.ndarray]:
    order = np.random.default_rng(seed).permutation(count)
    return [order[k:k + outer] for k in range(0, count, outer)]


def fixed_steps(batches: List[np.ndarray], size: int) -> List[List[List[int]]]:
    return [[list(map(int, b[k:k + size])) for k in range(0, len(b), size)] for b in batches]


def token_budget_steps(batches: List[np.ndarray], lengths: np.ndarray, budget: int) -> List[List[List[int]]]:
    steps = []
    for b in batches:
        microbatches, current = [], []
        for i in sorted(map(int, b), key=lambda i: -lengths[i]):
            if current and (len(current) + 1) * lengths[current[0]] > budget:
                microbatches.append(current)
                current = []
            current.append(i)
        steps.append(microbatches + [current])
    return steps


def best_fixed(trainer: Trainer, batches, outer: int) -> Dict[str, object]:
    """The largest microbatch size with an epoch free of out-of-memory errors, and the tries."""
    tries, size, good, bad = [], outer, 0, outer + 1
    while size >= 1 and good == 0:  # halve until an epoch passes
        result = trainer.epoch(fixed_steps(batches, size))
        tries.append((size, result["ooms"]))
        if result["ooms"]:
            bad, size = size, size // 2
        else:
            good = size
    while bad - good > 1:  # then bisect between the last failure and the pass
        size = (good + bad) // 2
        result = trainer.epoch(fixed_steps(batches, size))
        tries.append((size, result["ooms"]))
        good, bad = (size, bad) if not result["ooms"] else (good, size)
    return {"setting": good, "tries": tries}


def best_token_budget(trainer: Trainer, batches, lengths, outer: int) -> Dict[str, object]:
    """The largest padded-token budget (down 15 % per failure) with an epoch free of OOM."""
    budget, tries = int(outer * lengths.max()), []
    while budget >= lengths.max():
        result = trainer.epoch(token_budget_steps(batches, lengths, budget))
        tries.append((budget, result["ooms"]))
        if not result["ooms"]:
            return {"setting": budget, "tries": tries}
        budget = int(budget * 0.85)
    raise RuntimeError("no token budget fits one record of the longest length")


def probed(trainer: Trainer, lengths, outer: int):
    """``xpm.probe`` of the trainer's step, and its time."""
    trainer.reset()
    start = time.perf_counter()
    model = trainer.model
    outcome = xpm.probe(model, trainer.optimizer, lambda dims: model(torch.randint(1, VOCAB, (int(dims[0]),
                                                                                               int(dims[1])))),
                        xpm.CostFormula("a*bs*l^2 + b*bs*l + d*bs + c", ["bs", "l"]), meter=METER,
                        variable_max={"bs": outer, "l": int(lengths.max())}, design_fractions=(1.0, 0.5, 0.25, 0.125))
    return outcome, time.perf_counter() - start


def predictive(trainer: Trainer, texts, lengths, cap: int, outer: int, outcome, probe_s: float,
               packer: str) -> Dict[str, object]:
    sampler = xpm.PredictiveBatchSampler(lengths, outcome.model, xpm.MemoryBudget(cap).usable_bytes,
                                         outer_batch_size=outer, seed=1, units=lengths - 1, packer=packer)
    planned_outer = [sorted(int(i) for mb in step.microbatches for i in mb) for step in sampler.steps()]
    if planned_outer != [sorted(map(int, b)) for b in outer_batches(len(lengths), outer)]:
        raise RuntimeError("the sampler's outer batches differ from the other batchings'")
    trainer.reset()
    ooms, tokens, microbatches, peak = METER.oom_count, 0, 0, 0
    start = time.perf_counter()
    for microbatch, weight, last in xpm.microbatch_loop(iter(sampler), sampler, meter=METER):
        step_units = float(sum(len(texts[i]) - 1 for i in microbatch))
        (weight * trainer.model(collate([texts[i] for i in microbatch])) / max(step_units, 1.0)).backward()
        microbatches += 1
        tokens += int(step_units)
        if last:
            trainer.optimizer.step()
            trainer.optimizer.zero_grad()
        peak = max(peak, METER.peak_allocated_bytes)  # microbatch_loop resets the peak per microbatch
    return {"seconds": time.perf_counter() - start, "tokens": tokens, "microbatches": microbatches,
            "ooms": METER.oom_count - ooms, "peak_bytes": peak, "probe_s": probe_s, "probes": len(outcome.probes),
            "calibration": sampler.calibration.log, "packer": packer, "time_model": outcome.model.time_model}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="data/brown")
    parser.add_argument("--records", type=int, default=1024)
    parser.add_argument("--outer-batch-size", type=int, default=64)
    parser.add_argument("--cap-above-static-bytes", type=int, default=40_000_000,
                        help="the CPU cap: the static memory (weights, gradients, AdamW state) plus this")
    parser.add_argument("--json", help="writes the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    texts = sentences(args.data_dir, args.records)
    lengths = np.array([len(t) for t in texts])
    trainer = Trainer(texts)
    for p in trainer.model.parameters():
        p.grad = torch.zeros_like(p)
    cap = METER.current_allocated_bytes + args.cap_above_static_bytes
    trainer.optimizer.zero_grad()
    METER.capacity_bytes = cap
    batches = outer_batches(len(texts), args.outer_batch_size)
    fixed = best_fixed(trainer, batches, args.outer_batch_size)
    fixed.update(trainer.epoch(fixed_steps(batches, fixed["setting"])))
    budget = best_token_budget(trainer, batches, lengths, args.outer_batch_size)
    budget.update(trainer.epoch(token_budget_steps(batches, lengths, budget["setting"])))
    outcome, probe_s = probed(trainer, lengths, args.outer_batch_size)
    planned = predictive(trainer, texts, lengths, cap, args.outer_batch_size, outcome, probe_s, "adaptive")
    fastest = predictive(trainer, texts, lengths, cap, args.outer_batch_size, outcome, probe_s, "fastest")
    rows = {"fixed microbatch": fixed, "token budget": budget, "xpm": planned, "xpm, fastest packer": fastest}
    xpm_rate = fastest["tokens"] / fastest["seconds"]
    print(f"{args.records} records ({lengths.min()}-{lengths.max()} characters), outer batches of "
          f"{args.outer_batch_size}, cap {cap} bytes\n")
    print("| batching | setting | tries | microbatches | OOM | peak / cap | real tokens/s | xpm fastest / this |")
    print("|---|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        rate = row["tokens"] / row["seconds"]
        setting = {"fixed microbatch": f"{row.get('setting')} records", "token budget": f"{row.get('setting')} tokens",
                   "xpm": f"probe {row.get('probe_s', 0):.1f} s, {row.get('probes', 0)} probes",
                   "xpm, fastest packer": "the same probe"}[name]
        print(f"| {name} | {setting} | {len(row.get('tries', []))} | {row['microbatches']} | {row['ooms']} | "
              f"{row['peak_bytes'] / cap:.3f} | {rate:,.0f} | {xpm_rate / rate:.2f} |")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"cap_bytes": cap, "records": args.records, **rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
