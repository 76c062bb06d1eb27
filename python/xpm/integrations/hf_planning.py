"""What ``PlannedTrainer`` derives from a ``transformers.Trainer`` when the user gives it no
sampler, beyond what every drop-in derives (``dataset_probes``): the planning mode of its
collator and model, the memory model's cache, the snapshot that keeps probing from leaving a
trace, and the check of how the loss is normalised. The trainer (``hf_trainer.py``) runs them;
nothing here steps a model for training.

    mode = planning_mode(trainer)                     # "padded", "encoder_decoder", "padding_free"
    verdict, ratio = loss_normalisation(loss_of, items)
    snapshot = TrainerSnapshot(trainer); ...; snapshot.restore()

The modes: ``"padding_free"`` where the collator flattens a microbatch
(``DataCollatorWithFlattening``, a collator with ``padding_free=True`` such as TRL's, or a trainer
with ``padding_free`` set, which TRL's packing sets); ``"encoder_decoder"`` for a model whose
config says ``is_encoder_decoder``; else ``"padded"`` (``dataset_probes.PlanningMode``).
"""
from __future__ import annotations

import copy
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
from ..meters import Meter
from ..planning import DEFAULT_MEMORY_FRACTION, CostFormula, MemoryBudget, MemoryModel, PackerName
from ..probe_options import ProbeOptions
from ..probing import FITTING_REVISION, ProbeOutcome
from .dataset_probes import (VARIABLES, PlanningMode, check_device_meter, check_drop_in_arguments, checked_custom_dims,
                             dataset_record_dims, device_meter, drop_in_probe_options, model_planning_mode)

logger = logging.getLogger(__name__)

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
    return model_planning_mode(getattr(trainer, "model", None))


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

    @property
    def probe_ooms(self) -> int:
        """The probes that ran out of memory on purpose (0 from the cache): subtract them from
        the meter's or CUDA's out-of-memory count to get training's."""
        return 0 if self.outcome is None else sum(not probe.feasible for probe in self.outcome.probes)


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
    memory_fraction: float = DEFAULT_MEMORY_FRACTION
    record_dims: Optional[Callable[[Any], Sequence[float]]] = None
    cache_dir: Union[str, os.PathLike, None, Literal[False]] = None
    probe_options: Optional[ProbeOptions] = None
    packer: PackerName = "fastest"

    def check(self, trainer: Any) -> None:
        """Refuses a bad keyword in one line.

        Raises:
            ValueError: a formula that is neither ``"auto"`` nor a ``CostFormula``, a
                ``memory_fraction`` outside (0, 1], a ``record_dims`` that is not callable, a
                ``probe_options`` that is not a ``ProbeOptions``, an unknown packer, a
                ``cache_dir`` that is neither a path (of a folder, where one exists), None nor False.
        """
        check_drop_in_arguments("PlannedTrainer", self.formula, self.record_dims, None, self.packer)
        if self.cache_dir is not None and self.cache_dir is not False:
            if not isinstance(self.cache_dir, (str, os.PathLike)):
                raise ValueError(f"PlannedTrainer: cache_dir must be a folder's path, None or False, got "
                                 f"{self.cache_dir!r:.60}")
            if os.path.exists(self.cache_dir) and not os.path.isdir(self.cache_dir):
                raise ValueError(f"PlannedTrainer: cache_dir '{os.fspath(self.cache_dir)}' is a file, not a folder "
                                 "(the memory models are cached there); give a folder, or False for no cache")
        if isinstance(self.memory_fraction, bool) or not isinstance(self.memory_fraction, (int, float)) \
                or not 0 < self.memory_fraction <= 1:
            raise ValueError(f"PlannedTrainer: memory_fraction must be in (0, 1], got {self.memory_fraction!r}")
        if self.probe_options is not None and not isinstance(self.probe_options, ProbeOptions):
            raise ValueError(f"PlannedTrainer: probe_options must be an xpm.ProbeOptions, got "
                             f"{type(self.probe_options).__name__}")

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
        return drop_in_probe_options(self.probe_options, self.variables(mode), dims, budget, per_rank_records,
                                     world_size, summed=mode == "padding_free" and self.record_dims is None)


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


def environment_parts() -> Dict[str, Any]:
    """The versions a memory model depends on (xpm's fitting revision among them)."""
    import transformers

    return {"xpm": VERSION, "fitting": FITTING_REVISION, "torch": torch.__version__,
            "transformers": transformers.__version__}


__all__ = ["planning_mode", "model_signature", "cache_key", "optimizer_identity", "TrainerSnapshot",
           "LossNormalisation", "loss_normalisation", "label_items", "PlannedMemory", "AutomaticPlanning",
           "load_agreed", "load_cached", "save_cached", "environment_parts"]
