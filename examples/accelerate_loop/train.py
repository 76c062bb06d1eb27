#!/usr/bin/env python3
"""A character-level causal Transformer trained with Hugging Face accelerate on every process's
share of xpm's plan: ``Accelerator.prepare`` of the model, the optimizer and
``xpm.integrations.accelerate``'s loader, gradient accumulation over each rank's microbatches
with the sampler's weights, under a CPU memory cap.

    torchrun --nproc-per-node 2 examples/accelerate_loop/train.py --cpu --data-dir data/brown --records 2048

Process 0 probes the step and fits ``a*bs*l^2 + b*bs*l + d*bs + c``; every process gets the
model and plans the same epochs; each rank trains on its own microbatches. Prints, per process:
optimizer steps, microbatches, records, OOM count and real characters per second; exit code 1 if
any microbatch ran out of memory.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

import accelerate
from accelerate.utils import broadcast_object_list

import xpm
from xpm.integrations import accelerate as xpm_accelerate

VOCAB = 128
MAX_CHARS = 128


class CharTransformer(torch.nn.Module):
    """Embedding 32 + positions, 1 causal encoder layer (2 heads), next-character logits;
    ``forward`` returns the summed next-character loss (so DDP sees the forward)."""

    def __init__(self, max_length: int = MAX_CHARS):
        super().__init__()
        self.embedding = torch.nn.Embedding(VOCAB, 32)
        self.position = torch.nn.Embedding(max_length, 32)
        layer = torch.nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, chars: torch.Tensor) -> torch.Tensor:
        """Summed next-character loss of [bs, l] character ids (0 is padding)."""
        inputs, targets = chars[:, :-1], chars[:, 1:]
        l = inputs.size(1)
        x = self.embedding(inputs) + self.position(torch.arange(l, device=chars.device))
        causal = torch.ones(l, l, dtype=torch.bool, device=chars.device).triu(1)  # True: not attended
        hidden = self.encoder(x, mask=causal, src_key_padding_mask=inputs.eq(0))
        return torch.nn.functional.cross_entropy(self.head(hidden).reshape(-1, VOCAB), targets.reshape(-1),
                                                 ignore_index=0, reduction="sum")


def read_brown(data_dir: str, records: int) -> List[str]:
    """The first ``records`` sentences of the Brown corpus (the words of its word/tag tokens), at
    most ``MAX_CHARS`` characters each, at least 5."""
    files = sorted(p for p in pathlib.Path(data_dir).iterdir() if re.fullmatch(r"c[a-r]\d\d", p.name)) \
        if pathlib.Path(data_dir).is_dir() else []
    if not files:
        raise SystemExit(f"train.py: error: --data-dir '{data_dir}' holds no Brown files (ca01, ...)")
    sentences = []
    for path in files:
        for line in path.read_text().splitlines():
            text = " ".join(token.rsplit("/", 1)[0] for token in line.split())
            if len(text) >= 5:
                sentences.append(text[:MAX_CHARS])
                if len(sentences) == records:
                    return sentences
    return sentences


def synthetic_sentences(records: int, seed: int = 3) -> List[str]:
    """``records`` lower-case strings with lengths drawn from a log-normal like sentences' (5 to
    ``MAX_CHARS`` characters), for runs without the corpus."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(60), 0.6, records).astype(int), 5, MAX_CHARS)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz     "))
    return ["".join(rng.choice(letters, n)) for n in lengths]


def collate(sentences: Sequence[str]) -> Tuple[torch.Tensor, int]:
    """[bs, l] character ids (0-padded) and the characters to predict; an empty list (a rank left
    without records for a step) gives one 2-character dummy and 0 units."""
    if not sentences:
        return torch.ones(1, 2, dtype=torch.long), 0
    l = max(len(s) for s in sentences)
    chars = torch.zeros(len(sentences), l, dtype=torch.long)
    for row, text in enumerate(sentences):
        chars[row, :len(text)] = torch.tensor([ord(c) & 127 or 1 for c in text])
    return chars, sum(len(s) - 1 for s in sentences)


def mean_loss(model: torch.nn.Module, batch: Tuple[torch.Tensor, int]) -> torch.Tensor:
    """The microbatch's loss per predicted character (0 times the loss for an empty one, so the
    backward still joins the step's all-reduce)."""
    chars, units = batch
    loss_sum = model(chars)
    return loss_sum / units if units > 0 else 0.0 * loss_sum


def probe_on_main_process(accelerator: accelerate.Accelerator, model: torch.nn.Module,
                          optimizer: torch.optim.Optimizer, meter, max_length: int) -> xpm.MemoryModel:
    """Process 0 probes the step under the meter's cap and fits the memory model; every process
    gets it (``to_json`` broadcast). Call before ``Accelerator.prepare`` of the model."""
    payload = [None]
    if accelerator.is_main_process:
        formula = xpm.CostFormula("a*bs*l^2 + b*bs*l + d*bs + c", ["bs", "l"])
        probed = xpm.probe(model, optimizer, lambda dims: model(torch.randint(1, VOCAB, (int(dims[0]), int(dims[1])))),
                           formula, meter=meter, variable_max={"bs": 64, "l": max_length},
                           design_fractions=(1.0, 0.5, 0.25, 0.125))
        payload = [probed.model.to_json()]
    broadcast_object_list(payload, from_process=0)
    return xpm.MemoryModel.from_json(payload[0])


def probe_prepared(model: torch.nn.Module, optimizer, meter, max_length: int) -> xpm.MemoryModel:
    """Every process probes the prepared (DDP-wrapped) model in lockstep under the meter's cap, so
    DDP's gradient buckets and all-reduce are in the probes, and gets the same fitted model. Call
    after ``Accelerator.prepare`` of the model and optimizer, on every process."""
    formula = xpm.CostFormula("a*bs*l^2 + b*bs*l + d*bs + c", ["bs", "l"])
    return xpm.probe(model, optimizer, lambda dims: model(torch.randint(1, VOCAB, (int(dims[0]), int(dims[1])))),
                     formula, meter=meter, variable_max={"bs": 64, "l": max_length},
                     design_fractions=(1.0, 0.5, 0.25, 0.125), lockstep=True).model


def run_epoch(accelerator: accelerate.Accelerator, model: torch.nn.Module, optimizer, loader,
              after_backward: Optional[Callable] = None, meter=None) -> Dict[str, object]:
    """One epoch of the prepared ``loader``: each microbatch's weighted mean loss backward inside
    ``xpm_accelerate.accumulate`` (no all-reduce until the step's last microbatch), the optimizer
    stepped by accelerate at the end of each step. An out-of-memory backward is counted. With
    ``meter``, every microbatch's peak calibrates the sampler's plans.

    Returns:
        ``steps`` (list of the record indices of each step), ``microbatches``, ``ooms``,
        ``characters``, ``seconds``.
    """
    steps: List[List[int]] = [[]]
    microbatches = ooms = characters = 0
    start = time.perf_counter()
    for microbatch in xpm_accelerate.microbatch_loop(loader, meter=meter):
        with xpm_accelerate.accumulate(accelerator, model, microbatch):
            try:
                accelerator.backward(microbatch.weight * mean_loss(model, microbatch.batch))
            except RuntimeError as error:
                if "out of memory" not in str(error).lower():
                    raise
                ooms += 1
            if after_backward is not None:
                after_backward(microbatch)
            optimizer.step()        # a no-op until microbatch.last (accelerator.sync_gradients)
            optimizer.zero_grad()
        microbatches += 1
        characters += microbatch.batch[1]
        steps[-1] += microbatch.indices
        if microbatch.last:
            steps.append([])
    return {"steps": steps[:-1], "microbatches": microbatches, "ooms": ooms, "characters": characters,
            "seconds": time.perf_counter() - start}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="data/brown", help="the Brown corpus; 'synthetic' for generated text")
    parser.add_argument("--records", type=int, default=2048, help="sentences to train on")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--outer-batch-size", type=int, default=64)
    parser.add_argument("--memory-cap-bytes", type=int, default=12_000_000)
    parser.add_argument("--cpu", action="store_true", help="train on the CPU (the cap is the CPU meter's)")
    parser.add_argument("--record-file", help="writes each process's steps and counts as JSON ({rank} in the name)")
    args = parser.parse_args()
    if min(args.records, args.epochs, args.outer_batch_size, args.memory_cap_bytes) < 1:
        parser.error("--records, --epochs, --outer-batch-size and --memory-cap-bytes must be >= 1")
    torch.manual_seed(1)
    accelerator = accelerate.Accelerator(cpu=args.cpu)
    if args.data_dir == "synthetic":
        sentences = synthetic_sentences(args.records)
    else:
        sentences = read_brown(args.data_dir, args.records)
    lengths = np.array([len(s) for s in sentences])

    meter = xpm.CpuMeter.install()  # before the model: it must see the weights
    model = CharTransformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    meter.capacity_bytes = args.memory_cap_bytes
    memory_model = probe_prepared(model, optimizer, meter, int(lengths.max()))
    budget = xpm.MemoryBudget(args.memory_cap_bytes)

    sampler = xpm.PredictiveBatchSampler(lengths, memory_model, budget.usable_bytes,
                                         outer_batch_size=args.outer_batch_size, rank=accelerator.process_index,
                                         world_size=accelerator.num_processes, seed=1, units=lengths - 1)
    loader = xpm_accelerate.prepare_data_loader(accelerator, sentences, sampler, collate_fn=collate)
    totals = {"steps": [], "microbatches": 0, "ooms": 0, "characters": 0, "seconds": 0.0}
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        result = run_epoch(accelerator, model, optimizer, loader, meter=meter)
        for key in totals:
            totals[key] += result[key]
    print(f"process {accelerator.process_index}/{accelerator.num_processes}: steps {len(totals['steps'])}, "
          f"microbatches {totals['microbatches']}, records {sum(len(s) for s in totals['steps'])}, "
          f"OOM {totals['ooms']}, {totals['characters'] / totals['seconds']:.0f} real characters/s", flush=True)
    if sampler.calibration.log:
        print(f"process {accelerator.process_index}: calibration {sampler.calibration.log[-1]}", flush=True)
    if args.record_file:
        path = pathlib.Path(args.record_file.format(rank=accelerator.process_index))
        path.write_text(json.dumps({"rank": accelerator.process_index, **totals}))
    accelerator.end_training()
    return 0 if totals["ooms"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
