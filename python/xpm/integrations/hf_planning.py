"""What ``PlannedTrainer`` derives from a ``transformers.Trainer`` when the user gives it no
sampler: the planning mode of the collator and model, every record's dims, probe batches made
of the dataset's own records, the memory model's cache key, and the check of how the loss is
normalised. The trainer (``hf_trainer.py``) runs them; nothing here steps a model for training.

    mode = planning_mode(trainer)                     # "padded", "encoder_decoder", "padding_free"
    dims = dataset_record_dims(train_dataset, mode)   # [n, variables], batch-size column 1
    records = ProbeRecords(train_dataset, dims, mode)
    batch_records = records.at([[1, 40], [1, 37]])    # two records cut or repeated to those lengths

Modes (``PlanningMode``):

- ``"padded"``: a microbatch is padded to its longest record: variables ``bs, l`` (``l`` the
  length of ``input_ids``).
- ``"encoder_decoder"``: a model whose config says ``is_encoder_decoder`` (BART, T5; what
  ``Seq2SeqTrainer`` trains): ``bs, ls, lt``, the source length (``input_ids``) and the target
  length (``labels``, else ``decoder_input_ids``), each padded to its longest.
- ``"padding_free"``: the collator flattens a microbatch into one sequence
  (``DataCollatorWithFlattening``, a collator with ``padding_free=True`` such as TRL's, or a
  trainer with ``padding_free`` set, which TRL's packing sets): ``bs, t`` with ``t`` summed over
  the records (the tokens the microbatch really holds).
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Literal, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .._build_info import VERSION
from ..lockstep import Lockstep
from ..meters import CpuMeter, CudaMeter, Meter
from ..planning import PACKERS, CostFormula, MemoryBudget, MemoryModel, PackerName, _check_choice
from ..probe_options import ProbeOptions
from ..probing import ProbeOutcome

logger = logging.getLogger(__name__)

PlanningMode = Literal["padded", "encoder_decoder", "padding_free"]
"""How a microbatch's records combine into the model's inputs (module docstring)."""

VARIABLES: Dict[str, Tuple[str, ...]] = {"padded": ("bs", "l"), "encoder_decoder": ("bs", "ls", "lt"),
                                         "padding_free": ("bs", "t")}
"""The formula's variables of each mode, the batch size first."""

_TARGET_KEYS = ("labels", "decoder_input_ids", "decoder_attention_mask")


def planning_mode(trainer: Any) -> PlanningMode:
    """The mode of ``trainer``'s collator and model (module docstring).

    Args:
        trainer: a ``transformers.Trainer`` (or subclass), built.

    Returns:
        The mode.
    """
    collator = trainer.data_collator
    try:
        from transformers import DataCollatorWithFlattening
    except ImportError:  # an older transformers
        DataCollatorWithFlattening = ()  # noqa: N806
    inner = getattr(collator, "data_collator", collator)  # the Trainer's RemoveColumnsCollator wraps it
    if isinstance(inner, DataCollatorWithFlattening) or getattr(inner, "padding_free", False) is True \
            or getattr(trainer, "padding_free", False) is True:
        return "padding_free"
    config = getattr(getattr(trainer, "model", None), "config", None)
    if getattr(config, "is_encoder_decoder", False):
        return "encoder_decoder"
    return "padded"


def _length(value: Any, where: str) -> int:
    if torch.is_tensor(value) or isinstance(value, np.ndarray):
        return int(value.shape[-1]) if value.ndim > 0 else 1
    if isinstance(value, (list, tuple, str, bytes)):
        return len(value)
    raise ValueError(f"{where} is a {type(value).__name__}, not a sequence of token ids")


def _column_lengths(dataset: Any, key: str) -> Optional[List[int]]:
    """Lengths of column ``key`` read as a column (a ``datasets.Dataset``), else None."""
    names = getattr(dataset, "column_names", None)
    if not isinstance(names, list) or key not in names:
        return None
    return [len(value) for value in dataset[key]]


def _target_key(record: Mapping, where: str) -> str:
    for key in ("labels", "decoder_input_ids"):
        if key in record:
            return key
    raise ValueError(f"{where} has neither 'labels' nor 'decoder_input_ids': an encoder-decoder's records need "
                     f"their target (keys: {', '.join(map(str, record))}); pass record_dims= to say each record's dims")


def dataset_record_dims(dataset: Any, mode: PlanningMode, where: str = "PlannedTrainer: train_dataset") -> np.ndarray:
    """Every record's dims in ``mode``'s variables, read from ``dataset``.

    Args:
        dataset: the map-style training dataset, its records mappings with ``input_ids`` (and a
            target for ``"encoder_decoder"``), or, for ``"padded"``, sequences themselves.
        mode: the planning mode.
        where: how errors name the dataset (the entry point and the argument).

    Returns:
        [n, variables] float64, the batch-size column 1.

    Raises:
        ValueError: an empty dataset, or a record (named by index) without ``input_ids`` (or a
            target), whose ``input_ids`` is not a sequence, or of length 0.
    """
    n = len(dataset)
    if n == 0:
        raise ValueError(f"{where} has no records")
    first = dataset[0]
    if mode == "padded" and (isinstance(first, (str, bytes, list, tuple)) or torch.is_tensor(first)):
        # records that are sequences themselves (texts, token lists, tensors): their lengths
        columns = [[_length(dataset[i], f"{where}[{i}]") for i in range(n)]]
    else:
        columns = _mapping_lengths(dataset, mode, where)
    dims = np.column_stack([np.ones(n)] + [np.asarray(c, dtype=np.float64) for c in columns])
    empty = np.flatnonzero((dims[:, 1:] == 0).any(axis=1))
    if len(empty):
        raise ValueError(f"{where}[{int(empty[0])}] is empty (length 0; {len(empty)} such record(s)): no microbatch of "
                         "it can run; leave empty records out of the dataset")
    return dims


def _mapping_lengths(dataset: Any, mode: PlanningMode, where: str) -> List[List[int]]:
    """The lengths of ``input_ids`` (and of the target for ``"encoder_decoder"``) of every record."""
    first = dataset[0]
    if not isinstance(first, Mapping) or "input_ids" not in first:
        keys = ", ".join(map(str, first)) if isinstance(first, Mapping) else type(first).__name__
        raise ValueError(f"{where}[0] has no 'input_ids' (got {keys}); pass record_dims=callable(record) -> dims "
                         "to say each record's dims")
    columns = [_column_lengths(dataset, "input_ids")]
    if mode == "encoder_decoder":
        columns.append(_column_lengths(dataset, _target_key(first, f"{where}[0]")))
    if all(column is not None for column in columns):
        return columns
    columns = [[], []][:len(columns)]
    for i in range(len(dataset)):
        record = dataset[i]
        if not isinstance(record, Mapping) or "input_ids" not in record:
            raise ValueError(f"{where}[{i}] has no 'input_ids'")
        columns[0].append(_length(record["input_ids"], f"{where}[{i}]['input_ids']"))
        if mode == "encoder_decoder":
            key = _target_key(record, f"{where}[{i}]")
            columns[1].append(_length(record[key], f"{where}[{i}]['{key}']"))
    return columns


def checked_custom_dims(dataset: Any, record_dims: Callable[[Any], Sequence[float]], width: int,
                        where: str = "PlannedTrainer: train_dataset") -> np.ndarray:
    """``record_dims(record)`` of every record, checked.

    Args:
        dataset: the training dataset.
        record_dims: the user's callable: a record's dims, batch-size entry 1 first.
        width: the number of variables.
        where: how errors name the dataset.

    Returns:
        [n, width] float64.

    Raises:
        ValueError: a result of the wrong width, or a batch-size entry other than 1 (named by index).
    """
    rows = []
    for i in range(len(dataset)):
        row = np.asarray(record_dims(dataset[i]), dtype=np.float64).reshape(-1)
        if row.shape != (width,) or row[0] != 1 or not np.all(np.isfinite(row)) or np.any(row < 0):
            raise ValueError(f"{where}[{i}]: record_dims gave {row.tolist()}: expected {width} finite values >= 0, "
                             "the first (the batch size) 1")
        rows.append(row)
    return np.stack(rows)


def _fitted(values: Any, length: int) -> Any:
    """``values`` cut or repeated to ``length``, of the same kind (list, tensor, array)."""
    if length <= 0:
        return values[:0]
    if isinstance(values, (str, bytes)):
        return (values * math.ceil(length / max(1, len(values))))[:length]
    if torch.is_tensor(values):
        times = math.ceil(length / max(1, values.shape[-1]))
        return values.repeat(*([1] * (values.ndim - 1)), times)[..., :length]
    if isinstance(values, np.ndarray):
        return np.concatenate([values] * math.ceil(length / max(1, len(values))))[:length]
    values = list(values)
    return (values * math.ceil(length / max(1, len(values))))[:length]


def _fitted_sequence_lengths(lengths: Sequence[int], length: int) -> List[int]:
    """Packed sequence lengths covering exactly ``length`` tokens: ``lengths`` repeated, the last cut."""
    result, total, k = [], 0, 0
    lengths = [int(x) for x in lengths if int(x) > 0] or [length]
    while total < length:
        take = min(lengths[k % len(lengths)], length - total)
        result.append(take)
        total, k = total + take, k + 1
    return result


class ProbeRecords:
    """Records for probes, made from the dataset's longest: each cut or repeated to the dims
    a probe asks for (every field as long as ``input_ids``, or as the target in
    ``"encoder_decoder"``, cut or repeated alike; TRL's ``seq_lengths`` of a packed record made
    to cover the new length).

    Args:
        dataset: the training dataset.
        record_dims: its records' dims (``dataset_record_dims``); None with ``source_index``.
        mode: the planning mode.
        source_index: the record to make the others from (default: the longest).
    """

    def __init__(self, dataset: Any, record_dims: Optional[np.ndarray], mode: PlanningMode,
                 source_index: Optional[int] = None) -> None:
        self.mode = mode
        if source_index is None:  # the longest by the first length, then the next
            source_index = int(np.lexsort(record_dims[:, ::-1].T)[-1])
        record = dataset[source_index]
        self.plain = not isinstance(record, Mapping)  # a record that is a sequence itself (a text, a tensor)
        self.source = record if self.plain else dict(record)
        self.source_index = source_index
        self.source_length = _length(self.source if self.plain else self.source["input_ids"], "input_ids")
        key = _target_key(self.source, "the longest record") if mode == "encoder_decoder" else None
        self.target_length = _length(self.source[key], key) if key else None

    def record(self, dims: Sequence[float]) -> Any:
        """One record of ``dims`` (variable order, batch-size entry 1).

        Args:
            dims: the record's dims.

        Returns:
            A record like the dataset's, of those lengths.
        """
        length = int(round(dims[1]))
        if self.plain:
            return _fitted(self.source, length)
        target = int(round(dims[2])) if self.mode == "encoder_decoder" else None
        record: Dict[str, Any] = {}
        for key, value in self.source.items():
            if key == "seq_lengths":
                record[key] = _fitted_sequence_lengths(value, length)
            elif target is not None and key in _TARGET_KEYS and self._has_length(value, self.target_length):
                record[key] = _fitted(value, target)
            elif (target is None or key not in _TARGET_KEYS) and self._has_length(value, self.source_length):
                record[key] = _fitted(value, length)
            else:
                record[key] = copy.copy(value)
        return record

    @staticmethod
    def _has_length(value: Any, length: Optional[int]) -> bool:
        if isinstance(value, (list, tuple)):
            return len(value) == length
        if torch.is_tensor(value) or isinstance(value, np.ndarray):
            return value.ndim >= 1 and value.shape[-1] == length
        return False

    def small(self, max_tokens: int = 24) -> List[Any]:
        """Two short records (at most ``max_tokens`` each, the second 5 shorter) for checks
        that run the model before training: small enough to fit wherever anything does."""
        length = max(6, min(self.source_length, max_tokens))
        rows = [[1.0, float(length)], [1.0, float(length - 5)]]
        if self.mode == "encoder_decoder":
            target = max(6, min(self.target_length, max_tokens))
            rows = [row + [float(target - 5 * k)] for k, row in enumerate(rows)]
        return [self.record(row) for row in rows]

    def at(self, rows: Sequence[Sequence[float]]) -> List[Any]:
        """One record per row of dims (``xpm.probe``'s ``loss_fn(records)`` argument). Where a
        padded probe asks for several records all of one length, the last is one token shorter:
        a training microbatch of several records nearly always holds padding, and a batch
        without any lets attention skip its mask (a smaller kernel, a lower peak)."""
        rows = [list(row) for row in rows]
        if self.mode != "padding_free" and len(rows) > 1 and all(row[1:] == rows[0][1:] for row in rows):
            rows[-1][1:] = [max(1.0, value - 1.0) for value in rows[-1][1:]]
        return [self.record(row) for row in rows]


def model_signature(model: torch.nn.Module) -> List[Tuple[str, Tuple[int, ...], str, bool]]:
    """Every parameter's name, shape, dtype and whether it trains."""
    return [(name, tuple(p.shape), str(p.dtype), bool(p.requires_grad)) for name, p in model.named_parameters()]


def cache_key(parts: Mapping[str, Any]) -> str:
    """A hex digest of ``parts`` (JSON-serialisable values; others by ``repr``)."""
    text = json.dumps(parts, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def optimizer_identity(optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """The optimizer's class and its defaults other than the learning rate (what its state holds)."""
    defaults = {k: v for k, v in sorted(getattr(optimizer, "defaults", {}).items()) if k not in ("lr", "initial_lr")}
    return {"class": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}", "defaults": defaults}


SNAPSHOT_MAX_ITEMS = 1000
"""A container with more items than this is not saved by ``TrainerSnapshot`` (a dataset held as
a list is not what a loss changes; deep-copying one cost seconds)."""


def _plain(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is small plain data a probe's ``compute_loss`` may have changed
    (numbers, strings, small tensors, and containers of at most ``SNAPSHOT_MAX_ITEMS`` of them),
    worth saving and restoring."""
    if depth > 4:
        return False
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if torch.is_tensor(value):
        return value.numel() <= 64
    if isinstance(value, (list, tuple)):
        return len(value) <= SNAPSHOT_MAX_ITEMS and all(_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return len(value) <= SNAPSHOT_MAX_ITEMS and \
            all(isinstance(k, (str, int)) and _plain(v, depth + 1) for k, v in value.items())
    return False


class TrainerSnapshot:
    """What probing through a trainer's ``compute_loss`` may change on it, saved to be put back:
    its ``state`` (step counts, token counts, logged history), and every plain-data attribute
    (numbers, small tensors, dicts and lists of them: TRL's token counts and metric windows).

    Args:
        trainer: the trainer.
    """

    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer
        self._state = copy.deepcopy(trainer.state.__dict__)
        self._attributes = {name: copy.deepcopy(value) for name, value in vars(trainer).items()
                            if name not in ("state", "train_dataset", "eval_dataset") and _plain(value)}

    def restore(self) -> None:
        """Puts the saved values back (the same objects the trainer's callbacks hold, refilled)."""
        state = self._trainer.state
        state.__dict__.clear()
        state.__dict__.update(copy.deepcopy(self._state))
        for name, value in self._attributes.items():
            current = getattr(self._trainer, name, None)
            if isinstance(current, dict) and isinstance(value, dict):
                current.clear()
                current.update(value)
            else:
                setattr(self._trainer, name, value)


LossNormalisation = Literal["divides", "ignores", "unclear"]
"""What a loss does with ``num_items_in_batch`` (``loss_normalisation``)."""


def loss_normalisation(loss_of: Callable[[int], torch.Tensor], items: int) -> Tuple[LossNormalisation, float]:
    """Whether a loss divides by the ``num_items_in_batch`` it is given: the same microbatch's
    loss at ``items`` and ``2 * items`` (the same random streams for both).

    Args:
        loss_of: the loss of one fixed microbatch given ``num_items_in_batch``.
        items: the microbatch's own count of label items (> 0).

    Returns:
        (``"divides"`` when the first loss is twice the second, ``"ignores"`` when they are
        equal, else ``"unclear"``; the ratio of the two).
    """
    losses = []
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    for count in (items, 2 * items):
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(0)
            losses.append(float(loss_of(count).detach().float()))
    if losses[1] == 0.0 or not all(math.isfinite(x) for x in losses):
        return "unclear", float("nan")
    ratio = losses[0] / losses[1]
    if abs(ratio - 2.0) <= 1e-3:
        return "divides", ratio
    if abs(ratio - 1.0) <= 1e-3:
        return "ignores", ratio
    return "unclear", ratio


def label_items(batch: Mapping, shifts_labels: bool) -> Optional[int]:
    """The label items of one collated microbatch as ``transformers.Trainer`` counts them
    (``shift_labels`` where the collator gives them, else ``labels`` past the first position for
    a loss that shifts its labels), or None without labels."""
    if "shift_labels" in batch and torch.is_tensor(batch["shift_labels"]):
        labels = batch["shift_labels"]
    elif "labels" in batch and torch.is_tensor(batch["labels"]):
        labels = batch["labels"][..., 1:] if shifts_labels else batch["labels"]
    else:
        return None
    return int(labels.ne(-100).sum())


DROP_IN_USABLE_MAX_REL_ERROR = 0.10
"""The fit error a trainer planning by itself accepts (``xpm.probe``'s default is 5 %): a
kernel that changes with the shape (measured: a BART's peak 8.7 % under its neighbours' trend
at one probe) must not stop training that the calibration corrects within its first steps;
``probe_options=xpm.ProbeOptions(...)`` sets another."""

PROBE_SAMPLE_RECORDS = 4096
"""At most this many records (drawn with a fixed seed) are given to the probe design."""


@dataclass
class PlannedMemory:
    """The memory model a trainer plans with and where it came from.

    Attributes:
        model: the fitted memory model.
        usable_bytes: the budget every microbatch is planned within.
        capacity_bytes: the device's memory, or the CPU meter's cap.
        meter: the meter training measures with.
        record_dims: every record's dims.
        outcome: the probes' outcome (None when the model came from the cache).
        cache_path: the cache file read or written (None without a cache).
    """

    model: MemoryModel
    usable_bytes: int
    capacity_bytes: int
    meter: Meter
    record_dims: np.ndarray
    outcome: Optional[ProbeOutcome]
    cache_path: Optional[str]


@dataclass
class AutomaticPlanning:
    """How ``PlannedTrainer`` plans when no sampler is given: its keywords, checked at
    construction, and the probing, fitting and caching at the start of training.

    Attributes:
        formula: the cost formula, or ``"auto"`` (chosen from the probes).
        memory_fraction: the share of the capacity the plan may use (0 < f <= 1).
        record_dims: a callable giving a record's dims (batch-size entry 1 first, the formula's
            variables), or None: read from the dataset (``dataset_record_dims``).
        cache_dir: the folder of cached memory models; None: ``<output_dir>/xpm-memory-models``;
            False: no cache.
        probe_options: ``xpm.ProbeOptions`` to start from (its ``record_dims``, ``variables``
            and ``lockstep`` are the trainer's); default ``ProbeOptions(usable_max_rel_error=0.10)``
            (``DROP_IN_USABLE_MAX_REL_ERROR``).
        packer: the sampler's packer (``xpm.PackerName``).
    """

    formula: Union[CostFormula, Literal["auto"]] = "auto"
    memory_fraction: float = 0.9
    record_dims: Optional[Callable[[Any], Sequence[float]]] = None
    cache_dir: Union[str, os.PathLike, None, Literal[False]] = None
    probe_options: Optional[ProbeOptions] = None
    packer: PackerName = "fastest"

    def check(self, trainer: Any) -> None:
        """Refuses a bad keyword in one line.

        Raises:
            ValueError: a formula that is neither ``"auto"`` nor a ``CostFormula``, a
                ``memory_fraction`` outside (0, 1], a ``record_dims`` that is not callable, a
                ``probe_options`` that is not a ``ProbeOptions``, an unknown packer.
        """
        if not (self.formula == "auto" or isinstance(self.formula, CostFormula)):
            raise ValueError(f"PlannedTrainer: formula must be 'auto' or an xpm.CostFormula, got {self.formula!r}")
        if isinstance(self.memory_fraction, bool) or not isinstance(self.memory_fraction, (int, float)) \
                or not 0 < self.memory_fraction <= 1:
            raise ValueError(f"PlannedTrainer: memory_fraction must be in (0, 1], got {self.memory_fraction!r}")
        if self.record_dims is not None and not callable(self.record_dims):
            raise ValueError(f"PlannedTrainer: record_dims must be a callable(record) -> dims, got "
                             f"{type(self.record_dims).__name__}")
        if self.probe_options is not None and not isinstance(self.probe_options, ProbeOptions):
            raise ValueError(f"PlannedTrainer: probe_options must be an xpm.ProbeOptions, got "
                             f"{type(self.probe_options).__name__}")
        _check_choice(self.packer, PACKERS, "PlannedTrainer: packer")

    def variables(self, mode: PlanningMode) -> List[str]:
        """The formula's variables: a given formula's, else the mode's."""
        if isinstance(self.formula, CostFormula):
            return list(self.formula.variable_names)
        return list(VARIABLES[mode])

    def refuse_unplannable(self, trainer: Any, meter: Optional[Meter]) -> None:
        """Refuses, at construction, what no memory plan can be derived for.

        Raises:
            ValueError: a device other than CPU or CUDA; on the CPU, no ``xpm.CpuMeter``
                installed or one without a cap; an ``IterableDataset``; a formula whose
                variables are not the mode's without ``record_dims``.
        """
        check_device_meter(trainer.args.device, meter, "PlannedTrainer", "batch_sampler=")
        if isinstance(trainer.train_dataset, torch.utils.data.IterableDataset):
            raise ValueError("PlannedTrainer: train_dataset must be map-style (indexable records), got an "
                             "IterableDataset")
        mode = planning_mode(trainer)
        if isinstance(self.formula, CostFormula) and self.record_dims is None \
                and tuple(self.formula.variable_names) != VARIABLES[mode]:
            raise ValueError(f"PlannedTrainer: formula variables {list(self.formula.variable_names)} are not this "
                             f"trainer's ({mode}: {list(VARIABLES[mode])}); rename them or pass record_dims=")

    def meter_of(self, trainer: Any, meter: Optional[Meter]) -> Meter:
        """The meter training measures with: ``meter``, the installed ``CpuMeter``, or a
        ``CudaMeter`` of the trainer's device."""
        return device_meter(trainer.args.device, meter)

    def record_dims_of(self, trainer: Any, mode: PlanningMode) -> np.ndarray:
        """Every record's dims (the callable's, or the dataset's in ``mode``)."""
        dataset = trainer.train_dataset
        if self.record_dims is not None:
            return checked_custom_dims(dataset, self.record_dims, len(self.variables(mode)))
        return dataset_record_dims(dataset, mode)

    def cache_path(self, trainer: Any, parts: Mapping[str, Any]) -> Optional[str]:
        """The cache file for ``parts``, or None without a cache."""
        if self.cache_dir is False:
            return None
        folder = self.cache_dir if self.cache_dir is not None else os.path.join(trainer.args.output_dir,
                                                                                "xpm-memory-models")
        return os.path.join(os.fspath(folder), f"memory-model-{cache_key(parts)}.json")

    def probe_options_for(self, mode: PlanningMode, dims: np.ndarray, budget: MemoryBudget, per_rank_records: int,
                          world_size: int) -> ProbeOptions:
        """The options the trainer probes with: the user's, with its records and variables."""
        base = self.probe_options or ProbeOptions(usable_max_rel_error=DROP_IN_USABLE_MAX_REL_ERROR)
        rng = np.random.default_rng(0)
        sample = dims if len(dims) <= PROBE_SAMPLE_RECORDS else dims[rng.choice(len(dims), PROBE_SAMPLE_RECORDS,
                                                                                 replace=False)]
        aggregation = base.aggregation
        if mode == "padding_free" and self.record_dims is None:
            aggregation = aggregation or {"t": "sum"}
            sample = _with_shorter_records(sample)
        return dataclasses.replace(
            base, record_dims=sample.tolist(), variables=self.variables(mode), aggregation=aggregation,
            budget=base.budget or budget, variable_max=base.variable_max or {"bs": per_rank_records},
            lockstep=world_size > 1, probe_points=None)


SHORTER_RECORD_FRACTIONS = (0.5, 0.25)
"""Padding-free: the records are also offered to the probe design cut to these fractions."""


def _with_shorter_records(sample: np.ndarray) -> np.ndarray:
    """``sample``, and where its records are of nearly one length (the longest under twice the
    shortest: packed records) also its records cut to ``SHORTER_RECORD_FRACTIONS`` of their
    tokens. A flattened microbatch costs what its tokens cost, so shorter records are as real as
    the dataset's, and records of one length would leave the tokens' terms inseparable from the
    records'."""
    tokens = sample[:, 1]
    if tokens.max() >= 2 * max(1.0, tokens.min()):
        return sample
    shorter = [np.column_stack([sample[:, :1], np.maximum(1.0, np.round(sample[:, 1:] * f))])
               for f in SHORTER_RECORD_FRACTIONS]
    combined = np.concatenate([sample] + shorter)
    if len(combined) <= PROBE_SAMPLE_RECORDS:
        return combined
    return combined[np.random.default_rng(1).choice(len(combined), PROBE_SAMPLE_RECORDS, replace=False)]


def check_device_meter(device: torch.device, meter: Optional[Meter], where: str, instead: str) -> None:
    """Refuses, in one line, a device whose memory cannot be planned without a meter given.

    Args:
        device: where training runs.
        meter: the meter the user gave, or None.
        where: the error's start (the class's name).
        instead: what to pass to plan by hand (named in the error).

    Raises:
        ValueError: a device other than CPU or CUDA; on the CPU, no ``xpm.CpuMeter`` installed or
            one without a cap.
    """
    if meter is not None:
        if int(meter.capacity_bytes) <= 0:
            raise ValueError(f"{where}: meter={type(meter).__name__} has no capacity (capacity_bytes "
                             f"{int(meter.capacity_bytes)}): set the CPU meter's capacity_bytes, the budget, before "
                             "training")
        return
    if device.type == "cpu":
        installed = CpuMeter.installed()
        if installed is None or installed.capacity_bytes == 0:
            what = "no xpm.CpuMeter is installed" if installed is None else "the xpm.CpuMeter has no cap"
            raise ValueError(f"{where}: training on the CPU but {what}: the budget is the CPU meter's cap; call "
                             f"xpm.CpuMeter.install() before building the model and set its capacity_bytes (or pass "
                             f"{instead})")
    elif device.type != "cuda":
        raise ValueError(f"{where}: plans memory on CPU or CUDA devices, not '{device}' (pass meter= and {instead} "
                         "to plan yourself)")


def device_meter(device: torch.device, meter: Optional[Meter]) -> Meter:
    """The meter training on ``device`` measures with: ``meter``, else on CUDA a ``CudaMeter``
    of that device (its capacity the per-process fraction torch was given), on the CPU the
    installed ``CpuMeter`` (``check_device_meter`` first)."""
    if meter is not None:
        return meter
    if device.type == "cuda":
        cuda = CudaMeter(device)
        cuda.memory_fraction = torch.cuda.get_per_process_memory_fraction(cuda.device)  # a cap torch was given
        return cuda
    return CpuMeter.installed()


def load_agreed(path: Optional[str], world_size: int) -> Optional[MemoryModel]:
    """The cached memory model at ``path`` when every rank can read it, else None on every rank
    (one all-reduce at world size > 1: no rank probes alone)."""
    model = load_cached(path) if path is not None and os.path.isfile(path) else None
    if world_size > 1 and Lockstep().max([0.0 if model is not None else 1.0])[0] != 0.0:
        return None
    return model


def load_cached(path: str) -> Optional[MemoryModel]:
    """The cached model at ``path``, or None (logged) when it cannot be read."""
    try:
        return MemoryModel.load(path)
    except (OSError, ValueError, RuntimeError) as error:
        logger.warning("xpm: the cached memory model %s cannot be read (%s); probing again", path,
                       str(error).splitlines()[0])
        return None


def save_cached(model: MemoryModel, path: str) -> None:
    """Writes ``model`` to ``path`` (its folder made; temporary file, then rename)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    model.save(path)


def environment_parts() -> Dict[str, str]:
    """The versions a memory model depends on."""
    import transformers

    return {"xpm": VERSION, "torch": torch.__version__, "transformers": transformers.__version__}


__all__ = ["PlanningMode", "VARIABLES", "planning_mode", "dataset_record_dims", "checked_custom_dims",
           "ProbeRecords", "model_signature", "cache_key", "optimizer_identity", "TrainerSnapshot",
           "LossNormalisation", "loss_normalisation", "label_items", "PlannedMemory", "AutomaticPlanning",
           "check_device_meter", "device_meter", "load_agreed", "load_cached", "save_cached", "environment_parts"]
