"""Test models the planner has never seen, and a helper that measures its held-out error.

Each model is written here for the tests (none is bundled with xpm), small enough for a CPU
(a probe step well under a second), with its own optimizer and its own cost formula, the one a
user would write:

- ``seq2seq``: an encoder-decoder ``torch.nn.Transformer`` (source and target lengths ``ls``,
  ``lt``), Adam;
- ``cnn``: a 2-D CNN on images of any height ``h`` and width ``w``, Adagrad;
- ``char_lm``: a character language model whose blocks run under activation checkpointing
  (``torch.utils.checkpoint``, ``use_reentrant=False``), label smoothing, gradient clipping in
  the optimizer step, SGD with momentum;
- ``packed_lstm``: an LSTM over ``pack_padded_sequence`` batches (``l`` the padded length),
  RMSprop;
- ``packed_tokens``: embeddings of a padded batch, then only the real tokens, packed, through a
  wide MLP (``l`` the longest record, ``t`` the summed real tokens), RMSprop; probed with a
  sample of record lengths (``record_dims``: mixes of records) and held out on random mixes;
- ``moving_peak``: a pre-norm Transformer whose peak moves between the attention scores
  (``bs*heads*l^2``), a wide feed-forward (``bs*l*ff``) and a large vocabulary's logits
  (``bs*l*V``) as the shapes grow; a ``max(...)`` formula; AdamW.

``measure(spec, meter)`` builds the model (after the meter is installed, so it sees the
weights), probes it with ``xpm.probe``'s automatic design, then runs the same probe step at 16
random held-out shapes inside the probed range of every variable (each drawn on its own) and
compares ``model.predict(dims)`` with the measured step peak (the larger of the
forward/backward and the optimizer-step peaks).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

import xpm
from xpm.probe_executor import _SteadyState, _TorchExecutor  # the probe step itself, for the held-out shapes

HELD_OUT_SHAPES = 16


@dataclass
class ModelSpec:
    """One test model: how to build it, its batch at given dims, its formula and ranges.

    Attributes:
        name: the model's name in the test ids.
        variables: the formula's variables, the batch size first.
        formula: the user's cost formula (bytes).
        variable_max: the largest value of every variable (``xpm.probe``'s ``variable_max``).
        build: ``build()`` returns ``(module, optimizer, loss_fn)``; ``loss_fn(dims)`` builds a
            synthetic batch at ``dims`` and returns its summed loss (a scalar tensor).
        usable_max_rel_error: the fit's largest error at the probes that still makes it usable.
        formulas: the formulas to probe it with: "user" (``formula``) and "auto" (the planner
            chooses).
        aggregation: ``xpm.probe``'s aggregation (``{"t": "sum"}`` for a summed variable).
        record_sample: ``record_sample(seed)`` returns records like the model's training data
            (dims per record, batch-size column 1); given, the model is probed with them
            (``xpm.probe(record_dims=...)``, ``loss_fn(records)``) and held out on random mixes
            of another sample.
    """

    name: str
    variables: List[str]
    formula: str
    variable_max: Dict[str, int]
    build: Callable[[], Tuple[torch.nn.Module, torch.optim.Optimizer, Callable]]
    usable_max_rel_error: float = 0.05
    formulas: Tuple[str, ...] = ("user", "auto")
    aggregation: Dict[str, str] = field(default_factory=dict)
    record_sample: Optional[Callable[[int], List[List[float]]]] = None


@dataclass
class SuiteResult:
    """What ``measure`` found for one model.

    Attributes:
        name: the model's name.
        formula: the formula probed ("user": the spec's; "auto": chosen from the probes).
        probes: the number of probes the automatic design ran (out-of-memory ones included).
        probe_s: seconds ``xpm.probe`` took.
        fit_max_rel_error: the fit's largest relative error at the probes.
        loo_max_rel_error: the fit's leave-one-out largest relative error.
        held_out: ``(dims, measured bytes, predicted bytes)`` of every held-out shape.
        refusal: the planner's error message when it refused the fit (then no held-out shapes).
        chosen_formula: the fitted model's formula (the chosen one with "auto").
        adaptive: the adaptive design's report sentence.
    """

    name: str
    formula: str
    probes: int = 0
    probe_s: float = 0.0
    fit_max_rel_error: float = float("nan")
    loo_max_rel_error: float = float("nan")
    held_out: List[Tuple[List[int], float, float]] = field(default_factory=list)
    refusal: Optional[str] = None
    chosen_formula: str = ""
    adaptive: str = ""

    @property
    def errors(self) -> np.ndarray:
        """Signed relative errors (predicted - measured) / measured of the held-out shapes."""
        return np.array([(p - m) / m for _, m, p in self.held_out])

    @property
    def held_out_max(self) -> float:
        """The largest absolute held-out relative error."""
        return float(np.abs(self.errors).max()) if self.held_out else float("nan")

    @property
    def held_out_mean(self) -> float:
        """The mean absolute held-out relative error."""
        return float(np.abs(self.errors).mean()) if self.held_out else float("nan")

    @property
    def held_out_max_beyond_one_record(self) -> float:
        """The largest absolute held-out relative error of the shapes of two records or more."""
        errors = [abs(e) for (dims, _, _), e in zip(self.held_out, self.errors) if dims[0] > 1]
        return max(errors) if errors else float("nan")

    @property
    def worst(self) -> Tuple[List[int], float]:
        """The held-out shape of the largest absolute error and that error (signed)."""
        k = int(np.abs(self.errors).argmax())
        return self.held_out[k][0], float(self.errors[k])

    def line(self) -> str:
        """One report line: probes, probe time, fit and leave-one-out errors, held-out errors."""
        head = f"{self.name} ({self.formula}): {self.probes} probes in {self.probe_s:.1f} s"
        if self.refusal is not None:
            return f"{head}; refused: {self.refusal}"
        dims, error = self.worst
        return (f"{head}, fit max {100 * self.fit_max_rel_error:.2f} %, leave-one-out "
                f"{100 * self.loo_max_rel_error:.2f} %; held-out max {100 * self.held_out_max:.2f} % "
                f"(worst {100 * error:+.2f} % at {dims}), mean {100 * self.held_out_mean:.2f} %, at bs >= 2 max "
                f"{100 * self.held_out_max_beyond_one_record:.2f} %; "
                f"formula {self.chosen_formula}; {self.adaptive}")


# ---------------------------------------------------------------- the models

class Seq2Seq(torch.nn.Module):
    """Token ids -> encoder-decoder Transformer (d_model 32, 4 heads, 2+2 layers) -> target logits."""

    VOCAB = 64

    def __init__(self):
        super().__init__()
        self.source_embedding = torch.nn.Embedding(self.VOCAB, 32)
        self.target_embedding = torch.nn.Embedding(self.VOCAB, 32)
        self.transformer = torch.nn.Transformer(d_model=32, nhead=4, num_encoder_layers=2, num_decoder_layers=2,
                                                dim_feedforward=64, dropout=0.1, batch_first=True)
        self.head = torch.nn.Linear(32, self.VOCAB)

    def loss_sum(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        inputs, labels = target[:, :-1], target[:, 1:]
        mask = torch.nn.Transformer.generate_square_subsequent_mask(inputs.shape[1])
        hidden = self.transformer(self.source_embedding(source), self.target_embedding(inputs), tgt_mask=mask,
                                  tgt_is_causal=True)
        return F.cross_entropy(self.head(hidden).reshape(-1, self.VOCAB), labels.reshape(-1), reduction="sum")


def _build_seq2seq():
    model = Seq2Seq()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def loss_fn(dims):
        bs, ls, lt = (int(d) for d in dims)
        return model.loss_sum(torch.randint(0, Seq2Seq.VOCAB, (bs, ls)), torch.randint(0, Seq2Seq.VOCAB, (bs, lt + 1)))

    return model, optimizer, loss_fn


class ImageCnn(torch.nn.Module):
    """Images [bs, 3, h, w] -> 3 convolutions (one of stride 2) -> global average pool -> 10 classes."""

    def __init__(self):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(32, 32, 3, padding=1), torch.nn.ReLU())
        self.head = torch.nn.Linear(32, 10)

    def loss_sum(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        pooled = self.features(images).mean(dim=(2, 3))
        return F.cross_entropy(self.head(pooled), labels, reduction="sum")


def _build_cnn():
    model = ImageCnn()
    optimizer = torch.optim.Adagrad(model.parameters(), lr=1e-2)

    def loss_fn(dims):
        bs, h, w = (int(d) for d in dims)
        return model.loss_sum(torch.randn(bs, 3, h, w), torch.randint(0, 10, (bs,)))

    return model, optimizer, loss_fn


class CheckpointedBlock(torch.nn.Module):
    """A causal self-attention + MLP block (d 48, 4 heads), pre-norm."""

    def __init__(self, width: int = 48, heads: int = 4):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.attention = torch.nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        mask = torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)
        y = self.norm1(x)
        x = x + self.attention(y, y, y, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class CheckpointedCharLm(torch.nn.Module):
    """Characters -> 3 blocks, each recomputed in the backward (activation checkpointing) ->
    next-character logits; the loss with label smoothing."""

    VOCAB = 96

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(self.VOCAB, 48)
        self.blocks = torch.nn.ModuleList(CheckpointedBlock() for _ in range(3))
        self.norm = torch.nn.LayerNorm(48)
        self.head = torch.nn.Linear(48, self.VOCAB)

    def loss_sum(self, chars: torch.Tensor) -> torch.Tensor:
        x = self.embedding(chars[:, :-1])
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, self.VOCAB), chars[:, 1:].reshape(-1), reduction="sum",
                               label_smoothing=0.1)


class ClippedSgd(torch.optim.SGD):
    """SGD with momentum whose step clips the gradients' global norm to 1 first (so the probes'
    optimizer-step peak holds the clipping's temporaries, as training does)."""

    def step(self, closure=None):
        torch.nn.utils.clip_grad_norm_([p for group in self.param_groups for p in group["params"]], 1.0)
        return super().step(closure)


def _build_char_lm():
    model = CheckpointedCharLm()
    optimizer = ClippedSgd(model.parameters(), lr=0.05, momentum=0.9)

    def loss_fn(dims):
        bs, l = (int(d) for d in dims)
        return model.loss_sum(torch.randint(0, CheckpointedCharLm.VOCAB, (bs, l + 1)))

    return model, optimizer, loss_fn


class PackedLstm(torch.nn.Module):
    """Token ids -> embedding 32 -> 2-layer LSTM 64 over packed sequences -> per-token tags."""

    VOCAB, TAGS = 200, 12

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(self.VOCAB, 32, padding_idx=0)
        self.lstm = torch.nn.LSTM(32, 64, num_layers=2, batch_first=True)
        self.head = torch.nn.Linear(64, self.TAGS)

    def loss_sum(self, tokens: torch.Tensor, lengths: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
        packed = torch.nn.utils.rnn.pack_padded_sequence(self.embedding(tokens), lengths, batch_first=True,
                                                         enforce_sorted=False)
        hidden, _ = self.lstm(packed)
        hidden, _ = torch.nn.utils.rnn.pad_packed_sequence(hidden, batch_first=True, total_length=tokens.shape[1])
        return F.cross_entropy(self.head(hidden).reshape(-1, self.TAGS), tags.reshape(-1), ignore_index=-100,
                               reduction="sum")


def _packed_batch(lengths: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random tokens and tags of records of these lengths, padded to the longest."""
    bs, l = len(lengths), int(lengths.max())
    padding = torch.arange(l).unsqueeze(0) >= lengths.unsqueeze(1)
    tokens = torch.randint(1, PackedLstm.VOCAB, (bs, l)).masked_fill(padding, 0)
    tags = torch.randint(0, PackedLstm.TAGS, (bs, l)).masked_fill(padding, -100)
    return tokens, lengths, tags


def _build_packed_lstm():
    model = PackedLstm()
    optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3)

    def loss_fn(dims):
        bs, l = (int(d) for d in dims)
        # The worst padded batch of l positions: every record of length l. Records of mixed
        # lengths peak far lower per token (measured at bs 2, l 96: lengths 96 and 72, 1.12 MB
        # over the step's start; both 96, 2.26 MB), so a fit to mixed lengths under-predicts
        # microbatches of equal ones.
        return model.loss_sum(*_packed_batch(torch.full((bs,), l)))

    return model, optimizer, loss_fn


class PackedTokenTagger(torch.nn.Module):
    """Token ids -> embedding 48 (padded, [bs, l]) -> the real tokens only, packed ([t, 48], no
    padding, as padding-free training runs them) -> a wide MLP (48 -> 384 -> 48) -> per-token tags."""

    VOCAB, TAGS = 200, 12

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(self.VOCAB, 48, padding_idx=0)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(48, 384), torch.nn.GELU(), torch.nn.Linear(384, 48))
        self.head = torch.nn.Linear(48, self.TAGS)

    def loss_sum(self, tokens: torch.Tensor, lengths: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
        real = torch.arange(tokens.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
        packed = self.embedding(tokens)[real]  # [t, 48]
        return F.cross_entropy(self.head(self.mlp(packed)), tags[real], reduction="sum")


def _build_packed_tokens():
    model = PackedTokenTagger()
    optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3)

    def loss_fn(records):  # one [1, l, t] per record (t = l: its real tokens)
        return model.loss_sum(*_packed_batch(torch.tensor([int(record[1]) for record in records])))

    return model, optimizer, loss_fn


def length_sample(seed: int, count: int = 2000) -> List[List[float]]:
    """Records ``[1, l, t]`` (padded length l, real tokens t = l) of lengths 2..96, skewed toward
    short ones as sentence lengths are."""
    lengths = np.floor(2 + 94 * np.random.default_rng(seed).random(count) ** 2)
    return [[1.0, float(l), float(l)] for l in lengths]


class MovingPeakTransformer(torch.nn.Module):
    """A pre-norm causal Transformer (d 48, 12 heads, feed-forward 1024, vocabulary 1024) whose
    attention is written out (the scores [bs, heads, l, l] are materialised) and recomputed in
    the backward (checkpointed, so the scores are never stored): the step's peak moves from the
    logits' backward (bs*l*V) at short lengths to the recomputed attention's (bs*heads*l^2) at
    long ones."""

    WIDTH, HEADS, FF, VOCAB = 48, 12, 1024, 1024

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(self.VOCAB, self.WIDTH)
        self.layers = torch.nn.ModuleList()
        for _ in range(2):
            self.layers.append(torch.nn.ModuleDict({
                "norm1": torch.nn.LayerNorm(self.WIDTH), "qkv": torch.nn.Linear(self.WIDTH, 3 * self.WIDTH),
                "out": torch.nn.Linear(self.WIDTH, self.WIDTH), "norm2": torch.nn.LayerNorm(self.WIDTH),
                "up": torch.nn.Linear(self.WIDTH, self.FF), "down": torch.nn.Linear(self.FF, self.WIDTH)}))
        self.norm = torch.nn.LayerNorm(self.WIDTH)
        self.head = torch.nn.Linear(self.WIDTH, self.VOCAB)

    def attend(self, layer: torch.nn.ModuleDict, x: torch.Tensor) -> torch.Tensor:
        bs, l, _ = x.shape
        q, k, v = layer["qkv"](layer["norm1"](x)).view(bs, l, 3, self.HEADS, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / (q.shape[-1] ** 0.5)
        scores = scores.masked_fill(torch.ones(l, l, dtype=torch.bool).triu(1), float("-inf"))
        mixed = (scores.softmax(-1) @ v).transpose(1, 2).reshape(bs, l, self.WIDTH)
        return layer["out"](mixed)

    def loss_sum(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens[:, :-1])
        for layer in self.layers:
            x = x + torch.utils.checkpoint.checkpoint(self.attend, layer, x, use_reentrant=False)
            x = x + layer["down"](F.gelu(layer["up"](layer["norm2"](x))))
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, self.VOCAB), tokens[:, 1:].reshape(-1), reduction="sum")


def _build_moving_peak():
    model = MovingPeakTransformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss_fn(dims):
        bs, l = (int(d) for d in dims)
        return model.loss_sum(torch.randint(0, MovingPeakTransformer.VOCAB, (bs, l + 1)))

    return model, optimizer, loss_fn


SPECS: Dict[str, ModelSpec] = {spec.name: spec for spec in [
    ModelSpec("seq2seq", ["bs", "ls", "lt"],
              "a*bs*ls^2 + b*bs*lt^2 + d*bs*ls*lt + e*bs*ls + f*bs*lt + g*bs + c",
              {"bs": 16, "ls": 64, "lt": 48}, _build_seq2seq),
    ModelSpec("cnn", ["bs", "h", "w"], "a*bs*h*w + b*bs*h + d*bs*w + e*bs + c",
              {"bs": 16, "h": 64, "w": 96}, _build_cnn),
    ModelSpec("char_lm", ["bs", "l"], "a*bs*l^2 + b*bs*l + d*bs + c", {"bs": 16, "l": 128}, _build_char_lm),
    ModelSpec("packed_lstm", ["bs", "l"], "a*bs*l + b*bs + d*l + c", {"bs": 32, "l": 96}, _build_packed_lstm),
    ModelSpec("packed_tokens", ["bs", "l", "t"], "a*bs*l + b*t + d*bs + c", {"bs": 32},
              _build_packed_tokens, aggregation={"t": "sum"}, record_sample=length_sample),
    ModelSpec("moving_peak", ["bs", "l"], "max(a*bs*l^2 + b*bs*l + c, d*bs*l + e)", {"bs": 16, "l": 256},
              _build_moving_peak),
]}


# ---------------------------------------------------------------- measuring

def held_out_shapes(ranges: Dict[str, Tuple[float, float]], variables: List[str], count: int,
                    seed: int) -> List[List[int]]:
    """``count`` shapes drawn uniformly (integers) inside ``ranges``, every variable on its own.

    Args:
        ranges: ``{variable: (min, max)}``, the probed range of every variable.
        variables: the formula's variables, in its order.
        count: how many shapes.
        seed: the generator's seed.

    Returns:
        ``count`` lists of integer dims in ``variables`` order.
    """
    rng = np.random.default_rng(seed)
    return [[int(rng.integers(int(np.ceil(ranges[v][0])), int(np.floor(ranges[v][1])) + 1)) for v in variables]
            for _ in range(count)]


def held_out_mixes(spec: ModelSpec, count: int, seed: int) -> List[List[List[float]]]:
    """``count`` microbatches of records drawn at random from another sample of ``spec``'s
    records (unsorted, as an unsorted packer makes them), each of 1 to ``variable_max[bs]``."""
    sample = spec.record_sample(seed + 1000)
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, int(spec.variable_max[spec.variables[0]]) + 1, count)
    return [[sample[int(i)] for i in rng.integers(0, len(sample), int(size))] for size in sizes]


def aggregate(spec: ModelSpec, records: List[List[float]]) -> List[float]:
    """A microbatch's dims: the record count, each summed variable's sum, the others' max."""
    columns = list(zip(*records))
    return [float(len(records)) if k == 0 else
            float(sum(columns[k]) if spec.aggregation.get(name) == "sum" else max(columns[k]))
            for k, name in enumerate(spec.variables)]


def probed_ranges(model: xpm.MemoryModel) -> Dict[str, Tuple[float, float]]:
    """The fitted model's probed range of every variable (from its JSON)."""
    import json

    return {name: tuple(span) for name, span in json.loads(model.to_json())["probed_ranges"].items()}


def measure(spec: ModelSpec, meter, *, formula: str = "user", seed: int = 0,
            capacity_bytes: int = 2_000_000_000,
            probe_points: Optional[List[Dict[str, float]]] = None,
            probe_options: Optional[Dict[str, object]] = None) -> SuiteResult:
    """Builds, probes and measures one model (see the module docstring).

    Args:
        spec: the model.
        meter: the process's ``xpm.CpuMeter`` (installed before any model is built).
        formula: "user" (the spec's formula) or "auto" (chosen by the planner from the probes).
        seed: seeds torch (the model's weights, the batches) and the held-out shapes.
        capacity_bytes: the meter's cap while the model is probed and measured (generous: the
            design then doubles the batch size up to ``variable_max`` at every fraction).
        probe_points: explicit probe shapes instead of the automatic design (the suite uses the
            automatic design; these are for comparing designs by hand).
        probe_options: more keyword arguments of ``xpm.probe`` (e.g. ``adaptive_tolerance``),
            for comparing settings by hand.

    Returns:
        The ``SuiteResult``; ``refusal`` holds the planner's message when it refused the fit.

    Raises:
        ValueError: ``formula`` is neither "user" nor "auto".
    """
    if formula not in ("user", "auto"):
        raise ValueError(f"measure: formula must be 'user' or 'auto', got {formula!r}")
    torch.manual_seed(seed)
    module, optimizer, built_loss_fn = spec.build()
    calls = [0]

    def loss_fn(dims):  # counts the probes, also those of a fit the planner refuses
        calls[0] += 1
        return built_loss_fn(dims)

    cost = xpm.CostFormula(spec.formula, spec.variables) if formula == "user" else "auto"
    result = SuiteResult(spec.name, formula)
    previous_capacity = meter.capacity_bytes
    meter.capacity_bytes = capacity_bytes
    try:
        start = time.perf_counter()
        try:
            outcome = xpm.probe(module, optimizer, loss_fn, cost, meter=meter, variable_max=spec.variable_max,
                                probe_points=probe_points, usable_max_rel_error=spec.usable_max_rel_error,
                                aggregation=spec.aggregation or None,
                                record_dims=spec.record_sample(seed) if spec.record_sample else None,
                                variables=spec.variables if formula == "auto" else None,
                                **(probe_options or {}))
        except (RuntimeError, ValueError) as error:  # the planner refused the fit (probes or formula)
            result.probes = calls[0]
            result.probe_s = time.perf_counter() - start
            result.refusal = str(error)
            return result
        result.probes, result.probe_s = len(outcome.probes), outcome.probe_s
        result.fit_max_rel_error = outcome.fit.max_rel_error
        result.loo_max_rel_error = outcome.fit.leave_one_out_max_rel_error
        result.chosen_formula = outcome.model.formula.canonical
        result.adaptive = outcome.adaptive.report
        if spec.record_sample:
            mixes = held_out_mixes(spec, HELD_OUT_SHAPES, seed + 1)
            shapes = [aggregate(spec, records) for records in mixes]
        else:
            shapes = held_out_shapes(probed_ranges(outcome.model), spec.variables, HELD_OUT_SHAPES, seed + 1)
        steady = _SteadyState(module, optimizer).__enter__()
        try:
            executor = _TorchExecutor(steady, loss_fn, meter, spec.variables)
            for k, dims in enumerate(shapes):
                probe = (executor.run_probe_records(mixes[k]) if spec.record_sample
                         else executor.run_probe([float(d) for d in dims]))
                if not probe.feasible:
                    raise RuntimeError(f"{spec.name}: held-out shape {dims} ran out of memory under "
                                       f"{capacity_bytes} bytes: {probe.error}")
                measured = max(probe.forward_backward_peak_bytes, probe.optimizer_step_peak_bytes)
                result.held_out.append((dims, measured, float(outcome.model.predict(dims))))
        finally:
            steady.__exit__(None, None, None)
    finally:
        meter.capacity_bytes = previous_capacity
    return result
