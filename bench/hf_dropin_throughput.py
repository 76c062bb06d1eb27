#!/usr/bin/env python3
"""Real tokens per second of four ways a user of the Hugging Face ``transformers.Trainer``
trains under one CPU memory cap, on the same records, the same model and the same records per
optimizer step (8 per device x 4 accumulation steps = 32):

- drop-in: ``xpm.integrations.hf_trainer.PlannedTrainer`` with its defaults (no sampler, formula
  ``"auto"``, its default packer), run twice as a user runs a job again: the first run probes its
  own step and caches the fitted model (its probe time is inside the run's time and also reported
  apart), the second starts from the cache without probing;
- auto_find_batch_size: the plain Trainer with ``auto_find_batch_size=True``, 32 per device and
  no accumulation (accelerate's ``find_executable_batch_size`` multiplies the batch by 0.9 after
  each out-of-memory error it recognises, so the records per step shrink). It recognises errors
  by their message, and ``xpm.CpuMeter``'s ("CPU memory cap exceeded ...", a
  ``torch.OutOfMemoryError``) is not among them: train() raises at the first one. What its user
  then has to do is measured: restart by hand, the batch cut by the same 0.9, until a run passes;
- token budget: each outer batch of 32 records sorted by length and packed greedily while a
  microbatch's padded tokens (records x longest) stay within T, T the largest that trains
  without running out of memory, found as users find it (from 32 x the longest record, down
  15 % after each out-of-memory run). The Trainer's loop takes a fixed
  ``gradient_accumulation_steps`` items per optimizer step, so a varying number of microbatches
  cannot be given to it as items: this is the plain Trainer with one loader item per optimizer
  step (the step's collated microbatches) and a ``training_step`` that runs the Trainer's own
  ``training_step`` on each with the outer batch's label count as ``num_items_in_batch`` (the
  gradient is the outer batch's), what such a user writes;
- fixed batch: the plain Trainer, ``per_device_train_batch_size=m`` and
  ``gradient_accumulation_steps=32/m``, m the largest that trains without running out of memory
  (halved from 32).

Every run is one epoch over the same records, from the same initial weights (the model rebuilt
for each run, with ``torch.manual_seed`` before and the meter's cap at 0 while it is built), in
a fresh Trainer. A run that runs out of memory stops at the first error (a try, as a user's
would be). Real tokens: the non-padding tokens trained (the records' bytes); tokens/s is over
train()'s wall time, probing included. Once every way has found its setting, each setting is run
again (``--repeats`` runs in all, the ways interleaved) and tokens/s per run is the median: one
run's figure moves by up to 15 % with the machine's load. Prints a markdown table and writes JSON
(``--json``).

    PYTHONPATH=build/python OMP_NUM_THREADS=1 python bench/hf_dropin_throughput.py \\
        --data-dir data/brown --records 4096 --json runs/bench/hf-dropin.json
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from typing import Any, Callable, Dict, List, Optional, Sequence  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from accelerate.utils.memory import should_reduce_batch_size  # noqa: E402

import xpm  # noqa: E402
from xpm.integrations.hf_trainer import PlannedTrainer  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
PER_DEVICE, ACCUMULATION = 8, 4
OUTER = PER_DEVICE * ACCUMULATION
AUTO_FACTOR = 0.9  # accelerate's find_executable_batch_size: the batch times 0.9 after an OOM
BUDGET_FACTOR = 0.85  # the token budget: down 15 % after an OOM


def _byte_llama() -> Any:
    """The helpers of the HF Trainer tests (tests/python/integrations/byte_llama.py): the byte
    Llama, the Brown reader and the padding collator.

    Returns:
        The loaded module.
    """
    path = ROOT / "tests" / "python" / "integrations" / "byte_llama.py"
    spec = importlib.util.spec_from_file_location("byte_llama", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


byte_llama = _byte_llama()


@dataclass
class Run:
    """One train() call.

    Attributes:
        setting: what was set (e.g. "m=8", "T=4096 tokens").
        train_s: train()'s wall time, seconds (to the error for a run that ran out of memory).
        ooms: out-of-memory errors during training (probes' own left out).
        steps: optimizer steps taken.
        tokens: non-padding tokens trained (the Trainer's ``num_input_tokens_seen``).
        first_step_s: seconds from train()'s start to the end of the first optimizer step.
        probe_s: the drop-in's probing and fitting time, seconds (0 for the others).
        probes: the drop-in's probes; probe_ooms: how many of them ran out of memory.
        report: the drop-in's start-up line.
        raised: train() ended with an out-of-memory error.
        recognised: for a run that raised, whether accelerate's ``should_reduce_batch_size``
            (what ``auto_find_batch_size`` retries on) takes the error for an out-of-memory one.
    """

    setting: str
    train_s: float = 0.0
    ooms: int = 0
    steps: int = 0
    tokens: int = 0
    first_step_s: Optional[float] = None
    probe_s: float = 0.0
    probes: int = 0
    probe_ooms: int = 0
    report: str = ""
    raised: bool = False
    recognised: Optional[bool] = None


@dataclass
class Way:
    """One way of training: its tries (the last one passed) and their total time.

    Attributes:
        name: the row's name.
        tries: every run, in order; all but the last ran out of memory.
        note: what the table should say about it.
        again: runs the setting that trained once more (a fresh trainer, a fresh model).
        repeats: the runs ``again`` made.
    """

    name: str
    tries: List[Run] = field(default_factory=list)
    note: str = ""
    again: Optional[Callable[[], Run]] = None
    repeats: List[Run] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        """Real tokens/s of the setting that trained: the median over its run and its repeats
        (the same setting run again, interleaved with the other ways')."""
        return float(np.median([run.tokens / run.train_s for run in [self.final] + self.repeats]))

    @property
    def final(self) -> Run:
        """The last try: the run that trained the epoch."""
        return self.tries[-1]

    @property
    def all_tries_s(self) -> float:
        """train()'s wall time summed over every try, seconds."""
        return sum(run.train_s for run in self.tries)

    @property
    def first_good_step_s(self) -> float:
        """What a user waits for the first step of the run that trains: the failed tries' time,
        then the last try's time to its first step, seconds."""
        return sum(run.train_s for run in self.tries[:-1]) + self.final.first_step_s


class FirstStep(transformers.TrainerCallback):
    """The time of the first optimizer step's end, from ``start_s`` (``time.perf_counter``)."""

    def __init__(self) -> None:
        self.start_s = 0.0
        self.first_step_s: Optional[float] = None

    def on_step_end(self, args: transformers.TrainingArguments, state: transformers.TrainerState,
                    control: transformers.TrainerControl, **kwargs: Any) -> None:
        """Records the first optimizer step's end."""
        if self.first_step_s is None:
            self.first_step_s = time.perf_counter() - self.start_s


class TokenBudgetTrainer(transformers.Trainer):
    """The plain Trainer whose loader yields one optimizer step per item (``{"microbatches":
    [collated, ...]}``, the step's token-budget microbatches) and whose ``training_step`` runs the
    Trainer's own on each, normalised by the outer batch's label tokens.

    Args:
        steps: per optimizer step, its microbatches' dataset indices.
        *args: as ``transformers.Trainer`` (``gradient_accumulation_steps`` 1).
        **kwargs: as ``transformers.Trainer``.
    """

    def __init__(self, *args: Any, steps: List[List[List[int]]], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.steps = steps

    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        """One item per optimizer step, in the order of ``steps``.

        Returns:
            A DataLoader of ``{"microbatches": [collated microbatch, ...]}``.
        """
        dataset, collate = self.train_dataset, self.data_collator

        def collate_step(step: List[List[int]]) -> Dict[str, Any]:
            return {"microbatches": [collate([dataset[i] for i in mb]) for mb in step]}

        return torch.utils.data.DataLoader(self.steps, batch_size=None, shuffle=False, collate_fn=collate_step)

    def training_step(self, model: torch.nn.Module, inputs: Dict[str, Any],
                      num_items_in_batch: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The Trainer's own ``training_step`` on each microbatch (all but the last without
        gradient sync), each loss over the outer batch's label tokens.

        Args:
            model: the (wrapped) model.
            inputs: one loader item (``{"microbatches": [...]}``).
            num_items_in_batch: unused (the Trainer cannot count an item of microbatches).

        Returns:
            The step's loss, detached.
        """
        batches = inputs["microbatches"]
        count = self._get_num_items_in_batch(batches, self.args.device)
        losses = []
        for k, batch in enumerate(batches):
            sync = contextlib.nullcontext() if k == len(batches) - 1 else self.accelerator.no_sync(model)
            with sync:
                losses.append(super().training_step(model, batch, count))
        return torch.stack(losses).sum()

    def floating_point_ops(self, inputs: Dict[str, Any]) -> int:
        """The step's floating point operations: the sum over its microbatches."""
        return sum(super(TokenBudgetTrainer, self).floating_point_ops(b) for b in inputs["microbatches"])

    def _track_num_input_tokens(self, inputs: Dict[str, Any]) -> None:
        """Non-padding input tokens seen, summed over the step's microbatches."""
        self.state.num_input_tokens_seen += sum(int(b["attention_mask"].sum()) for b in inputs["microbatches"])


def sentences(data_dir: str, count: int, max_bytes: int) -> List[bytes]:
    """``count`` Brown sentences (a seeded sample, cut at ``max_bytes``), else generated ones."""
    if pathlib.Path(data_dir).is_dir():
        texts = byte_llama.read_brown(data_dir, max_bytes)
        if len(texts) >= count:
            return random.Random(1).sample(texts, count)
    return byte_llama.generated_sentences(count, max_bytes=max_bytes)


def fresh_model(meter: xpm.CpuMeter, cap_bytes: int) -> torch.nn.Module:
    """The byte Llama from seed 0, built with the meter's cap at 0, then capped at ``cap_bytes``."""
    meter.capacity_bytes = 0
    gc.collect()
    model = byte_llama.build_model(seed=0)
    meter.capacity_bytes = cap_bytes
    return model


def training_arguments(output_dir: str, per_device: int, accumulation: int,
                       **extra: Any) -> transformers.TrainingArguments:
    """The Trainer's arguments of every run: one epoch, constant learning rate, no logging or
    saving, on the CPU, non-padding input tokens counted.

    Args:
        output_dir: the output folder.
        per_device: ``per_device_train_batch_size``.
        accumulation: ``gradient_accumulation_steps``.
        **extra: more ``TrainingArguments`` keywords.

    Returns:
        The arguments.
    """
    options = dict(output_dir=output_dir, num_train_epochs=1, learning_rate=2e-3, lr_scheduler_type="constant",
                   per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation,
                   logging_strategy="no", save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True,
                   dataloader_pin_memory=False, include_num_input_tokens_seen="non_padding", seed=1)
    options.update(extra)
    return transformers.TrainingArguments(**options)


def clear_after_oom(meter: xpm.CpuMeter) -> None:
    """A retry starts clean, as a restarted job would: the failed graph and the autograd engine's
    buffers go (a tiny backward without the cap)."""
    cap, meter.capacity_bytes = meter.capacity_bytes, 0
    gc.collect()
    torch.zeros(1, requires_grad=True).sum().backward()
    meter.capacity_bytes = cap


def train_once(meter: xpm.CpuMeter, setting: str, make_trainer: Callable[[List], transformers.Trainer]) -> Run:
    """Builds a trainer (``make_trainer(callbacks)``) and trains it, stopping at an OOM.

    Args:
        meter: the installed CPU meter (its cap set).
        setting: the run's setting, for the table.
        make_trainer: builds the trainer given its callbacks.

    Returns:
        The run.
    """
    first = FirstStep()
    trainer = make_trainer([first])
    run, before = Run(setting), meter.oom_count
    first.start_s = time.perf_counter()
    try:
        with contextlib.redirect_stdout(sys.stderr):  # the Trainer prints its metrics
            trainer.train()
    except torch.OutOfMemoryError as error:
        run.raised, run.recognised = True, bool(should_reduce_batch_size(error))
        del error
        clear_after_oom(meter)
    run.train_s = time.perf_counter() - first.start_s
    run.first_step_s, run.steps = first.first_step_s, trainer.state.global_step
    run.tokens = int(trainer.state.num_input_tokens_seen)
    outcome = getattr(getattr(trainer, "xpm_memory", None), "outcome", None)
    if outcome is not None:
        run.probe_s, run.probes = outcome.probe_s, len(outcome.probes)
        run.probe_ooms = sum(not p.feasible for p in outcome.probes)
    run.report = (getattr(trainer, "xpm_report", None) or "").replace(trainer.args.output_dir, "<output_dir>")
    run.ooms = meter.oom_count - before - run.probe_ooms
    del trainer
    gc.collect()
    return run


class Bench:
    """The records, the cap and a scratch folder shared by every way.

    Args:
        meter: the installed CPU meter.
        texts: the records' bytes.
        cap_bytes: the meter's cap while training.
        output_dir: the Trainer's output folder (nothing is saved).
    """

    def __init__(self, meter: xpm.CpuMeter, texts: Sequence[bytes], cap_bytes: int, output_dir: str):
        self.meter, self.cap_bytes, self.output_dir = meter, cap_bytes, output_dir
        self.records = [{"input_ids": list(t)} for t in texts]
        self.lengths = np.array([len(t) for t in texts])

    def run(self, setting: str, trainer_class: type, per_device: int, accumulation: int, **kwargs: Any) -> Run:
        """One epoch of ``trainer_class`` on a fresh model, in a fresh trainer.

        Args:
            setting: the run's setting, for the table.
            trainer_class: ``transformers.Trainer`` or a subclass.
            per_device: ``per_device_train_batch_size``.
            accumulation: ``gradient_accumulation_steps``.
            **kwargs: the trainer's extra keywords; ``args_extra``: the ``TrainingArguments``' extra ones.

        Returns:
            The run.
        """
        arguments = training_arguments(self.output_dir, per_device, accumulation, **kwargs.pop("args_extra", {}))

        def make(callbacks: List) -> transformers.Trainer:
            return trainer_class(model=fresh_model(self.meter, self.cap_bytes), args=arguments,
                                 train_dataset=self.records, data_collator=byte_llama.pad_collate,
                                 callbacks=callbacks, **kwargs)

        run = train_once(self.meter, setting, make)
        print(f"  {setting}: {run.ooms} OOM, {run.steps} steps, {run.train_s:.1f} s", file=sys.stderr, flush=True)
        return run


def drop_in(bench: Bench) -> List[Way]:
    """``PlannedTrainer`` with its defaults: a first run that probes and fills its cache, then the
    same job again from the cache.

    Returns:
        The first run's way, then the second's.
    """
    cache_dir = os.path.join(bench.output_dir, "xpm-memory-models")
    first = bench.run("8 per device x 4, defaults, first run", PlannedTrainer, PER_DEVICE, ACCUMULATION,
                      cache_dir=cache_dir)
    again = bench.run("8 per device x 4, defaults, run again", PlannedTrainer, PER_DEVICE, ACCUMULATION,
                      cache_dir=cache_dir)
    if again.probes:
        raise RuntimeError(f"drop-in: the second run probed again ({again.probes} probes): the cache missed")
    fresh_caches = itertools.count(1)

    def probing_again() -> Run:
        return bench.run("8 per device x 4, defaults, first run", PlannedTrainer, PER_DEVICE, ACCUMULATION,
                         cache_dir=f"{cache_dir}-{next(fresh_caches)}")

    def cached_again() -> Run:
        run = bench.run("8 per device x 4, defaults, run again", PlannedTrainer, PER_DEVICE, ACCUMULATION,
                        cache_dir=cache_dir)
        if run.probes:
            raise RuntimeError(f"drop-in: a repeat from the cache probed ({run.probes} probes): the cache missed")
        return run

    return [Way("drop-in PlannedTrainer, probing", [first], f"probe {first.probe_s:.1f} s ({first.probes} probes)",
                probing_again),
            Way("drop-in PlannedTrainer, from its cache", [again], "no probes", cached_again)]


def auto_find_batch_size(bench: Bench) -> Way:
    """``auto_find_batch_size=True`` from 32 per device; after each OOM train() raises (the meter's
    error is not recognised), and the run is restarted with the batch times 0.9, as accelerate would."""
    way, size = Way("Trainer auto_find_batch_size"), OUTER
    while size >= 1:
        run = bench.run(f"{size} per device x 1", transformers.Trainer, size, 1,
                        args_extra={"auto_find_batch_size": True})
        way.tries.append(run)
        if not run.raised:
            way.note = auto_note(way)
            way.again = lambda size=size: bench.run(f"{size} per device x 1", transformers.Trainer, size, 1,
                                                    args_extra={"auto_find_batch_size": True})
            return way
        size = int(size * AUTO_FACTOR)
    raise RuntimeError("auto_find_batch_size: no batch size trains without running out of memory")


def auto_note(way: Way) -> str:
    """What the table says of ``auto_find_batch_size``'s tries: whether accelerate recognised the
    errors (it retries by itself) or train() raised them (restarted by hand)."""
    raised = [run for run in way.tries if run.raised]
    if not raised:
        return "retried by itself" if way.final.ooms else ""
    if any(run.recognised for run in raised):
        return "restarted by hand, though accelerate recognised some errors"
    return f"OOM not recognised, restarted by hand {len(raised)} times"


def fixed_batch(bench: Bench) -> Way:
    """m per device x 32/m accumulation steps, m halved from 32 until a run passes."""
    way, size = Way("fixed batch"), OUTER
    while size >= 1:
        run = bench.run(f"m={size} x {OUTER // size}", transformers.Trainer, size, OUTER // size)
        way.tries.append(run)
        if not run.raised:
            way.again = lambda size=size: bench.run(f"m={size} x {OUTER // size}", transformers.Trainer, size,
                                                    OUTER // size)
            return way
        size //= 2
    raise RuntimeError("fixed batch: even one record per microbatch runs out of memory")


def outer_batches(count: int, seed: int = 1) -> List[np.ndarray]:
    """The epoch's outer batches of ``OUTER`` records, in a seeded order."""
    order = np.random.default_rng(seed).permutation(count)
    return [order[k:k + OUTER] for k in range(0, count, OUTER)]


def token_budget_steps(batches: List[np.ndarray], lengths: np.ndarray, budget_tokens: int) -> List[List[List[int]]]:
    """Each outer batch sorted by length (longest first), packed while records x longest <= budget."""
    steps = []
    for batch in batches:
        microbatches, current = [], []
        for i in sorted(map(int, batch), key=lambda i: -lengths[i]):
            if current and (len(current) + 1) * lengths[current[0]] > budget_tokens:
                microbatches.append(current)
                current = []
            current.append(i)
        steps.append(microbatches + [current])
    return steps


def token_budget(bench: Bench) -> Way:
    """The largest padded-token budget, from 32 x the longest record down 15 % per OOM."""
    way, budget_tokens = Way("token budget"), int(OUTER * bench.lengths.max())
    batches = outer_batches(len(bench.lengths))
    while budget_tokens >= bench.lengths.max():
        steps = token_budget_steps(batches, bench.lengths, budget_tokens)
        run = bench.run(f"T={budget_tokens} tokens", TokenBudgetTrainer, OUTER, 1, steps=steps)
        way.tries.append(run)
        if not run.raised:
            way.again = lambda setting=run.setting, steps=steps: bench.run(setting, TokenBudgetTrainer, OUTER, 1,
                                                                           steps=steps)
            return way
        budget_tokens = int(budget_tokens * BUDGET_FACTOR)
    raise RuntimeError("token budget: no budget fits one record of the longest length")


def table(ways: List[Way], records: int, lengths: np.ndarray, cap_bytes: int) -> str:
    """The markdown table of the ways, then notes on the drop-in and ``auto_find_batch_size``.

    "drop-in / this" per run compares the drop-in's run from its cache with each way's run that
    trained (neither pays for finding its setting); over all tries, the drop-in's probing run
    (its probe paid) with every try of each way (their search paid)."""
    drop_in_run, cached_run = ways[0].final, ways[1].final
    drop_in_rate = ways[1].tokens_per_s
    lines = [f"{records} records ({lengths.min()}-{lengths.max()} bytes, {int(lengths.sum()):,} tokens), "
             f"{OUTER} records per optimizer step, cap {cap_bytes:,} bytes, one epoch per run\n",
             "| way | setting | tries | OOM during training | time to first step s | the same, failed tries included s "
             f"| real tokens/s, median of {1 + len(ways[0].repeats)} runs | drop-in / this | all tries s "
             "| tokens/s over all tries | drop-in / this |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    drop_in_overall = drop_in_run.tokens / ways[0].all_tries_s
    for way in ways:
        run = way.final
        rate = way.tokens_per_s
        overall = run.tokens / way.all_tries_s
        setting = run.setting + (f"; {way.note}" if way.note else "")
        lines.append(f"| {way.name} | {setting} | {len(way.tries)} | {sum(r.ooms for r in way.tries)} | "
                     f"{run.first_step_s:.2f} | {way.first_good_step_s:.2f} | {rate:,.0f} | "
                     f"{drop_in_rate / rate:.2f} | {way.all_tries_s:.1f} | {overall:,.0f} | "
                     f"{drop_in_overall / overall:.2f} |")
    lines += ["", f"- drop-in: {drop_in_run.report}; {drop_in_run.probe_ooms} probe(s) out of memory (not counted "
              f"above). Run again: {cached_run.report}.",
              "- drop-in / this: per run, the drop-in's runs from its cache against the setting that trained, "
              "medians of the runs of each (no way pays there for finding its setting); over all tries, the "
              "drop-in's probing run against every try.",
              "- runs per setting (real tokens/s): " + "; ".join(
                  f"{way.name} " + ", ".join(f"{r.tokens / r.train_s:,.0f}" for r in [way.final] + way.repeats)
                  for way in ways) + "."]
    lines += [auto_finding(way) for way in ways if way.name.startswith("Trainer auto_find")]
    lines += ["- OOM during training: the runs stopped by an out-of-memory error (each try stops at its first); "
              "all tries s: train()'s wall time summed over every try, the failed ones included; tokens/s over all "
              "tries: the epoch's real tokens over that time (what the search for a setting cost, or the probe)."]
    return "\n".join(lines)


def auto_finding(way: Way) -> str:
    """The note on ``auto_find_batch_size``: what accelerate did with the meter's errors."""
    raised = [run for run in way.tries if run.raised]
    final = way.final
    if not raised:
        return f"- auto_find_batch_size: its errors were retried inside train(); {final.steps} optimizer steps."
    verdict = "recognised some of" if any(run.recognised for run in raised) else "did not recognise"
    return (f"- auto_find_batch_size: accelerate's `should_reduce_batch_size` {verdict} the meter's "
            f"`torch.OutOfMemoryError` (\"CPU memory cap exceeded ...\"; it matches messages such as \"out of "
            f"memory.\"): train() raised it {len(raised)} times. Each time the run was restarted by hand with the "
            f"batch x {AUTO_FACTOR} (accelerate's own rule), from {OUTER} to {final.setting.split()[0]} per device "
            f"and no accumulation: {final.steps} optimizer steps of {final.setting.split()[0]} records, not "
            f"{OUTER}.")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="data/brown")
    parser.add_argument("--records", type=int, default=4096)
    parser.add_argument("--max-bytes", type=int, default=256, help="records cut after this many bytes")
    parser.add_argument("--memory-cap-bytes", type=int, default=24_000_000)
    parser.add_argument("--repeats", type=int, default=5,
                        help="runs of each way's setting that trained; tokens/s per run is their median")
    parser.add_argument("--json", help="writes the results here")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    meter = xpm.CpuMeter.install()  # before any model: the meter must see the weights
    texts = sentences(args.data_dir, args.records, args.max_bytes)
    with tempfile.TemporaryDirectory() as output_dir:
        bench = Bench(meter, texts, args.memory_cap_bytes, output_dir)
        ways = []
        for way_of in (drop_in, auto_find_batch_size, token_budget, fixed_batch):
            print(f"{way_of.__name__}:", file=sys.stderr, flush=True)
            found = way_of(bench)
            ways.extend(found if isinstance(found, list) else [found])
        for repeat in range(args.repeats - 1):  # interleaved: a slow minute of the machine hits every way
            print(f"repeat {repeat + 1}:", file=sys.stderr, flush=True)
            for way in ways:
                run = way.again()
                if run.raised:
                    raise RuntimeError(f"{way.name}: {run.setting} ran out of memory when run again")
                way.repeats.append(run)
    meter.capacity_bytes = 0
    expected = int(bench.lengths.sum())
    for way in ways:
        for run in [way.final] + way.repeats:
            if run.tokens != expected:
                raise RuntimeError(f"{way.name}: trained {run.tokens} tokens, the epoch holds {expected}")
    print(table(ways, args.records, bench.lengths, args.memory_cap_bytes))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(
            {"records": args.records, "cap_bytes": args.memory_cap_bytes, "tokens": expected,
             "ways": [{"name": w.name, "all_tries_s": w.all_tries_s, "tries": [asdict(r) for r in w.tries],
              "repeats": [asdict(r) for r in w.repeats], "tokens_per_s": w.tokens_per_s}
                      for w in ways]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
