"""What a drop-in derives from a dataset and a device, for every framework's (the HF Trainer's
``PlannedTrainer``, Lightning's ``PlannedMicrobatches``, accelerate's ``prepare``): every
record's dims, probe batches made of the dataset's own records, the options the probes run
with, and the meter whose capacity is the budget. Nothing here steps a model.

    dims = dataset_record_dims(train_dataset, "padded")   # [n, variables], batch-size column 1
    records = ProbeRecords(train_dataset, dims, "padded")
    batch_records = records.at([[1, 40], [1, 37]])        # two records cut or repeated to those lengths
    options = drop_in_probe_options(None, ["bs", "l"], dims, budget, per_rank_records=16, world_size=2)

Modes (``PlanningMode``):

- ``"padded"``: a microbatch is padded to its longest record: variables ``bs, l`` (``l`` the
  length of ``input_ids``, or of a record that is a sequence itself).
- ``"encoder_decoder"``: a model whose config says ``is_encoder_decoder`` (BART, T5; what
  ``Seq2SeqTrainer`` trains): ``bs, ls, lt``, the source length (``input_ids``) and the target
  length (``labels``, else ``decoder_input_ids``), each padded to its longest.
- ``"padding_free"``: the collator flattens a microbatch into one sequence: ``bs, t`` with ``t``
  summed over the records (the tokens the microbatch really holds).
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import math
from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Literal, Optional, Sequence, Tuple

import numpy as np
import torch

from ..meters import CpuMeter, CudaMeter, Meter, allocator_settings_line
from ..choices import PACKERS, _check_choice
from ..cost_formula import CostFormula
from ..planning import MemoryBudget, MemoryModel, PackerName
from ..probe_options import ProbeOptions
from ..probing import ProbeOutcome
from ..record_dims import _finite_number
from ..sampler_checks import _seed_number, records_over_budget

PlanningMode = Literal["padded", "encoder_decoder", "padding_free"]
"""How a microbatch's records combine into the model's inputs (module docstring)."""

VARIABLES: Dict[str, Tuple[str, ...]] = {"padded": ("bs", "l"), "encoder_decoder": ("bs", "ls", "lt"),
                                         "padding_free": ("bs", "t")}
"""The formula's variables of each mode, the batch size first."""

_TARGET_KEYS = ("labels", "decoder_input_ids", "decoder_attention_mask")


def model_planning_mode(model: Any) -> PlanningMode:
    """``"encoder_decoder"`` for a model whose config says ``is_encoder_decoder`` (BART, T5:
    variables ``bs, ls, lt``), else ``"padded"`` (``bs, l``); a DDP wrapper is looked through.

    Args:
        model: the model, wrapped or not.

    Returns:
        The mode.
    """
    config = getattr(getattr(model, "module", model), "config", None)
    return "encoder_decoder" if getattr(config, "is_encoder_decoder", False) else "padded"


def _length(value: Any, where: str) -> int:
    if torch.is_tensor(value) or isinstance(value, np.ndarray):
        return int(value.shape[-1]) if value.ndim > 0 else 1
    if isinstance(value, (list, tuple)) and len(value) > 0 and _has_items(value[0]):
        raise ValueError(f"{where} is a {type(value).__name__} of {len(value)} items, the first a "
                         f"{type(value[0]).__name__}: a record of several fields (a TensorDataset's (inputs, targets)?), "
                         "not a sequence of token ids; the probes' records are cut from the token ids of one, so "
                         "give records that are token ids or mappings with 'input_ids' (and 'labels')")
    if isinstance(value, (list, tuple, str, bytes)):
        return len(value)
    raise ValueError(f"{where} is a {type(value).__name__}, not a sequence of token ids")


def _has_items(value: Any) -> bool:
    """Whether ``value`` is a field of several items (a sequence, a mapping, a tensor or array
    of one dimension or more), not a token (a number, or a word)."""
    if torch.is_tensor(value) or isinstance(value, np.ndarray):
        return value.ndim > 0
    return isinstance(value, (list, tuple, Mapping))


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


def dataset_record_dims(dataset: Any, mode: PlanningMode,
                        where: str = "PlannedTrainer: train_dataset") -> np.ndarray:
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
        names = _column_names(first, mode)
        field = names[int(np.flatnonzero(dims[empty[0], 1:] == 0)[0])]
        raise ValueError(f"{where}[{int(empty[0])}] is empty (its {field} has length 0; {len(empty)} such record(s)): "
                         "no microbatch of it can run; leave empty records out of the dataset")
    return dims


def _column_names(first: Any, mode: PlanningMode) -> List[str]:
    """What each length column of ``mode``'s dims counts, for errors: "'input_ids'" (and the
    target's key), or "sequence" for records that are sequences themselves."""
    if not isinstance(first, Mapping):
        return ["sequence"]
    names = ["'input_ids'"]
    if mode == "encoder_decoder":
        names.append(f"'{_target_key(first, 'the first record')}'")
    return names


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


DOMINANT_LENGTH_SHARE = 0.9
"""A length that at least this share of the records have exactly (in one variable) is one the
training microbatches that reach it hold without padding there: records cut into blocks of one
length (``group_texts``). (Records truncated at a ``max_length`` that 75 % of them reach gave
microbatches of that length both with padding and without: probed without, no better.)"""


def dominant_lengths(record_dims: Optional[np.ndarray]) -> Dict[int, float]:
    """The length variables in which one value is shared by at least ``DOMINANT_LENGTH_SHARE``
    of the records.

    Args:
        record_dims: the records' dims [n, variables] (batch-size column first), or None.

    Returns:
        ``{column: value}``, columns from 1; empty for None or no records.
    """
    if record_dims is None or len(record_dims) == 0:
        return {}
    dominant = {}
    for column in range(1, record_dims.shape[1]):
        values, counts = np.unique(record_dims[:, column], return_counts=True)
        if counts.max() >= DOMINANT_LENGTH_SHARE * len(record_dims):
            dominant[column] = float(values[int(np.argmax(counts))])
    return dominant


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
        self.dominant_lengths = dominant_lengths(record_dims)
        if source_index is None:  # the longest by the first length, then the next
            source_index = int(np.lexsort(record_dims[:, ::-1].T)[-1])
        record = dataset[source_index]
        self.plain = not isinstance(record, Mapping)  # a record that is a sequence itself (a text, a tensor)
        self.source = record if self.plain else dict(record)
        self.source_index = source_index
        self.source_length = _length(self.source if self.plain else self.source["input_ids"], "input_ids")
        key = _target_key(self.source, "the longest record") if mode == "encoder_decoder" else None
        self.target_length = _length(self.source[key], key) if key else None
        if key is not None and record_dims is not None:
            self._check_order(record_dims[source_index], key)

    def _check_order(self, dims: np.ndarray, key: str) -> None:
        """Refuses dims whose source and target lengths are the record's the other way round: the
        probes would make records of swapped lengths (and fit well), training would not."""
        given, lengths = [float(dims[1]), float(dims[2])], [float(self.source_length), float(self.target_length)]
        if given != lengths and given == lengths[::-1]:
            raise ValueError(f"record_dims gave {[float(d) for d in dims]} for the dataset's record "
                             f"{self.source_index}, whose 'input_ids' hold {self.source_length} tokens and '{key}' "
                             f"{self.target_length}: the dims of an encoder-decoder's record are [1, source length, "
                             f"target length], in that order (the probes make records of those lengths)")

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
        padded probe asks for several records all of one length in a variable (the sources, or
        the targets), the last is one token shorter there: a training microbatch of several
        records nearly always holds padding, and a batch without any lets attention skip its
        mask (a smaller kernel, a lower peak, measured 7 % lower on a BART whose sources were of
        one length and targets not). Not at a length that most of the dataset's records have
        exactly (``dominant_lengths``): the microbatches there hold none (measured: a byte
        Llama on 128-byte blocks, planned 5 % to 7 % over by padded probes)."""
        rows = [list(row) for row in rows]
        if self.mode != "padding_free" and len(rows) > 1:
            for column in range(1, len(rows[0])):
                length = rows[0][column]
                if all(row[column] == length for row in rows) and self.dominant_lengths.get(column) != length:
                    rows[-1][column] = max(1.0, length - 1.0)
        return [self.record(row) for row in rows]


DROP_IN_USABLE_MAX_REL_ERROR = 0.10
"""The fit error a trainer planning by itself accepts (``xpm.probe``'s default is 5 %): a
kernel that changes with the shape (measured: a BART's peak 8.7 % under its neighbours' trend
at one probe) must not stop training that the calibration corrects within its first steps;
``probe_options=xpm.ProbeOptions(...)`` sets another."""

PROBE_SAMPLE_RECORDS = 4096
"""At most this many records (drawn with a fixed seed) are given to the probe design."""


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


def records_units(dataset: Any, units: Optional[Callable[[Any], float]], where: str) -> Optional[List[float]]:
    """Every record's loss units, ``units(record)``, each checked to be a number (the sampler
    then refuses a negative or non-finite one, by index).

    Args:
        dataset: the map-style training dataset.
        units: the user's ``units(record) -> float``, or None.
        where: how errors name the dataset (``"... : loader.dataset"``).

    Returns:
        One number per record, or None without ``units``.

    Raises:
        ValueError: ``units`` gave something else than a number for a record (None, text, a
            bool), named with its index and value.
    """
    if units is None:
        return None
    values = []
    for i in range(len(dataset)):
        value = units(dataset[i])
        if torch.is_tensor(value) and value.numel() == 1:
            value = value.item()
        if not _finite_number(value):
            raise ValueError(f"{where}[{i}]: units gave {value!r:.40}, not a number (a record's loss units, e.g. its "
                             "tokens)")
        values.append(float(value))
    return values


def check_drop_in_arguments(where: str, formula: Any, record_dims: Any, units: Any, packer: Any, seed: Any = 0,
                            dims_mode: Optional[str] = None) -> int:
    """Refuses, in one line naming the argument, what a drop-in would otherwise find wrong only
    after probing (or deep in its own code).

    Args:
        where: the error's start (the class or function).
        formula: ``"auto"`` or an ``xpm.CostFormula``.
        record_dims: None or ``record_dims(record) -> dims``.
        units: None or ``units(record) -> float``.
        packer: an ``xpm.PackerName``.
        seed: the shuffle's seed, a whole number >= 0.
        dims_mode: the mode of the records' dims the drop-in reads without ``record_dims``
            (a key of ``VARIABLES``), or None: not checked against the formula's variables.

    Returns:
        The seed.

    Raises:
        ValueError: any of them of another kind, or a formula with other variables (in number
            or names) than the records' dims of ``dims_mode`` without ``record_dims``.
    """
    if not (isinstance(formula, str) and formula == "auto" or isinstance(formula, CostFormula)):
        raise ValueError(f"{where}: formula must be 'auto' or an xpm.CostFormula, got {formula!r}")
    for name, value in (("record_dims", record_dims), ("units", units)):
        if value is not None and not callable(value):
            raise ValueError(f"{where}: {name} must be a function of a record (or None), got {value!r}")
    _check_choice(packer, PACKERS, f"{where}: packer")
    if dims_mode is not None and record_dims is None and isinstance(formula, CostFormula):
        read = VARIABLES[dims_mode]
        if len(formula.variable_names) != len(read):
            raise ValueError(f"{where}: the formula's variables {list(formula.variable_names)} are "
                             f"{len(formula.variable_names)}, but without record_dims= each record's dims are "
                             f"{len(read)} ({', '.join(read)}): give record_dims=, a function of a record that returns "
                             f"its {len(formula.variable_names)} dims in the formula's order")
        if tuple(formula.variable_names) != tuple(read):
            raise ValueError(f"{where}: the formula's variables {list(formula.variable_names)} are not the names of the "
                             f"records' dims read without record_dims= ({', '.join(read)}): name them so, or give "
                             "record_dims=")
    return _seed_number(f"{where}: seed", seed)


def check_device_meter(device: torch.device, meter: Optional[Meter], where: str, instead: str) -> None:
    """Refuses, in one line, a device whose memory cannot be planned without a meter given.

    Args:
        device: where training runs.
        meter: the meter the user gave, or None.
        where: the error's start (the class's name).
        instead: what to pass to plan by hand (named in the error).

    Raises:
        ValueError: a device other than CPU or CUDA; on the CPU, no ``xpm.CpuMeter`` installed or
            one without a cap, or a cap not above the bytes allocated already; a ``meter`` that is
            not a meter (a number given for the cap) or has no capacity.
    """
    if meter is not None:
        if not all(hasattr(meter, name) for name in ("capacity_bytes", "peak_allocated_bytes", "reset_peak")):
            raise ValueError(f"{where}: meter= must be a meter (xpm.CpuMeter.install(), xpm.CudaMeter(...), or one "
                             f"with capacity_bytes, peak_allocated_bytes and reset_peak), got {meter!r:.60}; the "
                             "budget is the meter's capacity_bytes")
        if int(meter.capacity_bytes) <= 0:
            raise ValueError(f"{where}: meter={type(meter).__name__} has no capacity (capacity_bytes "
                             f"{int(meter.capacity_bytes)}): set the CPU meter's capacity_bytes, the budget, before "
                             "training")
        _check_cap_above_allocated(meter, where)
        return
    if device.type == "cpu":
        installed = CpuMeter.installed()
        if installed is None or installed.capacity_bytes == 0:
            what = "no xpm.CpuMeter is installed" if installed is None else "the xpm.CpuMeter has no cap"
            raise ValueError(f"{where}: training on the CPU but {what}: the budget is the CPU meter's cap; call "
                             f"xpm.CpuMeter.install() before building the model and set its capacity_bytes (or pass "
                             f"{instead})")
        _check_cap_above_allocated(installed, where)
    elif device.type != "cuda":
        raise ValueError(f"{where}: plans memory on CPU or CUDA devices, not '{device}' (pass meter= and {instead} "
                         "to plan yourself)")


def _check_cap_above_allocated(meter: Meter, where: str) -> None:
    """Refuses a ``CpuMeter`` whose cap is not above what is allocated already (the model's
    weights): the Trainer's first allocation would run out of memory."""
    if isinstance(meter, CpuMeter) and meter.capacity_bytes <= meter.current_allocated_bytes:
        raise ValueError(f"{where}: the xpm.CpuMeter's capacity_bytes {meter.capacity_bytes:,} is not above the "
                         f"{meter.current_allocated_bytes:,} bytes allocated already (the model's weights, at least): "
                         "raise the cap (it is in bytes)")


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


def drop_in_probe_options(base: Optional[ProbeOptions], variables: Sequence[str], dims: np.ndarray,
                          budget: MemoryBudget, per_rank_records: int, world_size: int,
                          summed: bool = False) -> ProbeOptions:
    """The options a drop-in probes with: the user's (``base``), with the dataset's records, the
    variables, the budget, lockstep at world size > 1 and the batch size up to a rank's share.

    Args:
        base: the user's ``probe_options`` (None: ``usable_max_rel_error=0.10``,
            ``DROP_IN_USABLE_MAX_REL_ERROR``); its own budget and ``variable_max`` are kept.
        variables: the formula's variables.
        dims: every record's dims (at most ``PROBE_SAMPLE_RECORDS`` of them drawn, seed 0).
        budget: the budget the probes run under, unless ``base`` names one.
        per_rank_records: a rank's share of the outer batch: the largest batch size probed.
        world_size: the ranks (lockstep above 1).
        summed: the variable after the batch size is summed over a microbatch's records
            (padding-free): aggregation "sum", and shorter records offered too.

    Returns:
        The options.
    """
    base = base or ProbeOptions(usable_max_rel_error=DROP_IN_USABLE_MAX_REL_ERROR)
    rng = np.random.default_rng(0)
    sample = dims if len(dims) <= PROBE_SAMPLE_RECORDS else dims[rng.choice(len(dims), PROBE_SAMPLE_RECORDS,
                                                                             replace=False)]
    aggregation = base.aggregation
    if summed:
        aggregation = aggregation or {variables[1]: "sum"}
        sample = _with_shorter_records(sample)
    return dataclasses.replace(
        base, record_dims=sample.tolist(), variables=list(variables), aggregation=aggregation,
        budget=base.budget or budget, variable_max=base.variable_max or {"bs": per_rank_records},
        lockstep=world_size > 1, probe_points=None)


TIME_MODEL_USABLE_MAX_REL_ERROR = 0.5
"""The largest error of a time model at the probes' timings that ``"fastest"`` plans with. Timings
taken while other work shares the machine can leave a fit that misses them by 99 % with almost no
cost per microbatch (measured: 1.2e-5 s, against 2.8e-3 s from a quiet run of the same job), and
the packer then splits each step into single records: 2 to 4 times slower training."""


def packer_for(packer: PackerName, model: MemoryModel) -> PackerName:
    """``packer``, but "adaptive" for "fastest" where ``model`` has no time model (probe times
    were not fitted: a model from measurements) or one that misses the probes' timings by more
    than ``TIME_MODEL_USABLE_MAX_REL_ERROR`` (logged as a warning)."""
    if packer != "fastest":
        return packer
    time_model = model.time_model
    if time_model is None:
        return "adaptive"
    recorded = time_model.get("max_rel_error")
    error = abs(float(recorded)) if isinstance(recorded, (int, float)) else math.inf  # JSON null: a NaN written
    if not error <= TIME_MODEL_USABLE_MAX_REL_ERROR:
        by = f"by up to {100 * error:.0f} %" if math.isfinite(error) else "by an unrecorded amount"
        logging.getLogger("xpm").warning(
            "xpm: the probes' time model misses their timings %s (over %.0f %%; were they taken while other work "
            "ran?): planning with packer 'adaptive' (the fewest microbatches that fit) instead of 'fastest'",
            by, 100 * TIME_MODEL_USABLE_MAX_REL_ERROR)
        return "adaptive"
    return packer


def log_allocator_line(meter: Meter, log: logging.Logger) -> None:
    """On a GPU, logs at start-up what ``PYTORCH_ALLOC_CONF`` implies for planned microbatches
    (``xpm.meters.allocator_settings_line``); nothing elsewhere.

    Args:
        meter: the drop-in's meter.
        log: the drop-in's logger.

    Raises:
        ValueError: ``PYTORCH_ALLOC_CONF`` is malformed (one line naming it).
    """
    if isinstance(meter, CudaMeter):
        log.info("xpm: %s", allocator_settings_line())


_LOOSE_FIT_REL_ERROR = 0.03  # a given formula missing its probes by more gets a note at start-up


def probes_summary(outcome: ProbeOutcome) -> str:
    """The probes in a drop-in's start-up line: "35 probes (9 out of memory) in 2.0 s, fit max
    error 0.07 %", and, where a formula given by the user misses its probes by over 3 %, that
    plans miss by as much (the calibration corrects by the prediction, not by shape) and that
    ``formula="auto"`` chooses one from the probes."""
    infeasible = sum(not p.feasible for p in outcome.probes)
    error = abs(outcome.fit.max_rel_error)
    summary = (f"{len(outcome.probes)} probes ({infeasible} out of memory) in {outcome.probe_s:.1f} s, fit max error "
               f"{100 * error:.2f} %")
    if error > _LOOSE_FIT_REL_ERROR and not outcome.fit.formula_selection:
        summary += (" (the formula's own error at its probes: plans can miss by as much where shapes of one "
                    "prediction differ; formula='auto' chooses a formula from the probes)")
    if outcome.planned_bytes == "reserved" and outcome.reserved_ratios:
        summary += (f"; reserved bytes planned ({min(outcome.reserved_ratios):.3f}x to "
                    f"{max(outcome.reserved_ratios):.3f}x the allocated peak in the probes)")
    return summary


__all__ = ["PlanningMode", "VARIABLES", "dataset_record_dims", "checked_custom_dims", "ProbeRecords",
           "check_drop_in_arguments",
           "DROP_IN_USABLE_MAX_REL_ERROR", "PROBE_SAMPLE_RECORDS", "drop_in_probe_options", "check_device_meter",
           "device_meter", "TIME_MODEL_USABLE_MAX_REL_ERROR", "packer_for", "log_allocator_line", "probes_summary"]


_NAMED_RECORDS = 8  # records over the budget named in the refusal


def refuse_records_over_budget(who: str, model: MemoryModel, dims: np.ndarray, usable_bytes: int,
                               capacity: int) -> None:
    """Refuses to train records that no microbatch can hold: each would run out of memory in
    its own microbatch part way into training (on every rank alike: the same model and dims).

    Args:
        who: the integration, for the message ("PlannedTrainer", ...).
        model: the memory model.
        dims: [n, variables] every record's dims.
        usable_bytes: the budget.
        capacity: the meter's capacity, for the message.

    Raises:
        ValueError: some record is predicted over the budget even alone (how many, and the
            indices of up to 8 of them, largest first, each with its prediction).
    """
    over, alone = records_over_budget(model, dims, usable_bytes)
    if len(over):
        largest_first = [int(i) for i in over[np.argsort(-alone[over], kind="stable")]]
        named = [f"[{i}] at {alone[i]:,.0f} bytes" for i in largest_first[:_NAMED_RECORDS]]
        more = len(largest_first) - len(named)
        raise ValueError(f"{who}: {len(over)} of {len(dims)} records are predicted over the budget of "
                         f"{usable_bytes:,} bytes even alone (largest first: train_dataset{', '.join(named)}"
                         f"{f', and {more} more' if more else ''}): no microbatch can hold them; raise the memory "
                         f"cap ({capacity:,} bytes) or memory_fraction, or shorten or drop those records")
