#!/usr/bin/env python3
"""A character-level causal Transformer language model trained by Lightning's Trainer with DDP
over CPU processes, each under a CPU memory cap, with xpm's planning: once DDP has wrapped the
model, every rank probes the step in lockstep and fits the same ``a*bs*l^2 + b*bs*l + d*bs + c``,
and every outer batch of sentences is shared among the ranks and split into microbatches
predicted to fit, the plans calibrated from the peaks training measures.

    PYTHONPATH=build/python python examples/lightning_ddp/train.py --data-dir data/brown --devices 2

Lightning starts ranks 1.. by running this script again. Rank 0 prints the fitted model, then one
line: ranks, optimizer steps, microbatches, OOM count, the worst prediction errors, the loss of
the first and last outer batches, and real characters per second over all ranks. Exit code 1 if a
microbatch ran out of memory.
"""
import argparse
import pathlib
import re
import sys
import time
import warnings

import numpy as np
import torch

import xpm

METER = xpm.CpuMeter.install()  # every rank, before any model is built: it must see the weights

import lightning  # noqa: E402

from xpm.integrations import lightning as xpm_lightning  # noqa: E402

VOCAB = 128
warnings.filterwarnings("ignore", ".*IterableDataset. has .__len__. defined.*")  # planned_dataloader shards itself


class CharTransformer(torch.nn.Module):
    """Embedding 64 + positions, 2 causal encoder layers (4 heads), next-character logits."""

    def __init__(self, max_length: int):
        super().__init__()
        self.embedding = torch.nn.Embedding(VOCAB, 64)
        self.position = torch.nn.Embedding(max_length, 64)
        layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(64, VOCAB)

    def loss_sum(self, chars: torch.Tensor) -> torch.Tensor:
        """Summed next-character loss of [bs, l] character ids (0 is padding)."""
        inputs, targets = chars[:, :-1], chars[:, 1:]
        l = inputs.size(1)
        x = self.embedding(inputs) + self.position(torch.arange(l))
        causal = torch.ones(l, l, dtype=torch.bool).triu(1)  # True: not attended
        hidden = self.encoder(x, mask=causal, src_key_padding_mask=inputs.eq(0))
        return torch.nn.functional.cross_entropy(self.head(hidden).reshape(-1, VOCAB), targets.reshape(-1),
                                                 ignore_index=0, reduction="sum")


def read_brown(data_dir: str, max_chars: int, limit: int) -> list:
    """The corpus's first ``limit`` sentences as text (the words of its word/tag tokens), cut after
    ``max_chars`` characters."""
    files = sorted(p for p in pathlib.Path(data_dir).iterdir() if re.fullmatch(r"c[a-r]\d\d", p.name)) \
        if pathlib.Path(data_dir).is_dir() else []
    if not files:
        raise SystemExit(f"train.py: error: --data-dir '{data_dir}' holds no Brown files (ca01, ...)")
    sentences = []
    for path in files:
        for line in path.read_text().splitlines():
            text = " ".join(token.rsplit("/", 1)[0] for token in line.split())
            if len(text) >= 5:
                sentences.append(text[:max_chars])
                if len(sentences) == limit:
                    return sentences
    return sentences


def collate(texts: list) -> dict:
    """Sentences to [bs, l] character ids, and their loss units (predicted characters)."""
    chars = torch.zeros(len(texts), max(len(t) for t in texts), dtype=torch.long)
    for row, text in enumerate(texts):
        chars[row, :len(text)] = torch.tensor([ord(c) & 127 or 1 for c in text])
    return {"chars": chars, "units": float(sum(len(t) - 1 for t in texts))}


class CharLanguageModel(lightning.LightningModule):
    def __init__(self, sentences: list, args: argparse.Namespace):
        super().__init__()
        self.automatic_optimization = False  # a step is however many microbatches the plan gives
        self.net = CharTransformer(args.max_chars)
        self.sentences, self.args = sentences, args
        self.lengths = np.array([len(s) for s in sentences])
        # Prediction errors at the first step (no optimizer state yet: over-predicted) and after it.
        self.stats = {"microbatches": 0, "ooms": 0, "characters": 0, "worst_under": 0.0, "max_error": [0.0, 0.0],
                      "losses": []}

    def configure_optimizers(self):
        return torch.optim.AdamW(self.net.parameters(), lr=2e-3)

    def on_fit_start(self) -> None:
        # DDP has wrapped the module (its gradient buckets allocated) and the optimizer is built:
        # every rank probes in lockstep, the buckets in the probes, and fits the same model.
        METER.capacity_bytes = self.args.memory_cap_bytes
        formula = xpm.CostFormula("a*bs*l^2 + b*bs*l + d*bs + c", ["bs", "l"])
        self.memory_model = xpm.probe(
            self.net, self.trainer.optimizers[0],
            lambda dims: self.net.loss_sum(torch.randint(1, VOCAB, (int(dims[0]), int(dims[1])))), formula,
            meter=METER, variable_max={"bs": self.args.outer_batch_size, "l": int(self.lengths.max())},
            design_fractions=(1.0, 0.5, 0.25, 0.125),  # most sentences are short
            lockstep=self.trainer.world_size > 1).model
        budget = xpm.MemoryBudget(self.args.memory_cap_bytes)
        self.sampler = xpm.PredictiveBatchSampler(self.lengths, self.memory_model, budget.usable_bytes,
                                                  outer_batch_size=self.args.outer_batch_size, seed=1,
                                                  units=self.lengths - 1, rank=self.trainer.global_rank,
                                                  world_size=self.trainer.world_size)
        if self.trainer.global_rank == 0:
            print(f"model: {self.memory_model.formula.canonical}, floor {self.memory_model.floor_bytes:.0f} bytes; "
                  f"usable {budget.usable_bytes} of {self.args.memory_cap_bytes} bytes per rank", flush=True)

    def train_dataloader(self):
        return xpm_lightning.planned_dataloader(self.trainer, self.sentences, self.sampler, collate)

    def on_train_start(self) -> None:
        self.start = time.perf_counter()  # the probe is done

    def training_step(self, step: xpm.PlannedStep, index: int) -> None:
        loss = torch.zeros(())
        for k, (batch, weight, last) in enumerate(xpm_lightning.microbatches(self, step, sampler=self.sampler,
                                                                              meter=METER)):
            METER.reset_peak()
            try:
                microbatch_loss = weight * self.net.loss_sum(batch["chars"]) / batch["units"]
                self.manual_backward(microbatch_loss)
            except RuntimeError as error:
                if "out of memory" in str(error).lower():
                    self.stats["ooms"] += 1
                raise  # a planned microbatch out of memory: stop (the other ranks stop at the all-reduce)
            loss += microbatch_loss.detach()
            measured = METER.peak_allocated_bytes
            predicted = step.predicted_bytes[k] + step.correction_bytes[k]  # as planned, calibrated
            if measured > self.memory_model.floor_bytes:  # where the formula, not the floor, binds
                error = (predicted - measured) / measured
                self.stats["worst_under"] = min(self.stats["worst_under"], error)
                later = int(self.global_step > 0)
                self.stats["max_error"][later] = max(self.stats["max_error"][later], abs(error))
            self.stats["microbatches"] += 1
            self.stats["characters"] += int(batch["units"])
        optimizer = self.optimizers()
        optimizer.step()
        optimizer.zero_grad()
        self.stats["losses"].append(float(loss))
        self.log("loss", loss, batch_size=max(step.record_count, 1), sync_dist=True, prog_bar=True)

    def on_train_end(self) -> None:
        elapsed = time.perf_counter() - self.start
        ranks = [self.stats]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            ranks = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(ranks, self.stats)
        self.totals = {key: sum(r[key] for r in ranks) for key in ("microbatches", "ooms", "characters")}
        if self.trainer.global_rank != 0:
            return
        losses = np.mean([r["losses"] for r in ranks], axis=0)  # the outer batch's mean loss per step
        print(f"ranks {len(ranks)}, steps {len(losses)}, microbatches {self.totals['microbatches']}, "
              f"OOM {self.totals['ooms']}, worst under-prediction {100 * min(r['worst_under'] for r in ranks):.2f} %, "
              f"max |prediction error| {100 * max(r['max_error'][1] for r in ranks):.2f} % "
              f"({100 * max(r['max_error'][0] for r in ranks):.2f} % at the first step), loss {losses[0]:.3f} -> "
              f"{losses[-1]:.3f} nats/char, {self.totals['characters'] / elapsed:.0f} real characters/s", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="data/brown")
    parser.add_argument("--devices", type=int, default=2, help="CPU processes (DDP when more than 1)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--sentences", type=int, default=4096, help="the corpus's first N sentences")
    parser.add_argument("--max-chars", type=int, default=256)
    parser.add_argument("--outer-batch-size", type=int, default=64)
    parser.add_argument("--memory-cap-bytes", type=int, default=40_000_000, help="per rank")
    parser.add_argument("--threads", type=int, default=1, help="per rank")
    args = parser.parse_args()
    for name in ("devices", "epochs", "sentences", "max_chars", "outer_batch_size", "memory_cap_bytes", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    torch.set_num_threads(args.threads)
    torch.manual_seed(1)
    module = CharLanguageModel(read_brown(args.data_dir, args.max_chars, args.sentences), args)
    trainer = lightning.Trainer(accelerator="cpu", devices=args.devices, strategy="ddp" if args.devices > 1 else "auto",
                                max_epochs=args.epochs, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module)
    return 0 if module.totals["ooms"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
