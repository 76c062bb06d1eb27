"""The byte-level Llama of the HF Trainer tests: Brown sentences (or generated ones) as byte
records, a padding collator, a 2-layer Llama built from a config (nothing is downloaded), and a
probe of its plain forward on random bytes, for the tests that build the sampler themselves.
"""
import pathlib
import re

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
