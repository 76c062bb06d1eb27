#!/usr/bin/env python3
"""A byte-level Llama (2 layers, width 64 by default; built from a config, nothing downloaded) trained by
the Hugging Face Trainer under a memory cap. The one change from a plain Trainer is the class:
``PlannedTrainer`` probes the model through the Trainer's own step on the dataset's records,
fits its memory, and splits every outer batch (8 per device x 4 accumulation steps) into the
microbatches that fit.

    PYTHONPATH=build/python python examples/hf_trainer_causal_lm/train.py --data-dir data/brown
    ... --device cuda --memory-cap-bytes 400000000        # on a GPU: torch's per-process cap
    ... --width 1024 --layers 10                          # 105M parameters
"""
import argparse
import pathlib
import re

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

import xpm
from xpm.integrations.hf_trainer import PlannedTrainer


def sentences(data_dir, max_bytes=256):
    """Brown corpus sentences as byte records (``{"input_ids": [...]}``), or generated ones."""
    folder = pathlib.Path(data_dir)
    files = sorted(p for p in folder.iterdir() if re.fullmatch(r"c[a-r]\d\d", p.name)) if folder.is_dir() else []
    lines = [" ".join(t.rsplit("/", 1)[0] for t in line.split()) for p in files for line in p.read_text().splitlines()]
    if not files:
        g = torch.Generator().manual_seed(0)
        lines = [" ".join(["word"] * int(torch.randint(2, 60, (1,), generator=g))) for _ in range(4000)]
    return [{"input_ids": list(text.encode()[:max_bytes])} for text in lines if len(text) >= 5]


def pad_collate(records):
    """Pads to the longest record: ids (0 past the end), attention mask, labels (-100 past the end)."""
    ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(r["input_ids"]) for r in records], batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(r["input_ids"]), dtype=torch.long) for r in records],
                                           batch_first=True)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask.eq(0), -100)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="data/brown")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--output-dir", default="hf_trainer_causal_lm_output")
    for name, default in (("--steps", 20), ("--per-device-batch-size", 8), ("--memory-cap-bytes", 24_000_000),
                          ("--width", 64), ("--layers", 2)):  # --width: the hidden size, a multiple of 16
        parser.add_argument(name, type=int, default=default)
    args = parser.parse_args()
    if args.device == "cpu":  # the CPU's cap is xpm's meter (installed before the model is built)
        meter = xpm.CpuMeter.install()
    else:  # a GPU's is torch's per-process fraction
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap_bytes / total))
    torch.manual_seed(0)
    heads = args.width // 16
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=args.width, intermediate_size=2 * args.width,
                                         num_hidden_layers=args.layers, num_attention_heads=heads,
                                         num_key_value_heads=heads, max_position_embeddings=256,
                                         pad_token_id=0, bos_token_id=0, eos_token_id=0))
    if args.device == "cpu":
        meter.capacity_bytes = args.memory_cap_bytes
    training = TrainingArguments(output_dir=args.output_dir, max_steps=args.steps, learning_rate=2e-3,
                                 per_device_train_batch_size=args.per_device_batch_size, gradient_accumulation_steps=4,
                                 lr_scheduler_type="constant", logging_steps=5, save_strategy="no", report_to="none",
                                 disable_tqdm=True, use_cpu=args.device == "cpu", seed=1)
    trainer = PlannedTrainer(model=model, args=training, train_dataset=sentences(args.data_dir),
                             data_collator=pad_collate)
    result = trainer.train()
    print(trainer.xpm_report)
    ooms = (meter.oom_count if args.device == "cpu" else torch.cuda.memory_stats().get("num_ooms", 0)) - \
        trainer.xpm_memory.probe_ooms  # the probes' own out-of-memory errors are not training's
    print(f"steps {trainer.state.global_step}, OOM {ooms}, training loss {result.training_loss:.3f} nats/byte")
    return 0 if ooms == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
