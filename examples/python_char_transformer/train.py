#!/usr/bin/python3
"""A character-level causal Transformer language model, written in PyTorch, trained on Brown
sentences under a CPU memory cap with xpm's planner: probe the step, fit
``a*bs*l^2 + b*bs*l + d*bs + c``, split every outer batch of 64 sentences into microbatches that fit.

    PYTHONPATH=build/python python examples/python_char_transformer/train.py \\
        --data-dir data/brown --steps 200

Under torchrun (one process per rank, gloo, DistributedDataParallel), with checkpoints and
restarts from the newest one:

    PYTHONPATH=build/python torchrun --standalone --nproc-per-node 2 --max-restarts 1 \\
        examples/python_char_transformer/train.py --data-dir data/brown --steps 200 --threads 1 \\
        --checkpoint-dir runs/char/checkpoints --checkpoint-every 20

Prints the fitted model, then one line: steps, microbatches, OOM count, the worst prediction
error of the microbatches where the formula binds, and real characters per second.
"""
import argparse
import contextlib
import datetime
import os
import pathlib
import re
import signal
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

import xpm

VOCAB = 128
CHECKPOINT_NAME = re.compile(r"checkpoint-step(\d+)\.pt")
KEPT_CHECKPOINTS = 2


class CharTransformer(torch.nn.Module):
    """Embedding 64 + positions, 2 causal encoder layers (4 heads), next-character logits."""

    def __init__(self, max_length=256):
        super().__init__()
        self.embedding = torch.nn.Embedding(VOCAB, 64)
        self.position = torch.nn.Embedding(max_length, 64)
        layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2)
        self.head = torch.nn.Linear(64, VOCAB)

    def forward(self, chars):
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
    path = pathlib.Path(data_dir)
    files = sorted(p for p in path.iterdir() if re.fullmatch(r"c[a-r]\d\d", p.name)) if path.is_dir() else []
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


def fault_hook(parser):
    """The test hook ``XPM_FAULT_EXIT_AT=R:S[:kill]`` (as xpm-train's): rank R exits with code 17
    (or sends itself SIGKILL) at the start of step S, in the first ``XPM_FAULT_ATTEMPTS``
    attempts of a restarted group (default 1). Returns (rank, step, kill) or None."""
    text = os.environ.get("XPM_FAULT_EXIT_AT", "")
    if not text:
        return None
    match = re.fullmatch(r"(\d+):(\d+)(:kill)?", text)
    attempts = os.environ.get("XPM_FAULT_ATTEMPTS", "1")
    if not match or not attempts.isdigit():
        parser.error(f"XPM_FAULT_EXIT_AT='{text}', XPM_FAULT_ATTEMPTS='{attempts}': expected RANK:STEP[:kill] "
                     f"and a whole number of attempts")
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) >= int(attempts):
        return None
    return int(match.group(1)), int(match.group(2)), match.group(3) is not None


def init_process_group(restart_count, timeout=datetime.timedelta(seconds=300)):
    """gloo from torchrun's variables. torchrun's agent hosts the store
    (TORCHELASTIC_USE_AGENT_STORE=True) and keeps it across restarts, with the last attempt's
    keys: each attempt keeps its keys under ``/worker/attempt_<k>``, else gloo can read a dead
    rank's address from the attempt before and fail to connect."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group("gloo", timeout=timeout)  # env://: rank 0 hosts the store
        return
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"/worker/attempt_{restart_count}", store),
                            rank=rank, world_size=world_size, timeout=timeout)


def checkpoints(directory):
    """(step, path) of every checkpoint file in ``directory``, newest first."""
    found = []
    if directory.is_dir():
        for path in directory.iterdir():
            match = CHECKPOINT_NAME.fullmatch(path.name)
            if match:
                found.append((int(match.group(1)), path))
    return sorted(found, reverse=True)


def load_newest_checkpoint(directory):
    """The newest checkpoint of ``directory`` that loads, and its path; (None, None) when none does.
    Tensors, numbers and strings only, so ``weights_only=True`` loads it."""
    for _, path in checkpoints(directory):
        try:
            return torch.load(path, weights_only=True), path
        except Exception as error:  # noqa: BLE001 - a damaged file: try the one before it
            print(f"train.py: skipping checkpoint {path}: {error}", file=sys.stderr)
    return None, None


def save_atomically(state, path):
    """torch.save to a temporary file beside ``path``, then rename: a reader never sees half a file."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save(state, temporary)
    os.replace(temporary, path)


def main():
    # One function of about 200 lines on purpose: the example reads top to bottom as the
    # numbered steps of a training script (0. processes ... 6. summary), the order a user copies.
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="data/brown")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--outer-batch-size", type=int, default=64, help="sentences per optimizer step (all ranks)")
    parser.add_argument("--memory-cap-bytes", type=int, default=60_000_000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--checkpoint-dir", type=pathlib.Path,
                        help="where rank 0 writes checkpoints (model, optimizer, sampler, RNG, memory model)")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: none)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest checkpoint (implied under torchrun after a restart)")
    parser.add_argument("--save-parameters", type=pathlib.Path,
                        help="rank 0 writes the final parameters here (torch.save of the state dict)")
    args = parser.parse_args()
    if min(args.steps, args.outer_batch_size, args.memory_cap_bytes, args.threads) < 1:
        parser.error("--steps, --outer-batch-size, --memory-cap-bytes and --threads must be >= 1")
    if args.checkpoint_every < 0:
        parser.error(f"--checkpoint-every must be >= 0, got {args.checkpoint_every}")
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if (args.checkpoint_every or args.resume) and args.checkpoint_dir is None:
        parser.error("--checkpoint-every and --resume need --checkpoint-dir")
    resume = args.resume or (restart_count > 0 and args.checkpoint_dir is not None)
    fault = fault_hook(parser)
    torch.set_num_threads(args.threads)
    torch.manual_seed(1)

    # 0. Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set): one process per rank.
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if distributed:
        init_process_group(restart_count)
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)

    def share(value):
        """Rank 0's ``value`` on every rank (a picklable object)."""
        if not distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    sentences = read_brown(args.data_dir)
    lengths = np.array([len(s) for s in sentences])

    # 1. The meter before the model (it must see the weights), then the cap.
    meter = xpm.CpuMeter.install()
    model = CharTransformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    meter.capacity_bytes = args.memory_cap_bytes
    budget = xpm.MemoryBudget(args.memory_cap_bytes)

    # 2. Resume: rank 0 picks the newest checkpoint that loads, every rank reads that file.
    checkpoint, path = None, None
    if resume:
        path = share(load_newest_checkpoint(args.checkpoint_dir)[1] if rank == 0 else None)
        if path is not None:
            checkpoint = torch.load(path, weights_only=True)
        elif rank == 0:
            print(f"no checkpoint in {args.checkpoint_dir} yet: starting from step 0", flush=True)
    elif restart_count > 0 and rank == 0:
        print(f"restart {restart_count} without --checkpoint-dir: starting from step 0", flush=True)

    # 3. The memory model: the checkpoint's, or rank 0 probes the step on random characters and
    #    fits it, and every rank (rank 0 too) plans with the same JSON, so all plans are identical.
    if checkpoint is not None:
        model_json = checkpoint["memory_model"]
        if rank == 0:
            print(f"resumed from step {checkpoint['step']} ({path.name}, restart {restart_count})", flush=True)
    else:
        model_json = None
        if rank == 0:
            formula = xpm.CostFormula("a*bs*l^2 + b*bs*l + d*bs + c", ["bs", "l"])
            probed = xpm.probe(model, optimizer,
                               lambda dims: model(torch.randint(1, VOCAB, (int(dims[0]), int(dims[1])))),
                               formula, meter=meter, variable_max={"bs": args.outer_batch_size, "l": int(lengths.max())},
                               design_fractions=(1.0, 0.5, 0.25, 0.125))  # most sentences are short
            model_json = probed.model.to_json()
            print(f"model: {probed.model.formula.canonical}, floor {probed.model.floor_bytes:.0f} bytes; "
                  f"{len(probed.probes)} probes ({sum(not p.feasible for p in probed.probes)} out of memory) in "
                  f"{probed.probe_s:.1f} s; usable {budget.usable_bytes} of {args.memory_cap_bytes} bytes")
        model_json = share(model_json)
    memory_model = xpm.MemoryModel.from_json(model_json)

    # 4. The sampler: outer batches of --outer-batch-size sentences, each split among the ranks
    #    and packed into microbatches under the budget; each microbatch's mean loss weighted by
    #    its share of the outer batch's characters (times the world size: DDP averages).
    sampler = xpm.PredictiveBatchSampler(lengths, memory_model, budget.usable_bytes,
                                         outer_batch_size=args.outer_batch_size, rank=rank,
                                         world_size=world_size, seed=1, units=lengths - 1)
    steps = epoch = 0
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        sampler.load_state_dict(checkpoint["sampler"])
        torch.set_rng_state(checkpoint["rng"])
        steps, epoch = checkpoint["step"], checkpoint["sampler"]["epoch"]
        if checkpoint["sampler"]["steps_done"] >= sampler.steps_per_epoch():
            epoch += 1  # the checkpoint ends its epoch
            sampler.set_epoch(epoch)
        del checkpoint
    else:
        sampler.set_epoch(0)
    # Every rank starts from rank 0's parameters (DDP broadcasts them); gradients are views of
    # DDP's all-reduce buckets, so the ranks hold no copy beyond the probed steady state.
    trained = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True) if distributed else model

    def write_checkpoint():
        directory = args.checkpoint_dir
        directory.mkdir(parents=True, exist_ok=True)
        state = {"step": steps, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "sampler": sampler.state_dict(), "rng": torch.get_rng_state(), "memory_model": model_json}
        save_atomically(state, directory / f"checkpoint-step{steps:08d}.pt")
        for _, old in checkpoints(directory)[KEPT_CHECKPOINTS:]:
            old.unlink(missing_ok=True)

    # 5. Train.
    ooms = microbatches = characters = 0
    worst_under = max_error = plan_s = 0.0
    planned_steps = 0
    first_step = steps
    start = time.perf_counter()
    step_begins = True
    while steps < args.steps:
        plan_start = time.perf_counter()
        planned_steps += len(list(sampler.steps()))  # the epoch's plan, kept for the loop below
        plan_s += time.perf_counter() - plan_start
        for indices, weight, last in xpm.microbatch_loop(iter(sampler), sampler):
            if step_begins and fault is not None and fault[:2] == (rank, steps + 1):
                sys.stdout.flush()
                if fault[2]:
                    os.kill(os.getpid(), signal.SIGKILL)
                os._exit(17)
            step_begins = False
            sync = contextlib.nullcontext() if last or not distributed else trained.no_sync()
            meter.reset_peak()
            try:
                with sync:
                    if indices:
                        batch = encode([sentences[i] for i in indices])
                        units = float(sum(len(sentences[i]) - 1 for i in indices))
                        (weight * trained(batch) / units).backward()
                    else:  # no records for this rank in this step: join the all-reduce with zeros
                        units = 0.0
                        (0.0 * trained(torch.tensor([[1, 0]]))).backward()  # one character, no target
            except RuntimeError as error:
                if "out of memory" not in str(error).lower():
                    raise
                if distributed:  # the other ranks' all-reduce would wait for this rank
                    raise RuntimeError(f"rank {rank} ran out of memory in a microbatch of {len(indices)} "
                                       f"sentences under DDP: raise --memory-cap-bytes") from None
                ooms += 1
            else:
                measured = meter.peak_allocated_bytes
                if indices:
                    predicted = memory_model.predict([len(indices), batch.size(1)])
                    if measured > memory_model.floor_bytes:  # where the formula, not the floor, binds
                        error = (predicted - measured) / measured
                        worst_under, max_error = min(worst_under, error), max(max_error, abs(error))
            microbatches += 1
            characters += int(units)
            if last:
                optimizer.step()
                optimizer.zero_grad(set_to_none=False)
                steps += 1
                step_begins = True
                if rank == 0 and args.checkpoint_every and steps % args.checkpoint_every == 0:
                    write_checkpoint()
                if steps == args.steps:
                    break
        if steps < args.steps:
            epoch += 1
            sampler.set_epoch(epoch)
    elapsed = time.perf_counter() - start

    # 6. The summary, over every rank.
    per_rank = [microbatches]
    if distributed:
        counts = torch.tensor([microbatches, characters, ooms], dtype=torch.float64)
        gathered = [torch.zeros_like(counts) for _ in range(world_size)]
        dist.all_gather(gathered, counts)
        per_rank = [int(c[0]) for c in gathered]
        microbatches, characters, ooms = (int(sum(c[k] for c in gathered)) for k in range(3))
        errors = torch.tensor([-worst_under, max_error], dtype=torch.float64)
        dist.all_reduce(errors, op=dist.ReduceOp.MAX)
        worst_under, max_error = -float(errors[0]), float(errors[1])
    if rank == 0:
        if args.save_parameters is not None:
            args.save_parameters.parent.mkdir(parents=True, exist_ok=True)
            save_atomically(model.state_dict(), args.save_parameters)
        step_s = max(elapsed - plan_s, 1e-9) / max(1, steps - first_step)
        planned_steps = max(1, planned_steps)
        ranks = f"; world size {world_size}, microbatches per rank {per_rank}" if distributed else ""
        print(f"steps {steps}, microbatches {microbatches}, OOM {ooms}, worst under-prediction "
              f"{100 * worst_under:.2f} %, max |prediction error| {100 * max_error:.2f} %, "
              f"{characters / elapsed:.0f} real characters/s; sampler {1000 * plan_s / planned_steps:.2f} ms "
              f"per outer batch ({100 * plan_s / planned_steps / step_s:.2f} % of a training step){ranks}", flush=True)
    if distributed:
        dist.barrier()  # rank 0's files are written before any rank exits
        dist.destroy_process_group()
    return 0 if ooms == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
