#!/usr/bin/env python3
"""A byte-level Llama causal language model (2 layers, width 64, built from a config: nothing is
downloaded) trained by the Hugging Face ``transformers.Trainer`` under a memory cap, every
optimizer step one outer batch of sentences that xpm splits into microbatches predicted to fit.

    PYTHONPATH=build/python python examples/hf_trainer_causal_lm/train.py \\
        --data-dir data/brown --steps 20 --output-dir /tmp/hf-planned
    ... --device cuda --memory-cap-bytes 200000000      # on a GPU: the cap is enforced by torch

On the CPU the cap is ``xpm.CpuMeter``'s; on a GPU, ``CudaMeter.set_memory_fraction`` of the
device's memory (torch's per-process fraction), so a microbatch over it raises
``torch.OutOfMemoryError`` for real.

Text: the sentences of the Brown corpus in ``--data-dir`` (cut after 256 bytes), or, without
one, generated sentences of varied lengths. Prints the fitted memory model, then one line:
steps, microbatches, OOM count, the worst prediction error of the microbatch peaks where the
formula (not the floor) binds, and from the third step the error of the calibrated plan (the
prediction plus the sampler's correction); exit code 1 if any allocation ran over the cap.
"""
import argparse
import pathlib
import re
import sys
import time

import numpy as np
import torch

import xpm

MAX_BYTES = 256
WORDS = ("the of and to a in that is was he for it with as his on be at by I this had not are but from or have an "
         "they which one you were her all she there would their we him been has when who will more no if out so said "
         "what up its about into than them can only other new some could time these two may then do first any my "
         "now such like our over man me even most made after also did many before must through back years where "
         "much your way well down should because each just those people how too little state good very make world "
         "still own see men work long get here between both life being under never day same another know while "
         "last might us great old year off come since against go came right used take three").split()


def read_brown(data_dir, max_bytes=MAX_BYTES):
    """Every sentence of the Brown corpus in ``data_dir`` (the words of its word/tag tokens),
    as UTF-8 bytes cut after ``max_bytes``; sentences under 5 bytes are left out."""
    files = sorted(p for p in pathlib.Path(data_dir).iterdir() if re.fullmatch(r"c[a-r]\d\d", p.name))
    if not files:
        raise FileNotFoundError(f"'{data_dir}' holds no Brown corpus files (ca01, ...)")
    sentences = []
    for path in files:
        for line in path.read_text().splitlines():
            text = " ".join(token.rsplit("/", 1)[0] for token in line.split()).encode()
            if len(text) >= 5:
                sentences.append(text[:max_bytes])
    return sentences


def generated_sentences(count, seed=0, max_bytes=MAX_BYTES):
    """``count`` sentences of words drawn from a list, their word counts log-normal (median 18,
    as Brown's), as bytes cut after ``max_bytes``."""
    rng = np.random.default_rng(seed)
    sentences = []
    for words in np.clip(rng.lognormal(np.log(18), 0.6, count).astype(int), 2, 80):
        text = " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), words)).capitalize() + "."
        sentences.append(text.encode()[:max_bytes])
    return sentences


class ByteRecords(torch.utils.data.Dataset):
    """Record i: ``{"input_ids": [bytes of sentence i]}``."""

    def __init__(self, sentences):
        self.sentences = sentences

    def __len__(self):
        return len(self.sentences)

    def __getitem__(self, i):
        return {"input_ids": list(self.sentences[i])}


def pad_collate(records):
    """Pads byte records on the right to the longest: input ids (0 past the end), an attention
    mask, and labels (the ids, -100 past the end; the model shifts them)."""
    length = max(len(r["input_ids"]) for r in records)
    ids = torch.zeros(len(records), length, dtype=torch.long)
    mask = torch.zeros(len(records), length, dtype=torch.long)
    for row, record in enumerate(records):
        ids[row, :len(record["input_ids"])] = torch.tensor(record["input_ids"])
        mask[row, :len(record["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask.eq(0), -100)}


def build_model(seed=0):
    """A Llama causal LM with 2 layers, width 64 (MLP 128), 4 heads, a 256-byte vocabulary and no
    dropout, in float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=MAX_BYTES,
                         attention_dropout=0.0, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    return LlamaForCausalLM(config).float()


def probe_memory(model, optimizer, meter, max_length, max_batch=64):
    """Probes the model's training step on random bytes, on the device of the model's parameters,
    and fits ``a*bs*l^2 + b*bs*l + c`` (``bs`` sentences, ``l`` the longest one's bytes)."""
    device = next(model.parameters()).device

    def loss_of(dims):
        # Random bytes with one padded position, as real microbatches have: a mask of all ones
        # lets the attention skip the mask (another, smaller kernel) and the probes would miss it.
        bs, l = int(dims[0]), int(dims[1])
        ids = torch.randint(1, 256, (bs, l), device=device)
        mask = torch.ones_like(ids)
        mask[0, -1] = 0
        return model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask.eq(0), -100)).loss

    formula = xpm.CostFormula("a*bs*l^2 + b*bs*l + c", ["bs", "l"])
    return xpm.probe(model, optimizer, loss_of, formula, meter=meter,
                     variable_max={"bs": max_batch, "l": max_length}, design_fractions=(1.0, 0.5, 0.25, 0.125))


def oom_count(meter):
    """Allocations refused over the cap so far: the ``CpuMeter``'s count, or on a GPU the caching
    allocator's (``num_ooms``)."""
    if isinstance(meter, xpm.CpuMeter):
        return meter.oom_count
    return int(torch.cuda.memory_stats(meter.device).get("num_ooms", 0))


def install_meter(device, cap_bytes):
    """The meter of ``device`` under a cap of ``cap_bytes``: on the CPU ``xpm.CpuMeter``
    (installed now, before the model is built, its cap set after the model is built), on a GPU
    ``xpm.CudaMeter`` with torch's caching allocator limited to the cap."""
    if device == "cpu":
        meter = xpm.CpuMeter.install()
        meter.capacity_bytes = 0
        return meter
    meter = xpm.CudaMeter(device)
    total_bytes = meter.capacity_bytes
    if cap_bytes > total_bytes:
        raise SystemExit(f"--memory-cap-bytes {cap_bytes}: more than {meter.device}'s {total_bytes} bytes")
    meter.set_memory_fraction(cap_bytes / total_bytes)
    return meter


def calibrated_errors(measured, floor_bytes, from_step=3):
    """(planned - measured) / measured of every microbatch from ``from_step`` whose peak is above
    ``floor_bytes``, planned being the prediction plus the calibration's correction."""
    return [(r.predicted_bytes + r.correction_bytes - r.peak_allocated_bytes) / r.peak_allocated_bytes
            for r in measured if r.step >= from_step and r.predicted_bytes is not None
            and r.peak_allocated_bytes > floor_bytes]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="data/brown", help="Brown corpus folder (generated text without it)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (outer batches)")
    parser.add_argument("--outer-batch-size", type=int, default=32, help="sentences per optimizer step")
    parser.add_argument("--memory-cap-bytes", type=int, default=24_000_000, help="memory cap, bytes")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the model trains")
    parser.add_argument("--output-dir", default="hf_trainer_causal_lm_output", help="the Trainer's output_dir")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if min(args.steps, args.outer_batch_size, args.memory_cap_bytes, args.threads) < 1:
        parser.error("--steps, --outer-batch-size, --memory-cap-bytes and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    if pathlib.Path(args.data_dir).is_dir():
        sentences, source = read_brown(args.data_dir), f"Brown corpus in {args.data_dir}"
    else:
        sentences, source = generated_sentences(4000), "generated sentences (no Brown corpus folder)"
    lengths = np.array([len(s) for s in sentences])
    print(f"text: {len(sentences)} {source}, {lengths.min()} to {lengths.max()} bytes")

    from transformers import TrainingArguments
    from xpm.integrations.hf_trainer import PlannedTrainer

    # 1. The meter before the model (it must see the weights); the probes and the run under the cap.
    meter = install_meter(args.device, args.memory_cap_bytes)
    model = build_model().to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    if args.device == "cpu":
        meter.capacity_bytes = args.memory_cap_bytes
    probed = probe_memory(model, optimizer, meter, int(lengths.max()), max_batch=args.outer_batch_size)
    budget = xpm.MemoryBudget(args.memory_cap_bytes)
    print(f"model: {probed.model.formula.canonical}, floor {probed.model.floor_bytes:.0f} bytes; "
          f"{len(probed.probes)} probes ({sum(not p.feasible for p in probed.probes)} out of memory) in "
          f"{probed.probe_s:.1f} s, fit max error {100 * probed.fit.max_rel_error:.2f} %; usable {budget.usable_bytes} of {args.memory_cap_bytes} bytes")

    # 2. The planned Trainer: one outer batch per optimizer step, label tokens as the units.
    sampler = xpm.PredictiveBatchSampler(lengths, probed.model, budget.usable_bytes,
                                         outer_batch_size=args.outer_batch_size, seed=1, units=lengths - 1)
    measured = []
    training = TrainingArguments(output_dir=args.output_dir, max_steps=args.steps, gradient_accumulation_steps=1,
                                 learning_rate=2e-3, lr_scheduler_type="constant", logging_steps=max(1, args.steps // 4),
                                 save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=args.device == "cpu",
                                 dataloader_pin_memory=False, seed=1)
    trainer = PlannedTrainer(model=model, args=training, train_dataset=ByteRecords(sentences), data_collator=pad_collate,
                             optimizers=(optimizer, None), batch_sampler=sampler, meter=meter,
                             on_microbatch=measured.append)
    ooms = oom_count(meter)
    start = time.perf_counter()
    try:
        result = trainer.train()
    except torch.OutOfMemoryError as error:
        print(f"out of memory: {str(error).splitlines()[0]}")
        result = None
    elapsed = time.perf_counter() - start
    ooms = oom_count(meter) - ooms

    # 3. Prediction error of every microbatch where the formula binds (peak above the floor).
    errors = []
    for record in measured:
        l = int(lengths[list(record.records)].max())
        if record.peak_allocated_bytes > probed.model.floor_bytes:
            predicted = probed.model.predict([len(record.records), l])
            errors.append((predicted - record.peak_allocated_bytes) / record.peak_allocated_bytes)
    worst = max(errors, key=abs) if errors else 0.0
    under = min(errors + [0.0])
    calibrated = calibrated_errors(measured, probed.model.floor_bytes)
    if calibrated:
        print(f"from step 3, calibrated plan: {100 * min(calibrated):+.2f} % to {100 * max(calibrated):+.2f} % over "
              f"{len(calibrated)} microbatches; calibration: {'; '.join(sampler.calibration.log[-3:]) or 'unchanged'}")
    if args.device == "cuda":
        print(f"largest microbatch peak {max(r.peak_allocated_bytes for r in measured)} bytes allocated, "
              f"{torch.cuda.max_memory_reserved(meter.device)} reserved, of {args.memory_cap_bytes}")
    steps = trainer.state.global_step
    tokens = int(sum(lengths[list(r.records)].sum() for r in measured))
    loss = f", training loss {result.training_loss:.3f} nats/byte" if result is not None else ""
    print(f"steps {steps}, microbatches {len(measured)}, OOM {ooms}, max |prediction error| {100 * abs(worst):.2f} % "
          f"(worst under-prediction {100 * under:.2f} %, {len(errors)} microbatches above the floor), {tokens / elapsed:.0f} bytes/s{loss}")
    return 0 if ooms == 0 and result is not None else 1


if __name__ == "__main__":
    sys.exit(main())
