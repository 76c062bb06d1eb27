"""``PredictiveBatchSampler``: a ``torch.utils.data.Sampler`` of microbatch index lists, planned
by a memory model, the same on every rank, with weights for exact gradient accumulation.

    sampler = xpm.PredictiveBatchSampler(dims, model, usable_bytes, outer_batch_size=64,
                                         seed=1, units=lengths)  # rank, world_size: torch.distributed's
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collate)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for batch, weight, last in xpm.microbatch_loop(loader, sampler):
            (weight * mean_loss(batch)).backward()     # under DDP: no_sync() unless `last`
            if last:
                optimizer.step(); optimizer.zero_grad()

Each epoch the records are shuffled with ``seed + epoch`` (the same permutation on every rank)
and cut into outer batches of ``outer_batch_size`` records; every rank gets a share of each
outer batch balanced by predicted cost (longest processing time first), packed into
microbatches under the budget. Every rank takes the same number of optimizer steps (one per
outer batch); a rank whose share is empty (fewer records than ranks) yields one empty index
list for that step, so it still joins the step's gradient all-reduce.

Weight of a microbatch: ``world_size * units(microbatch) / units(outer batch)``, for a loss
averaged over the microbatch's units. Summed over a rank's microbatches and averaged over ranks
(as DDP does), the gradient is the outer batch's mean-loss gradient, exactly.

``rank`` and ``world_size`` default to torch.distributed's when its process group is
initialised (else 0 and 1); given values that contradict the group raise ValueError.
Every index list ``__iter__`` yields is a ``Microbatch`` (a ``list`` of record indices) that also
carries its planned ``dims``, ``predicted_bytes``, ``weight``, ``last`` and ``step``;
``len(sampler)`` is the number the next pass yields.

Eight records of a fitted model (the planning module's example), in outer batches of four
under 9,000 bytes: each step's microbatches, and the weights of their mean losses (summing to 1
per step on one rank):

    >>> import numpy as np, xpm
    >>> formula = xpm.CostFormula("a*bs*l + b*bs + c", ["bs", "l"])
    >>> dims = np.array([[1, 10], [2, 10], [4, 20], [8, 40], [2, 40]], dtype=float)
    >>> model, _ = xpm.fit(formula, dims, 100 * dims[:, 0] * dims[:, 1] + 30 * dims[:, 0] + 1000)
    >>> lengths = np.array([30, 10, 20, 40, 25, 15, 35, 5])
    >>> sampler = xpm.PredictiveBatchSampler(xpm.record_dims_from_lengths(lengths), model, 9000,
    ...                                      outer_batch_size=4, seed=1, units=lengths)
    >>> [(list(m), m.weight, m.last) for m in sampler]
    [([0, 4], 0.6875, False), ([5, 1], 0.3125, True), ([3], 0.4, False), ([6, 2], 0.55, False), ([7], 0.05, True)]

Resuming: ``state_dict()`` / ``load_state_dict()`` resume at the step ``microbatch_loop`` (or
``mark_step_done``) counted last; torchdata's ``StatefulDataLoader`` saves the sampler's and its
iterator's state and resumes at the exact microbatch.
"""
from __future__ import annotations

import bisect
import hashlib
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed
from numpy.typing import ArrayLike
from torch.utils.data import Sampler

from . import _planner
from .calibration import Calibration, Correction
from .planning import PACKERS, GradientPhase, MemoryModel, PackerName, _check_choice, _pack, _record_dims
from .meters import Meter, planned_peak_bytes, start_peak


class Microbatch(list):
    """The record indices of one microbatch (a ``list`` of ``int``, what
    ``DataLoader(batch_sampler=...)`` expects), with the plan's figures as attributes.

    Attributes:
        dims: the formula's variables for the padded microbatch (``np.ndarray`` [variables],
            in the formula's order; zeros for an empty microbatch).
        predicted_bytes: ``model.predict(dims)``, the predicted peak in bytes (a step's first
            microbatch: the model's "without_gradients" phase, with the sampler's
            ``gradients_set_to_none``, without the floor when the step has several microbatches
            (no optimizer step runs in it); its last, with it too: the "synchronised" phase where the
            model has one, FSDP2's accumulation probed in lockstep).
        weight: the factor of the microbatch's mean loss (``world_size * units(microbatch) /
            units(outer batch)``; 0 for an empty microbatch).
        last: whether the microbatch ends its optimizer step.
        step: the index of its optimizer step in the epoch.
        correction_bytes: the calibration's correction of its prediction, as its step was
            planned (``predicted_bytes + correction_bytes <= usable_bytes``; 0 without
            calibration).

    Args:
        indices: the record indices.
        dims: see Attributes.
        predicted_bytes: see Attributes.
        weight: see Attributes.
        last: see Attributes.
        step: see Attributes.
        correction_bytes: see Attributes.
    """

    dims: np.ndarray
    predicted_bytes: float
    weight: float
    last: bool
    step: int
    correction_bytes: float

    def __init__(self, indices: Iterable[int], *, dims: np.ndarray, predicted_bytes: float, weight: float,
                 last: bool, step: int, correction_bytes: float = 0.0) -> None:
        super().__init__(indices)
        self.dims, self.predicted_bytes = dims, predicted_bytes
        self.weight, self.last, self.step = weight, last, step
        self.correction_bytes = correction_bytes

    def __repr__(self) -> str:
        """The indices and the plan's figures, one line."""
        return (f"Microbatch({list.__repr__(self)}, step={self.step}, weight={self.weight:.6g}, last={self.last}, "
                f"dims={self.dims.tolist()}, predicted_bytes={self.predicted_bytes:.0f})")


@dataclass
class Step:
    """One optimizer step of this rank.

    Attributes:
        microbatches: record index arrays (int64) into the dataset, one per microbatch.
        weights: the weight of each microbatch's mean loss.
        units: the whole outer batch's units (all ranks).
        dims: each microbatch's planned dims (``np.ndarray`` [variables]).
        predicted_bytes: each microbatch's predicted peak bytes (``model.predict(dims)``).
        correction_bytes: each microbatch's correction, as the step was planned with the
            calibration (``predicted_bytes + correction_bytes <= usable_bytes``).
    """

    microbatches: List[np.ndarray]
    weights: List[float]
    units: float
    dims: List[np.ndarray] = field(default_factory=list)
    predicted_bytes: List[float] = field(default_factory=list)
    correction_bytes: List[float] = field(default_factory=list)


def _whole_number(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    return int(value)


def _rank_and_world_size(rank: Optional[int], world_size: Optional[int]) -> Tuple[int, int]:
    """``(rank, world_size)``: the given values, else torch.distributed's when it is initialised,
    else 0 and 1; ValueError when a given value contradicts an initialised process group."""
    rank = None if rank is None else _whole_number("rank", rank)
    world_size = None if world_size is None else _whole_number("world_size", world_size)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        actual_rank, actual_world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        for name, given in (("rank", rank), ("world_size", world_size)):
            if given is not None and given != (actual_rank if name == "rank" else actual_world):
                raise ValueError(f"{name}={given} but torch.distributed says this process is rank {actual_rank} "
                                 f"of {actual_world}; leave {name} out to use torch.distributed's")
        return actual_rank, actual_world
    return (0 if rank is None else rank), (1 if world_size is None else world_size)


def _first_bad(values: np.ndarray) -> Optional[int]:
    """Index of the first row with a NaN, an infinity or a negative value, or None."""
    bad = ~np.isfinite(values) | (values < 0)
    if values.ndim > 1:
        bad = bad.reshape(len(values), -1).any(axis=1)
    hits = np.flatnonzero(bad)
    return int(hits[0]) if len(hits) else None


def _checked_record_dims(record_dims) -> np.ndarray:
    try:
        array = np.asarray(record_dims, dtype=np.float64)
    except (TypeError, ValueError) as error:
        raise ValueError(f"record_dims must be numbers ([n] lengths or [n, variables] dims): {error}") from None
    if array.ndim >= 1:
        bad = _first_bad(array)
        if bad is not None:
            value = array[bad].tolist()
            raise ValueError(f"record_dims[{bad}] is {value}: every record's dims must be finite and >= 0")
    return array


class PredictiveBatchSampler(Sampler[List[int]]):
    """A batch sampler of microbatches planned under a memory budget (see the module docstring).

    Args:
        record_dims: [n, variables] dims of every record (its batch-size entry 1, the formula's
            variable order), or [n] lengths for a model of variables (bs, l).
        model: the fitted memory model.
        usable_bytes: the budget every microbatch's prediction must fit
            (``MemoryBudget.usable_bytes``).
        outer_batch_size: records per optimizer step, over all ranks.
        rank: this process's rank; default torch.distributed's when it is initialised, else 0.
        world_size: the number of ranks; default torch.distributed's when it is initialised, else 1.
        seed: the shuffle's seed (the permutation of epoch e uses ``seed + e``).
        units: [n] loss units per record (tokens, characters); default 1 each.
        shuffle: shuffle the records every epoch (else they go in order).
        drop_last: leave out the last outer batch when it is short.
        packer: ``xpm.PackerName``: "adaptive", "fastest", "ffd" or "uniform" (see ``xpm.plan``).
        sort_by: the variable the packer sorts by (default: the non-batch-size one).
        lockstep: every rank yields the same number of microbatches in every step, the most
            any rank's share packs into (a share that packs into fewer is split further: its
            largest microbatches halved, which fits as well). A rank whose share has fewer
            records than that count yields empty microbatches (weight 0), on which the training
            loop must still run its forward and backward. The default, None, is True at a world
            size above 1: every rank's loader then yields the same number of batches per epoch,
            so a consumer that takes one collective per batch (a framework stepping the
            optimizer per batch, FSDP2's ``fully_shard``, whose forward and backward are
            collectives) cannot leave a rank waiting for the others. False: each share packs
            into as few microbatches as fit (only for loops such as ``microbatch_loop`` that
            all-reduce once per step).
        calibrate: correct the model's predictions from the peaks training measures
            (``xpm.Calibration``): ``record_peak`` and ``end_step`` (which ``microbatch_loop(...,
            meter=...)`` calls) raise the correction at once after an under-prediction, and the
            steps not yet handed out are planned anew with it, the same on every rank. False:
            the plans follow the model alone.
        gradients_set_to_none: the training loop frees the gradients between steps
            (``zero_grad(set_to_none=True)``, the default of torch 2.x, the HF Trainer, Lightning
            and accelerate), so each step's first microbatch runs without them: its
            ``predicted_bytes`` is the model's "without_gradients" phase (``xpm.GradientPhase``;
            the same as the others' when the model has no fit of that phase). False: a loop
            that zeroes them in place (``set_to_none=False``). The packing is the same either
            way (every microbatch fits with gradients held).

    Raises:
        ValueError: a bad argument (named, with its value: ``PredictiveBatchSampler: packer must
            be 'adaptive', 'fastest', 'ffd' or 'uniform', got 'FFD'``); a NaN, infinite or negative entry of
            ``record_dims`` or ``units`` (named with the first bad index); a record whose
            batch-size entry is not 1 (dims in the wrong order or the wrong batch-size variable;
            named with its index, its dims and the formula's variable order); a rank or world
            size that contradicts an initialised torch.distributed process group; a
            ``usable_bytes`` below the model's ``floor_bytes`` (no microbatch can fit).

    Warns:
        RuntimeWarning: a column of ``record_dims`` reaches more than 4 times the largest value
            its variable was probed at (likely columns in the wrong order), once.
    """

    def __init__(self, record_dims: ArrayLike, model: MemoryModel, usable_bytes: int, *, outer_batch_size: int,
                 rank: Optional[int] = None, world_size: Optional[int] = None, seed: int = 0,
                 units: Optional[ArrayLike] = None, shuffle: bool = True, drop_last: bool = False,
                 packer: PackerName = "adaptive", sort_by: Optional[str] = None, lockstep: Optional[bool] = None,
                 calibrate: bool = True, gradients_set_to_none: bool = True) -> None:
        super().__init__()
        dims = _record_dims(_checked_record_dims(record_dims), model, "record_dims")
        if len(dims) == 0:
            raise ValueError("record_dims: no records")
        outer_batch_size = _whole_number("outer_batch_size", outer_batch_size)
        if outer_batch_size < 1:
            raise ValueError(f"outer_batch_size must be >= 1, got {outer_batch_size}")
        rank, world_size = _rank_and_world_size(rank, world_size)
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank {rank}, world_size {world_size}")
        if isinstance(usable_bytes, bool) or not isinstance(usable_bytes, (int, float, np.integer, np.floating)) \
                or not usable_bytes > 0:
            raise ValueError(f"usable_bytes must be a number of bytes > 0, got {usable_bytes!r}")
        if usable_bytes < model.floor_bytes:
            raise ValueError(f"usable_bytes {int(usable_bytes)} is below the model's floor_bytes "
                             f"{model.floor_bytes:.0f} (its steady state and optimizer step): no microbatch can fit; "
                             "raise the budget")
        if lockstep is not None and not isinstance(lockstep, bool):
            raise ValueError(f"lockstep must be True, False or None (at world size > 1: True), got {lockstep!r}")
        _check_choice(packer, PACKERS, "PredictiveBatchSampler: packer")
        self._dims = dims
        self._units = np.ones(len(dims)) if units is None else np.asarray(units, dtype=np.float64)
        if self._units.shape != (len(dims),):
            raise ValueError(f"units must be {len(dims)} values >= 0 (one per record), got shape {self._units.shape}")
        bad = _first_bad(self._units)
        if bad is not None:
            raise ValueError(f"units[{bad}] is {self._units[bad]}: every record's units must be finite and >= 0")
        self._model, self._usable_bytes = model, int(usable_bytes)
        self._outer, self._rank, self._world = outer_batch_size, rank, world_size
        self._seed, self._shuffle, self._drop_last = _whole_number("seed", seed), bool(shuffle), bool(drop_last)
        self._packer, self._sort_by = packer, sort_by
        self._lockstep = world_size > 1 if lockstep is None else bool(lockstep)
        gap = model.reserved_gap  # probed under a caching allocator: plans start from its reserved bytes
        self._calibration = Calibration(self._usable_bytes, initial=None if gap is None else Correction(*gap)) \
            if calibrate else None
        # The phase of each step's first microbatch (xpm.GradientPhase).
        self._first_phase: GradientPhase = "without_gradients" if gradients_set_to_none else "with_gradients"
        # The correction each step of this epoch is planned with: (first step, correction), ...
        self._corrections: List[Tuple[int, Correction]] = [(0, self.correction)]
        # What the rank assignment balances: each record's share of the largest microbatch of its
        # kind, of at most a rank's share of an outer batch.
        self._costs = _planner.record_costs(model._native, dims, self._usable_bytes, -(-outer_batch_size // world_size))
        self._epoch = 0
        self._steps_done = 0                  # steps counted done (microbatch_loop, mark_step_done)
        self._start: Tuple[int, int] = (0, 0)  # where the next pass begins: (step, microbatch in it)
        self._generation = 0                  # bumped by set_epoch / load_state_dict
        self._current: Optional[_MicrobatchIterator] = None  # the latest pass
        self._steps_cache: Optional[List[Step]] = None
        self._outer_cache: Optional[Tuple[int, List[np.ndarray]]] = None  # (epoch, its outer batches)
        self._offsets_cache: Optional[List[int]] = None
        # (generation, (epoch, steps_done, start)) of the last load_state_dict: what it replaced
        self._before_load: Optional[Tuple[int, Tuple[int, int, Tuple[int, int]]]] = None

    # ---- who and when
    @property
    def rank(self) -> int:
        """This process's rank."""
        return self._rank

    @property
    def world_size(self) -> int:
        """The number of ranks the outer batches are shared among."""
        return self._world

    @property
    def batch_size(self) -> None:
        """None: the microbatches' sizes vary (what batch-sampler wrappers read).

        Raises:
            ValueError: the sampler deals one rank's share of a job of several ranks: a wrapper
                that reads ``batch_size`` to shard batch samplers among processes (accelerate's
                ``Accelerator.prepare`` of a ``DataLoader(batch_sampler=sampler)``, Lightning's
                distributed sampler) would deal this rank's microbatches again. The frameworks'
                own loaders are in ``xpm.integrations``.
        """
        if self._world > 1:
            raise ValueError(f"xpm.PredictiveBatchSampler already deals rank {self._rank}'s share of {self._world} "
                             f"ranks: a wrapper sharding it among processes again (accelerate's Accelerator.prepare, "
                             f"Lightning's distributed sampler) would train each rank on part of its share; build the "
                             f"loader with xpm.integrations.accelerate.prepare_data_loader(accelerator, dataset, "
                             f"sampler, collate_fn=...) or xpm.integrations.lightning.planned_dataloader(...)")
        return None

    @property
    def lockstep(self) -> bool:
        """Whether every rank gets the same number of microbatches in every step."""
        return self._lockstep

    @property
    def epoch(self) -> int:
        """The epoch being planned (``set_epoch``)."""
        return self._epoch

    # ---- epochs and resume
    def set_epoch(self, epoch: int) -> None:
        """Starts epoch ``epoch`` (a new permutation) from its first step.

        Args:
            epoch: the epoch; its permutation uses ``seed + epoch``.

        Raises:
            ValueError: ``epoch`` is not a whole number.
        """
        self._enter_epoch(_whole_number("epoch", epoch))
        self._steps_done, self._start = 0, (0, 0)

    def _enter_epoch(self, epoch: int) -> None:
        if epoch != self._epoch:
            self._steps_cache = self._offsets_cache = None
            self._corrections = [(0, self.correction)]
        self._epoch = epoch
        self._generation += 1

    def _settings(self) -> dict:
        return {"seed": self._seed, "outer_batch_size": self._outer, "world_size": self._world,
                "records": len(self._dims), "shuffle": self._shuffle, "drop_last": self._drop_last,
                "packer": self._packer, "units": float(self._units.sum())}

    def _check_settings(self, state: dict, what: str, settings: dict) -> None:
        if not isinstance(state, dict):
            raise ValueError(f"{what} must be a dict, got {type(state).__name__}")
        for key, mine in settings.items():
            if key not in state:
                raise ValueError(f"{what} has no '{key}': not the state_dict() of a PredictiveBatchSampler")
            if state.get(key) != mine:
                raise ValueError(f"{what} {key} {state.get(key)!r} differs from this sampler's {mine!r}")

    def state_dict(self) -> Dict[str, Any]:
        """Where the epoch is, in optimizer steps: ``load_state_dict`` of it yields exactly the
        remaining steps.

        Returns:
            The epoch, ``steps_done`` and the settings it must be loaded with (plain values, for
            JSON or ``torch.save``).
        """
        return {"epoch": self._epoch, "steps_done": self._steps_done, **self._settings(), **self._calibration_state()}

    def _calibration_state(self) -> Dict[str, Any]:
        return {"corrections": [[first, c.intercept_bytes, c.slope] for first, c in self._corrections],
                "calibration": None if self._calibration is None else self._calibration.state_dict()}

    def _load_calibration_state(self, state: Dict[str, Any], what: str) -> None:
        """The corrections each step was planned with, and the calibration's window (states
        written before calibration existed have neither: the plan of the model alone)."""
        corrections = state.get("corrections", [[0, 0.0, 0.0]])
        try:  # [step, intercept bytes, slope], or [step, bytes] of a constant correction
            loaded = [(int(entry[0]), Correction(*(float(v) for v in entry[1:]))) for entry in corrections]
            if any(not 2 <= len(entry) <= 3 for entry in corrections):
                raise ValueError
        except (TypeError, ValueError):
            raise ValueError(f"{what} corrections must be [[step, intercept_bytes, slope], ...], got "
                             f"{corrections!r}") from None
        if self._calibration is not None and state.get("calibration") is not None:
            self._calibration.load_state_dict(state["calibration"])
        if loaded != self._corrections:  # another plan: made anew on first use
            self._corrections = loaded
            self._steps_cache = self._offsets_cache = None

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Resumes at ``state``'s step.

        Args:
            state: a ``state_dict()`` of a sampler with the same settings.

        Raises:
            ValueError: ``state`` was written by a sampler with other settings (seed, outer batch
                size, world size, records, shuffle, drop_last, packer, units), or its
                ``steps_done`` is out of range. The state is the same on every rank: any rank's
                loads on every rank.
        """
        self._check_settings(state, "state_dict", self._settings())
        steps_done = state.get("steps_done")
        if not isinstance(steps_done, int) or not 0 <= steps_done <= self.steps_per_epoch():
            raise ValueError(f"state_dict steps_done must be in [0, {self.steps_per_epoch()}], got {steps_done!r}")
        epoch = _whole_number("state_dict epoch", state.get("epoch"))
        before = (self._epoch, self._steps_done, self._start)
        self._enter_epoch(epoch)
        self._load_calibration_state(state, "state_dict")
        self._steps_done, self._start = steps_done, (steps_done, 0)
        self._before_load = (self._generation, before)

    def mark_step_done(self) -> None:
        """Counts one optimizer step as done (``microbatch_loop`` counts them itself; call it after
        each step when you iterate ``steps()``)."""
        self._steps_done += 1
        self._start = (self._steps_done, 0)

    def _step_finished(self, step: int, generation: int) -> None:
        if generation == self._generation:
            self._steps_done, self._start = step + 1, (step + 1, 0)

    # ---- the plan
    def _outer_batches(self) -> List[np.ndarray]:
        """The epoch's outer batches (its permutation cut), made once per epoch."""
        if self._outer_cache is None or self._outer_cache[0] != self._epoch:
            n = len(self._dims)
            order = np.random.default_rng(self._seed + self._epoch).permutation(n) if self._shuffle else np.arange(n)
            cut = n - n % self._outer if self._drop_last else n
            self._outer_cache = (self._epoch, [order[i:i + self._outer] for i in range(0, cut, self._outer)])
        return self._outer_cache[1]

    def _step(self, records: np.ndarray, rank: int, index: int) -> Step:
        return self._steps_of(records, index, [rank])[0]

    def _steps_of(self, records: np.ndarray, index: int, ranks: Sequence[int]) -> List[Step]:
        """Step ``index`` (an outer batch's ``records``) of each of ``ranks``; with lockstep
        every share is packed once, for the counts and for the ranks asked."""
        shares = _planner.assign_records_to_ranks(self._costs[records].tolist(), self._world)
        share_of = [records[np.asarray(share, dtype=np.int64)] for share in shares]
        total_units = float(self._units[records].sum())
        budget = self._planning_bytes(index)
        if self._lockstep:
            packed = [self._packed(share, budget) for share in share_of]
            target = max(len(plan[0]) for plan in packed)
            plans = [self._split_to(target, *packed[rank]) for rank in ranks]
        else:
            plans = [self._packed(share_of[rank], budget) for rank in ranks]
        return [self._step_of(plan, total_units, index) for plan in plans]

    def _step_of(self, plan: Tuple[List[np.ndarray], List[np.ndarray], List[float]], total_units: float,
                 index: int) -> Step:
        """A ``Step`` of a share's packed microbatches: their weights, the first microbatch's
        phase, each prediction's correction."""
        microbatches, dims, predicted = plan
        if self._first_phase != "with_gradients" and len(microbatches[0]):
            # A first of several microbatches runs no optimizer step: its phase without the floor.
            predicted[0] = float(self._model.predict(dims[0], self._first_phase, floor=len(microbatches) == 1))
        # FSDP2's last microbatch reduce-scatters, the sharded gradients set to None (as the phase was measured).
        if self._first_phase != "with_gradients" and "synchronised" in self._model.phases and len(microbatches[-1]):
            last = len(microbatches) - 1
            synchronised = float(self._model.predict(dims[last], "synchronised"))
            # A step of one microbatch starts without gradients and reduce-scatters too: the larger
            # of its two phases (each at most the steady prediction), never the smaller.
            predicted[last] = max(predicted[last], synchronised) if last == 0 else min(predicted[last], synchronised)
        scale = self._world / total_units if total_units > 0 else 0.0
        correction = self.planned_correction(index)
        return Step(microbatches, [scale * float(self._units[mb].sum()) for mb in microbatches], total_units,
                    dims, predicted, [correction.bytes_for(p) if len(mb) else 0.0
                                      for mb, p in zip(microbatches, predicted)])

    def planned_correction(self, step: int) -> Correction:
        """The calibration's correction step ``step`` of this epoch is planned with (each of its
        microbatches' ``predicted_bytes + correction.bytes_for(predicted_bytes)`` fits
        ``usable_bytes``; ``Step.correction_bytes`` holds those).

        Args:
            step: the step's index in the epoch.

        Returns:
            The correction (zero without calibration, or before any).
        """
        return [c for first, c in self._corrections if first <= step][-1]

    def _planning_bytes(self, index: int) -> int:
        """What step ``index``'s predictions must fit: the budget less its correction (at
        least 1 byte)."""
        return max(1, int(self.planned_correction(index).planning_bytes(self._usable_bytes)))

    def _packed(self, share: np.ndarray, budget: int) -> Tuple[List[np.ndarray], List[np.ndarray], List[float]]:
        """A share's microbatches (one empty microbatch for an empty share), their dims and
        predicted bytes."""
        if len(share) == 0:
            empty = np.zeros(len(self._model.formula.variable_names))
            return [np.zeros(0, dtype=np.int64)], [empty], [self._model.predict(empty)]
        planned = _pack(self._dims[share], self._model, budget, self._packer, self._sort_by)
        return ([share[k] for k in planned.microbatches], [row.copy() for row in planned.dims],
                [float(b) for b in planned.predicted_bytes])

    def _split_to(self, target: int, microbatches: List[np.ndarray], dims: List[np.ndarray],
                  predicted: List[float]) -> Tuple[List[np.ndarray], List[np.ndarray], List[float]]:
        """``target`` microbatches: the one with the most records halved (in record order) until
        there are enough, then empty ones when every microbatch holds one record."""
        microbatches, dims, predicted = list(microbatches), list(dims), list(predicted)
        while len(microbatches) < target:
            k = max(range(len(microbatches)), key=lambda i: len(microbatches[i]))
            if len(microbatches[k]) < 2:
                empty = np.zeros(len(self._model.formula.variable_names))
                microbatches.append(np.zeros(0, dtype=np.int64))
                dims.append(empty)
                predicted.append(self._model.predict(empty))
                continue
            halves = np.array_split(microbatches[k], 2)
            whole = [_pack(self._dims[half], self._model, 1 << 62, "uniform", "") for half in halves]
            microbatches[k:k + 1] = halves
            dims[k:k + 1] = [plan.dims[0].copy() for plan in whole]
            predicted[k:k + 1] = [float(plan.predicted_bytes[0]) for plan in whole]
        return microbatches, dims, predicted

    def _plan(self) -> Tuple[List[Step], List[int]]:
        """This epoch's steps and ``offsets`` (``offsets[k]``: microbatches before step k;
        ``offsets[-1]``: the epoch's microbatches)."""
        if self._steps_cache is None:
            self._steps_cache = [self._step(records, self._rank, k) for k, records in enumerate(self._outer_batches())]
            self._offsets_cache = self._offsets(self._steps_cache)
            self._warn_over_budget()
        return self._steps_cache, self._offsets_cache

    @staticmethod
    def _offsets(steps: List[Step]) -> List[int]:
        return np.concatenate([[0], np.cumsum([len(s.microbatches) for s in steps], dtype=np.int64)]).astype(int).tolist()

    # ---- calibration from training
    @property
    def calibration(self) -> Optional[Calibration]:
        """The calibration (``calibrate=True``), or None."""
        return self._calibration

    @property
    def correction(self) -> Correction:
        """The correction the next steps are planned with (``xpm.Correction``: bytes added to a
        prediction, a constant and a share of it)."""
        return Correction() if self._calibration is None else self._calibration.correction

    @property
    def correction_bytes(self) -> float:
        """How much the correction the next steps are planned with shrinks their budget, bytes."""
        return 0.0 if self._calibration is None else self._calibration.correction_bytes

    def record_peak(self, microbatch: Microbatch, peak_allocated_bytes: float) -> None:
        """Records a microbatch's measured peak (this rank; no communication). ``microbatch_loop(...,
        meter=...)`` calls it for every microbatch.

        Args:
            microbatch: the ``Microbatch`` the sampler yielded (its ``predicted_bytes``).
            peak_allocated_bytes: the meter's peak over its forward and backward (and the
                optimizer step after the step's last microbatch).
        """
        if self._calibration is not None and len(microbatch) > 0:
            self._calibration.record_peak(microbatch.predicted_bytes, peak_allocated_bytes)

    def end_step(self, step: int, *, replan_from: Optional[int] = None) -> Optional[str]:
        """Ends optimizer step ``step`` for calibration: the ranks agree on the correction (one
        all-reduce of 106 numbers when torch.distributed runs more than one rank; every rank
        calls it once per step), and when it changed, the steps of the epoch not yet handed out
        are planned anew with it (``len(sampler)`` may change). ``microbatch_loop(...,
        meter=...)`` calls it after each step's last microbatch.

        Args:
            step: the step's index in the epoch (``Microbatch.step``).
            replan_from: the first step the caller has not yet taken any microbatch of (a loader
                that reads ahead: the step after the one it is in); default, the sampler's own
                pass's.

        Returns:
            The calibration's log line when the correction changed, else None.
        """
        if self._calibration is None:
            return None
        first = self._first_step_not_handed_out(step) if replan_from is None else max(step + 1, int(replan_from))
        line = self._calibration.end_step(step, replan_from=first)
        if line is not None:
            self._replan_from(self._calibration.replan_from, self._calibration.correction)
        return line

    def _first_step_not_handed_out(self, step: int) -> int:
        steps, offsets = self._plan()
        current = self._current
        first = step + 1
        if current is not None and current._is_current() and current.position < offsets[-1]:
            k, j = current.locate(current.position)
            first = max(first, k if j == 0 else k + 1)
        return first

    def _replan_from(self, first: int, correction: Correction) -> None:
        """Steps ``first`` on planned with ``correction``, in place (a pass under way reads them)."""
        self._corrections = [c for c in self._corrections if c[0] < first] + [(first, correction)]
        self._replan_steps(first)

    def _gradients_held_from(self, step: int) -> None:
        """The loop keeps the gradients between steps: from ``step`` on, each step's first
        microbatch is predicted with them (the same packing), with a warning."""
        self._first_phase = "with_gradients"
        warnings.warn(f"xpm: the gradients are allocated when step {step} starts (zero_grad(set_to_none=False)?), but "
                      "the sampler predicted each step's first microbatch without them; it predicts it with them from "
                      "this step on: build the sampler with gradients_set_to_none=False", RuntimeWarning, stacklevel=3)
        self._replan_steps(step)

    def _replan_steps(self, first: int) -> None:
        """Steps ``first`` on planned anew, in place."""
        if self._steps_cache is None:
            return
        steps, offsets = self._steps_cache, self._offsets_cache
        outer = self._outer_batches()
        steps[first:] = [self._step(outer[k], self._rank, k) for k in range(first, len(outer))]
        offsets[:] = self._offsets(steps)

    def _start_position(self, begin_pass: bool = False) -> int:
        """The microbatch (in the epoch) the next pass begins at; a finished epoch starts over
        (and when ``begin_pass``, its steps count from 0 again)."""
        steps, offsets = self._plan()
        step, offset = self._start
        position = offsets[min(step, len(steps))] + offset
        if position < offsets[-1]:
            return position
        if begin_pass:
            self._steps_done, self._start = 0, (0, 0)
        return 0

    def steps(self, rank: Optional[int] = None) -> Iterator[Step]:
        """The remaining steps of the epoch, in order (a step resumed in its middle is given
        whole). Once the epoch is done, iterating again starts it over (the same order, as
        without ``set_epoch`` in PyTorch's samplers).

        Args:
            rank: whose steps: this rank's by default; another rank's are those its sampler
                plans at the same position (computed here, no communication).

        Returns:
            An iterator of ``Step``.

        Raises:
            ValueError: ``rank`` is not in [0, world_size).
        """
        rank = self._rank if rank is None else _whole_number("rank", rank)
        if not 0 <= rank < self._world:
            raise ValueError(f"rank must be in [0, {self._world}), got {rank}")
        return self._steps_from_start(rank)

    def planned_step(self, index: int, rank: Optional[int] = None) -> Step:
        """Step ``index`` of the epoch as planned now (with the corrections in force for it).

        Args:
            index: the step's index in the epoch.
            rank: whose share: this rank's by default (computed here for another, no
                communication).

        Returns:
            The ``Step``.

        Raises:
            ValueError: ``index`` or ``rank`` out of range.
        """
        rank = self._rank if rank is None else _whole_number("rank", rank)
        index = _whole_number("index", index)
        if not 0 <= rank < self._world or not 0 <= index < self.steps_per_epoch():
            raise ValueError(f"planned_step: index must be in [0, {self.steps_per_epoch()}) and rank in "
                             f"[0, {self._world}), got index {index}, rank {rank}")
        if rank == self._rank:
            return self._plan()[0][index]
        return self._step(self._outer_batches()[index], rank, index)

    def planned_steps(self, index: int) -> List[Step]:
        """Step ``index`` of the epoch of every rank, as planned now (each share packed once;
        this rank's is its own plan's).

        Args:
            index: the step's index in the epoch.

        Returns:
            One ``Step`` per rank, in rank order.

        Raises:
            ValueError: ``index`` out of range.
        """
        mine = self.planned_step(index)  # checks index
        others = [r for r in range(self._world) if r != self._rank]
        steps = dict(zip(others, self._steps_of(self._outer_batches()[index], index, others) if others else []))
        steps[self._rank] = mine
        return [steps[r] for r in range(self._world)]

    def _steps_from_start(self, rank: int) -> Iterator[Step]:
        steps, offsets = self._plan()
        first = bisect.bisect_right(offsets, self._start_position(begin_pass=True)) - 1
        if rank == self._rank:
            for k in range(first, len(steps)):  # by index: steps planned anew after a correction
                yield steps[k]
        else:
            for k, records in enumerate(self._outer_batches()[first:], start=first):
                yield self._step(records, rank, k)

    def _warn_over_budget(self) -> None:
        alone = self._model.predict(self._dims)
        over = int((alone > self._usable_bytes).sum())
        if over:
            warnings.warn(f"xpm: {over} record(s) are predicted over the budget of {self._usable_bytes} bytes even "
                          f"alone (the largest at {alone.max():.0f} bytes); each gets a microbatch of its own",
                          RuntimeWarning, stacklevel=4)

    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch (the same on every rank).

        Returns:
            The outer batches of an epoch (the last short one left out with ``drop_last``).
        """
        n = len(self._dims)
        return n // self._outer if self._drop_last else -(-n // self._outer)

    def __iter__(self) -> Iterator[Microbatch]:
        """The remaining microbatches of the epoch (for ``DataLoader(batch_sampler=...)``).

        Returns:
            An iterator of ``Microbatch``, with ``state_dict``/``load_state_dict``, which
            ``StatefulDataLoader`` saves and restores: it resumes at the exact microbatch.
        """
        _refuse_lightning_training_loop()
        self._current = _MicrobatchIterator(self, self._start_position(begin_pass=True))
        return self._current

    def __len__(self) -> int:
        """The number of microbatches the next pass (``iter(sampler)``) yields: the whole epoch
        after ``set_epoch``, the rest after a resume.

        Returns:
            The number of microbatches.
        """
        return self._plan()[1][-1] - self._start_position()

    def weights(self) -> Iterator[Tuple[float, bool]]:
        """The weights of the microbatches the next pass yields, in the same order.

        Returns:
            An iterator of ``(weight, last)``: the factor of the microbatch's mean loss, and
            whether it ends its optimizer step.
        """
        steps, offsets = self._plan()
        for position in range(self._start_position(), offsets[-1]):
            k = bisect.bisect_right(offsets, position) - 1
            j = position - offsets[k]
            yield steps[k].weights[j], j == len(steps[k].weights) - 1

    def _plan_fingerprint(self) -> dict:
        model = hashlib.sha256(self._model.to_json().encode()).hexdigest()[:16]
        return {"rank": self._rank, "usable_bytes": self._usable_bytes, "sort_by": self._sort_by, "model": model}


class _MicrobatchIterator(Iterator[List[int]]):
    """One pass over the rest of an epoch's microbatches; ``state_dict``/``load_state_dict``
    make it resumable (torchdata's ``StatefulDataLoader`` saves and restores them)."""

    def __init__(self, sampler: PredictiveBatchSampler, position: int):
        self._sampler = sampler
        self._generation, self._epoch = sampler._generation, sampler._epoch
        self._steps, self._offsets = sampler._plan()
        self.pass_start = self.position = position   # microbatches of the epoch before them

    def __iter__(self) -> "_MicrobatchIterator":
        return self

    def locate(self, position: int) -> Tuple[int, int]:
        """(step, microbatch in the step) of the epoch's microbatch ``position``."""
        k = bisect.bisect_right(self._offsets, position) - 1
        return k, position - self._offsets[k]

    def microbatch(self, position: int) -> Microbatch:
        k, j = self.locate(position)
        step = self._steps[k]
        return Microbatch(step.microbatches[j].tolist(), dims=step.dims[j].copy(),
                          predicted_bytes=step.predicted_bytes[j], weight=step.weights[j],
                          last=j == len(step.microbatches) - 1, step=k,
                          correction_bytes=step.correction_bytes[j])

    def _is_current(self) -> bool:
        return self._sampler._current is self and self._sampler._generation == self._generation

    def __next__(self) -> Microbatch:
        if self.position >= self._offsets[-1]:
            if self._is_current():
                self._sampler._start = (0, 0)   # the pass is over: the next one starts the epoch over
            raise StopIteration
        microbatch = self.microbatch(self.position)
        self.position += 1
        return microbatch

    def state_dict(self) -> Dict[str, Any]:
        """The pass's position: its epoch, the epoch's microbatches before the next one, where the
        pass began, and the settings (the sampler's and the plan's) it must be loaded with."""
        sampler = self._sampler
        return {"epoch": self._epoch, "position": self.position, "pass_start": self.pass_start,
                "microbatches": self._offsets[-1], **sampler._settings(), **sampler._plan_fingerprint(),
                **sampler._calibration_state()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continues at ``state``'s microbatch of ``state``'s epoch. A state whose pass had
        yielded the whole epoch resumes nothing: the sampler is left as it was before the
        ``load_state_dict`` that came with it, so the next pass is the epoch ``set_epoch`` chose.

        Raises:
            ValueError: ``state`` was written for another plan (sampler settings, rank, budget,
                model) or its position is out of range.
        """
        sampler = self._sampler
        sampler._check_settings(state, "sampler iterator state_dict", {**sampler._settings(),
                                                                      **sampler._plan_fingerprint()})
        epoch = _whole_number("sampler iterator state_dict epoch", state.get("epoch"))
        before, generation = sampler._before_load, sampler._generation
        sampler._enter_epoch(epoch)
        sampler._load_calibration_state(state, "sampler iterator state_dict")
        self._generation, self._epoch = sampler._generation, epoch
        self._steps, self._offsets = sampler._plan()
        total = self._offsets[-1]
        position, pass_start = state.get("position"), state.get("pass_start")
        if state.get("microbatches") != total:
            raise ValueError(f"sampler iterator state_dict microbatches {state.get('microbatches')!r} differs from "
                             f"this sampler's {total} for epoch {epoch}")
        if not isinstance(position, int) or not 0 <= position <= total:
            raise ValueError(f"sampler iterator state_dict position must be in [0, {total}], got {position!r}")
        if not isinstance(pass_start, int) or not 0 <= pass_start <= position:
            raise ValueError(f"sampler iterator state_dict pass_start must be in [0, {position}], got {pass_start!r}")
        self.position, self.pass_start = position, pass_start
        if position == total:  # a finished pass: nothing to resume
            if before is not None and before[0] == generation:
                sampler._enter_epoch(before[1][0])
                sampler._steps_done, sampler._start = before[1][1], before[1][2]
            self._generation = -1  # detached: its end changes nothing
            return
        step, offset = self.locate(position)
        sampler._steps_done, sampler._start, sampler._current = step, (step, offset), self


# Without a cap on the meter, the unplanned bytes worth a warning: this share of the budget.
UNPLANNED_SHARE_WITHOUT_CAPACITY = 0.10


LIGHTNING_PLAIN_LOADER_ERROR = (
    "xpm: Lightning's training loop iterates a DataLoader over PredictiveBatchSampler: it would step the optimizer "
    "once per microbatch and ignore their weights; return xpm.integrations.lightning.planned_dataloader(self.trainer, "
    "dataset, sampler, collate_fn) from train_dataloader()")
"""The refusal of a plain ``DataLoader`` over the sampler under Lightning's training loop."""

_LIGHTNING_PACKAGES = ("lightning.pytorch.", "pytorch_lightning.")


def _refuse_lightning_training_loop() -> None:
    """Refuses Lightning's training loop iterating the sampler through its loader (its combined
    loader, under its fit loop): the loop takes one optimizer step per loader item. Read from the
    call stack once a pass, so it holds however xpm was imported (the entry point's
    ``PlainLoaderGuard`` is there only where xpm is installed): the guard is added to that
    trainer's callbacks, and refuses (``LIGHTNING_PLAIN_LOADER_ERROR``) before the first step,
    since an error raised here, while Lightning sets up its data, ends in one of Lightning's own.
    A user's own iteration inside ``training_step`` passes.

    Raises:
        ValueError: the trainer cannot be found on the stack (the refusal, at once).
    """
    by_loader, trainer = False, None
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith(_LIGHTNING_PACKAGES):
            by_loader = by_loader or module.endswith(".utilities.combined_loader")
            if module.endswith((".loops.fit_loop", ".loops.training_epoch_loop")):
                trainer = getattr(frame.f_locals.get("self"), "trainer", trainer)
                if trainer is None:
                    raise ValueError(LIGHTNING_PLAIN_LOADER_ERROR)
        frame = frame.f_back
    if not by_loader or trainer is None:
        return
    from .integrations.lightning_guard import PlainLoaderGuard

    if not any(isinstance(callback, PlainLoaderGuard) for callback in trainer.callbacks):
        trainer.callbacks.append(PlainLoaderGuard())


def check_unplanned_memory(meter: Meter, model: MemoryModel, usable_bytes: int,
                           module: Optional[torch.nn.Module] = None) -> float:
    """Compares the bytes allocated now, at the start of an optimizer step, with what the
    model's probes had allocated before every probe (``model.static_bytes``: weights, gradients,
    optimizer state); warns when the difference, memory no prediction holds (a second optimizer
    created after probing, a cache, a dataset moved into tensors), is large enough that
    microbatches planned up to the budget can run out of memory.

    Call it between optimizer steps (after ``zero_grad``, before the next step's batch is made);
    ``microbatch_loop(..., meter=...)`` calls it at every step's start, and the Hugging Face
    integration at every ``training_step``.

    Args:
        meter: the meter the probes ran under (``xpm.CpuMeter`` or ``xpm.CudaMeter``).
        model: the memory model ``xpm.probe`` fitted (another model checks nothing).
        usable_bytes: the budget the plans fill.
        module: the trained module: the gradients ``zero_grad()`` has set to None are counted as
            allocated (the probes had them), so the check also holds after ``set_to_none``.

    Returns:
        The unplanned bytes (allocated now, plus the freed gradients, minus ``model.static_bytes``;
        0 when the model has no static bytes).

    Warns:
        RuntimeWarning (one line): the unplanned bytes exceed what the budget leaves under the
        meter's capacity (``capacity_bytes - usable_bytes``), or 10 % of ``usable_bytes`` when the
        meter has no capacity.
    """
    unplanned, message = _unplanned_memory(meter, model, usable_bytes, module)
    if message is not None:
        warnings.warn(message, RuntimeWarning, stacklevel=2)
    return unplanned


def _unplanned_memory(meter: Meter, model: MemoryModel, usable_bytes: int,
                      module: Optional[torch.nn.Module]) -> Tuple[float, Optional[str]]:
    """``check_unplanned_memory``'s unplanned bytes and its warning (None when there is none)."""
    static = model.static_bytes
    if static is None:
        return 0.0, None
    allocated = float(meter.current_allocated_bytes)
    if module is not None:
        allocated += sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad and p.grad is None)
    unplanned = allocated - static
    usable, capacity = int(usable_bytes), int(meter.capacity_bytes)
    room = capacity - usable if capacity > usable else UNPLANNED_SHARE_WITHOUT_CAPACITY * usable
    if unplanned <= room:
        return unplanned, None
    where = (f"the {capacity - usable} bytes the budget leaves under the meter's capacity of {capacity}"
             if capacity > usable else f"10 % of the budget of {usable} bytes (the meter has no capacity)")
    return unplanned, (f"xpm: {allocated:.0f} bytes are allocated at the start of a step but the probes saw "
                       f"{static:.0f} (weights, gradients, optimizer state): {unplanned:.0f} bytes no prediction "
                       f"holds, more than {where}, so microbatches can run out of memory; was an optimizer or a "
                       f"cache created after xpm.probe? create it before probing, or reserve it in "
                       f"MemoryBudget(extra_overhead_bytes=...)")


def _holds_gradients(module: torch.nn.Module) -> bool:
    return any(p.grad is not None for p in module.parameters())


def microbatch_loop(loader: Iterable[Any], sampler: PredictiveBatchSampler, *, meter: Optional[Meter] = None,
                    module: Optional[torch.nn.Module] = None) -> Iterator[Tuple[Any, float, bool]]:
    """Yields ``(batch, weight, last)`` for every microbatch of ``loader``.

    Args:
        loader: a ``DataLoader`` (or torchdata ``StatefulDataLoader``, resumed or not) over
            ``batch_sampler=sampler``, or ``iter(sampler)`` itself.
        sampler: the loader's ``PredictiveBatchSampler``.
        meter: the meter the model was probed under; given, ``check_unplanned_memory`` runs
            before each step's first batch is fetched, and warns at most once per loop, and
            every microbatch's peak is measured (the meter's peak reset before it is handed out,
            read when the loop is resumed) for the sampler's calibration: ``record_peak`` each
            microbatch, ``end_step`` after each step's last (on every rank: one all-reduce).
        module: the trained module, for ``check_unplanned_memory`` (gradients set to None);
            given, a step that starts with gradients allocated (a loop that zeroes them in
            place; the loop's first step is not looked at, since ``xpm.probe`` leaves the
            gradients allocated) while the sampler predicts its first microbatch without them
            switches the sampler to predicting it with them, with a warning.

    Returns:
        An iterator of ``(batch, weight, last)``: ``weight`` multiplies the microbatch's mean
        loss, ``last`` ends the optimizer step (step the optimizer, and under DDP let this
        backward all-reduce). The step counts as done when its last microbatch is handed out,
        so a ``sampler.state_dict()`` taken after that optimizer step resumes at the next step.

    Raises:
        RuntimeError: ``loader`` does not draw its batches from ``sampler``.

    Warns:
        RuntimeWarning: from ``check_unplanned_memory``, once per loop, when ``meter`` is given;
            once, when ``module`` holds gradients at a step's start while the sampler predicted
            the first microbatch without them.
    """
    iterator = iter(loader)
    # A DataLoader's iterator names the sampler it draws from (torch's and torchdata's alike).
    drawn_from = getattr(iterator, "_index_sampler", sampler)
    if drawn_from is not sampler:
        raise RuntimeError(f"microbatch_loop: the loader draws its batches from a {type(drawn_from).__name__}, not "
                           "the sampler; build it with DataLoader(dataset, batch_sampler=sampler)")
    position: Optional[int] = None
    check, step_starts = meter is not None, True
    measuring = meter is not None and sampler.calibration is not None
    handed_out: Optional[Microbatch] = None  # the microbatch being trained on, when measuring
    started_steps = 0                         # steps whose first microbatch this loop handed out
    while True:
        if handed_out is not None:
            sampler.record_peak(handed_out, planned_peak_bytes(meter))
            if handed_out.last:
                sampler.end_step(handed_out.step)
            handed_out = None
        if check and step_starts:
            message = _unplanned_memory(meter, sampler._model, sampler._usable_bytes, module)[1]
            if message is not None:
                warnings.warn(message, RuntimeWarning, stacklevel=2)
                check = False  # once per loop
        try:
            batch = next(iterator)
        except StopIteration:
            return
        current = sampler._current
        if current is None:
            raise RuntimeError("microbatch_loop: the loader did not iterate the sampler; build it with "
                               "DataLoader(dataset, batch_sampler=sampler)")
        # A DataLoader iterator counts the batches it has yielded this pass (a resumed
        # StatefulDataLoader's count includes those before the checkpoint); any other iterator
        # yields the sampler's microbatches in order from where the pass began.
        yielded = getattr(iterator, "_num_yielded", None)
        if isinstance(yielded, int) and not isinstance(iterator, _MicrobatchIterator):
            position = current.pass_start + yielded - 1
        else:
            position = current.pass_start if position is None else position + 1
        if position >= current._offsets[-1]:
            raise RuntimeError(f"microbatch_loop: the loader's batch would be microbatch {position + 1} of an epoch "
                               f"of {current._offsets[-1]}; its batches must be the sampler's, in order")
        step, j = current.locate(position)
        if j == 0 and started_steps and module is not None and sampler._first_phase != "with_gradients" and \
                _holds_gradients(module):  # not at the loop's first step: the probe leaves gradients allocated
            sampler._gradients_held_from(step)
        started_steps += j == 0
        microbatches = current._steps[step].microbatches
        last = j == len(microbatches) - 1
        step_starts = last
        if last:
            sampler._step_finished(step, current._generation)
        if measuring:
            handed_out = current.microbatch(position)
            start_peak(meter)
        yield batch, current._steps[step].weights[j], last
