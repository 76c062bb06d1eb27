#!/usr/bin/python3
"""A character-level causal Transformer language model, written in PyTorch, trained on Brown
sentences under a CPU memory cap with xpm's planner: probe the step, fit
``a*bs*l^2 + b*bs*l + d*bs + c``, split every outer batch of 64 sentences into microbatches that fit.

    PYTHONPATH=build/python /usr/bin/python3 examples/python_char_transformer/train.py \\
        --data-dir data/brown --steps 200

Prints the fitted model, then one line: steps, microbatches, OOM count, the worst prediction
error of the microbatches where the formula binds, and real characters per second.
"""
import argparse
import pathlib
import re
import sys
import time

import numpy as np
import torch

import xpm

VOCAB = 128


class CharTransformer(torch.nn.Module):
    """Embedding 64 + positions, 2 causal encoder layers (4 heads), next-character logits."""

    def __init__(self, max_length=256):
        super().__init__()
        self.embedding = torch.nn.Embedding(VOCAB, 64)
        self.position = torch.nn.Embedding(max_length, 64)
        layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2)
        self.head = torch.nn.Linear(64, VOCAB)

    def loss_sum(self, chars):
        """Summed next-character loss of [bs, l] character ids (0 is padding)."""
        inputs, targets = chars[:, :-1], chars[:, 1:]
        l = inputs.size(1)
        x = self.embedding(inputs) + self.position(torch.arange(l))
        causal = torch.triu(torch.full((l, l), float("-inf")), diagonal=1)
        hidden = self.encoder(x, mask=causal, src_key_padding_mask=inputs.eq(0))
        return torch.nn.functional.cross_entropy(self.head(hidden).reshape(-1, VOCAB), targets.reshape(-1),
                                                 ignore_index=0, reduction="sum")


def read_brown(data_dir, max_chars=256):
    """Every sentence of the corpus as text (the words of its word/tag tokens), at most 256."""
    files = sorted(p for p in pathlib.Path(data_dir).iterdir() if re.fullmatch(r"c[a-r]\d\d", p.name))
    if not files:
        raise SystemExit(f"train.py: error: --data-dir '{data_dir}' holds no Brown files (ca01, ...)")
    sentences = []
    for path in files:
        for line in path.read_text().splitlines():
            text = " ".join(token.rsplit("/", 1)[0] for token in line.split())
            if len(text) >= 5:
                sentences.append(text[:max_chars])
    return sentences


def encode(sentences):
    l = max(len(s) for s in sentences)
    chars = torch.zeros(len(sentences), l, dtype=torch.long)
    for row, text in enumerate(sentences):
        chars[row, :len(text)] = torch.tensor([ord(c) & 127 or 1 for c in text])
    return chars


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="data/brown")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--memory-cap-bytes", type=int, default=60_000_000)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.steps < 1 or args.memory_cap_bytes < 1 or args.threads < 1:
        parser.error("--steps, --memory-cap-bytes and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    torch.manual_seed(1)
    sentences = read_brown(args.data_dir)
    lengths = np.array([len(s) for s in sentences])

    # 1. The meter before the model (it must see the weights), then the cap.
    meter = xpm.CpuMeter.install()
    model = CharTransformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    meter.capacity_bytes = args.memory_cap_bytes

    # 2. Probe the step on random characters and fit the memory model.
    formula = xpm.CostFormula("a*bs*l^2 + b*bs*l + d*bs + c", ["bs", "l"])
    probed = xpm.probe(model, optimizer, lambda dims: model.loss_sum(torch.randint(1, VOCAB, (int(dims[0]), int(dims[1])))),
                       formula, meter=meter, variable_max={"bs": 64, "l": int(lengths.max())},
                       design_fractions=(1.0, 0.5, 0.25, 0.125))  # most sentences are short
    budget = xpm.MemoryBudget(args.memory_cap_bytes)
    print(f"model: {probed.model.formula.canonical}, floor {probed.model.floor_bytes:.0f} bytes; "
          f"{len(probed.probes)} probes ({sum(not p.feasible for p in probed.probes)} out of memory) in "
          f"{probed.probe_s:.1f} s; usable {budget.usable_bytes} of {args.memory_cap_bytes} bytes")

    # 3. Train: outer batches of 64 sentences, microbatches planned under the budget, each
    #    microbatch's mean loss weighted by its share of the outer batch's characters.
    sampler = xpm.PredictiveBatchSampler(lengths, probed.model, budget.usable_bytes, outer_batch_size=64, seed=1,
                                         units=lengths - 1)
    ooms = microbatches = steps = characters = 0
    worst_under = max_error = plan_s = 0.0
    planned_steps = 0
    start = time.perf_counter()
    epoch = 0
    while steps < args.steps:
        sampler.set_epoch(epoch)
        plan_start = time.perf_counter()
        planned_steps += len(list(sampler.steps()))  # the epoch's plan, kept for the loop below
        plan_s += time.perf_counter() - plan_start
        for indices, weight, last in xpm.microbatch_loop(iter(sampler), sampler):
            batch = encode([sentences[i] for i in indices])
            units = float(sum(len(sentences[i]) - 1 for i in indices))
            meter.reset_peak()
            try:
                (weight * model.loss_sum(batch) / units).backward()
            except RuntimeError as error:
                if "out of memory" not in str(error).lower():
                    raise
                ooms += 1
            else:
                measured = meter.peak_allocated_bytes
                predicted = probed.model.predict([len(indices), batch.size(1)])
                if measured > probed.model.floor_bytes:  # where the formula, not the floor, binds
                    error = (predicted - measured) / measured
                    worst_under, max_error = min(worst_under, error), max(max_error, abs(error))
            microbatches += 1
            characters += int(units)
            if last:
                optimizer.step()
                optimizer.zero_grad(set_to_none=False)
                steps += 1
                if steps == args.steps:
                    break
        epoch += 1
    elapsed = time.perf_counter() - start
    step_s = (elapsed - plan_s) / steps
    print(f"steps {steps}, microbatches {microbatches}, OOM {ooms}, worst under-prediction "
          f"{100 * worst_under:.2f} %, max |prediction error| {100 * max_error:.2f} %, "
          f"{characters / elapsed:.0f} real characters/s; sampler {1000 * plan_s / planned_steps:.2f} ms "
          f"per outer batch ({100 * plan_s / planned_steps / step_s:.2f} % of a training step)")
    return 0 if ooms == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
