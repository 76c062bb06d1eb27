"""``PredictiveBatchSampler``, assembled from its parts: its arguments checked
(``sampler_checks``), each epoch's order (``sampler_order``), each outer batch shared among the
ranks and packed (``sampler_packing``), the calibration's corrections
(``sampler_calibration``), its resume state (``sampler_state``) and its passes
(``sampler_pass``). ``xpm.sampler`` has the guide and its example; import it from there.
"""
from __future__ import annotations

import bisect
import dataclasses
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from numpy.typing import ArrayLike

from . import _planner
from .calibration import Calibration, Correction
from .choices import PACKERS, GradientPhase, MicrobatchPosition, PackerName, _check_choice
from .memory_model import MemoryModel, _checked_model
from .meters import Meter, planned_bytes_kind, planned_peak_bytes
from .record_dims import _record_dims
from .sampler_calibration import (Corrections, calibration_state, correction_in_force, corrections_from,
                                  first_step_not_handed_out, loaded_corrections, new_calibration, planning_bytes)
from .sampler_checks import (_check_sort_by, _check_usable_bytes, _checked_outer_and_ranks, _checked_record_dims, _checked_units,
                             _seed_number, _true_or_false, _whole_number, check_step_to_end, checked_microbatch,
                             checked_records, records_over_budget)
from .sampler_lightning import _refuse_lightning_training_loop
from .sampler_order import outer_batch_count, outer_batches
from .sampler_packing import StepPacking
from .sampler_refit import ModelEntry, TrainingRefit, checked_training_refit
from .sampler_pass import _MicrobatchIterator
from .sampler_state import check_settings, checked_steps_done, plan_fingerprint
from .sampler_steps import Microbatch, Step, step_offsets


class PredictiveBatchSampler(torch.utils.data.Sampler[List[int]]):
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
            steps not yet handed out are planned anew with it, the same on every rank; where
            the model errs by shape more than that correction takes off, it is refitted on the
            peaks of the recent steps (``xpm.sampler_refit``; not under a caching allocator).
            False: the plans follow the model alone.
        gradients_set_to_none: the training loop frees the gradients between steps
            (``zero_grad(set_to_none=True)``, the default of torch 2.x, the HF Trainer, Lightning
            and accelerate), so each step's first microbatch runs without them: its
            ``predicted_bytes`` is the model's "without_gradients" phase (``xpm.GradientPhase``;
            the same as the others' when the model has no fit of that phase). False: a loop
            that zeroes them in place (``set_to_none=False``). The packing is the same either
            way (every microbatch fits with gradients held).

    Raises:
        TypeError: ``model`` is not an ``xpm.MemoryModel`` (a path: ``xpm.MemoryModel.load`` reads it),
            or ``record_dims`` is None.
        ValueError: a bad argument (named, with its value: ``PredictiveBatchSampler: packer must
            be 'adaptive', 'fastest', 'ffd' or 'uniform', got 'FFD'``), a bool option
            (``shuffle``, ``drop_last``, ``calibrate``, ``gradients_set_to_none``) given anything
            but True or False (``PredictiveBatchSampler: calibrate must be True or False, got
            'no'``); a NaN, infinite or negative entry of
            ``record_dims`` or ``units`` (named with the first bad index); a record whose
            batch-size entry is not 1 (dims in the wrong order or the wrong batch-size variable;
            named with its index, its dims and the formula's variable order); a rank or world
            size that contradicts an initialised torch.distributed process group; a
            ``usable_bytes`` below the model's ``floor_bytes`` (no microbatch can fit), or not a
            number (a ``MemoryBudget``: its ``.usable_bytes``); a ``sort_by`` that is not a
            variable of the formula.

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
        _checked_model(model, "PredictiveBatchSampler")
        dims = _record_dims(_checked_record_dims(record_dims), model, "record_dims")
        if len(dims) == 0:
            raise ValueError("record_dims: no records")
        outer_batch_size, rank, world_size = _checked_outer_and_ranks(outer_batch_size, rank, world_size)
        _check_usable_bytes(usable_bytes, model)
        if lockstep is not None and not isinstance(lockstep, (bool, np.bool_)):
            raise ValueError(f"lockstep must be True, False or None (at world size > 1: True), got {lockstep!r}")
        shuffle, drop_last, calibrate, gradients_set_to_none = (
            _true_or_false(f"PredictiveBatchSampler: {name}", value) for name, value in (
                ("shuffle", shuffle), ("drop_last", drop_last), ("calibrate", calibrate),
                ("gradients_set_to_none", gradients_set_to_none)))
        _check_choice(packer, PACKERS, "PredictiveBatchSampler: packer")
        _check_sort_by(sort_by, model)
        self._dims, self._units = dims, _checked_units(units, len(dims))
        self._model, self._usable_bytes = model, int(usable_bytes)
        self._outer, self._rank, self._world = outer_batch_size, rank, world_size
        self._seed, self._shuffle, self._drop_last = _seed_number("seed", seed), shuffle, drop_last
        self._packer, self._sort_by = packer, sort_by
        self._lockstep = world_size > 1 if lockstep is None else bool(lockstep)
        self._calibration = new_calibration(self._usable_bytes, model, calibrate)
        # The phase of each step's first microbatch (xpm.GradientPhase).
        self._first_phase: GradientPhase = "without_gradients" if gradients_set_to_none else "with_gradients"
        # The correction each step of this epoch is planned with: (first step, correction), ...
        self._corrections: Corrections = [(0, self.correction)]
        self._packing = StepPacking(dims, self._units, model, packer, sort_by, world_size, self._lockstep)
        # The model refitted on training's peaks (sampler_refit), and the packing each step of
        # this epoch is planned with: (first step, packing), ...
        self._given_model = model
        # Not under a caching allocator: reserved peaks move by whole segments, no formula's shape.
        self._refit = None if self._calibration is None or model.reserved_gap is not None else \
            TrainingRefit(model, self._calibration.window_steps, self._calibration.group)
        self._packings: List[Tuple[int, StepPacking]] = [(0, self._packing)]
        self._epoch = 0
        self._steps_done = 0                  # steps counted done (microbatch_loop, mark_step_done)
        self._last_ended: Optional[int] = None  # the last step end_step ended in this pass over the epoch
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
            ValueError: ``epoch`` is not a whole number >= 0.
        """
        self._enter_epoch(_seed_number("epoch", epoch))
        self._steps_done, self._start, self._last_ended = 0, (0, 0), None

    def _enter_epoch(self, epoch: int) -> None:
        if epoch != self._epoch:
            self._steps_cache = self._offsets_cache = None
            self._corrections = [(0, self.correction)]
            self._packings = [(0, self._packing)]
        self._epoch = epoch
        self._generation += 1
        self._last_ended = None  # its steps ended anew (load_state_dict keeps those of the same epoch)

    def _may_end_from(self, first: int) -> None:
        """Steps ``first`` on may be ended again (a pass that begins there, a state loaded)."""
        if self._last_ended is not None and self._last_ended >= first:
            self._last_ended = first - 1 if first > 0 else None

    def _settings(self) -> dict:
        return {"seed": self._seed, "outer_batch_size": self._outer, "world_size": self._world,
                "records": len(self._dims), "shuffle": self._shuffle, "drop_last": self._drop_last,
                "packer": self._packer, "units": float(self._units.sum())}

    def state_dict(self) -> Dict[str, Any]:
        """Where the epoch is, in optimizer steps: ``load_state_dict`` of it yields exactly the
        remaining steps.

        Returns:
            The epoch, ``steps_done`` and the settings it must be loaded with (plain values, for
            JSON or ``torch.save``).
        """
        return {"epoch": self._epoch, "steps_done": self._steps_done, **self._settings(), **self._calibration_state()}

    def _calibration_state(self) -> Dict[str, Any]:
        state = calibration_state(self._corrections, self._calibration)
        if self._refit is not None:
            state["training_refit"] = {"state": self._refit.state_dict(), "models": self._packings_state()}
        return state

    def _packings_state(self) -> List[List[Any]]:
        """``[[first step, formula text, coefficients, training ranges], ...]``: the model each
        step of the epoch is planned with (``None, None, None``: the model given)."""
        return [[first, *self._refit_of(p.model)] for first, p in self._packings]

    def _refit_of(self, model: MemoryModel) -> Tuple[Optional[str], Optional[Dict[str, float]],
                                                     Optional[List[List[float]]]]:
        """``(formula text, coefficients, [[min, max] per variable])`` of a refit of the given
        model (its region: ``refit_training_ranges``), ``(None, None, None)`` for it."""
        if model is self._given_model:
            return None, None, None
        return model.formula.text, model.coefficients, [list(r) for r in model._native.refit_training_ranges]

    def _load_calibration_state(self, state: Dict[str, Any], what: str) -> None:
        """The corrections each step was planned with, and the calibration's window
        (``sampler_calibration.loaded_corrections``), and the refit's (``_load_refit_state``),
        its entry checked first."""
        models = self._checked_refit_models(state, what)
        loaded = loaded_corrections(state, what, self._calibration, self.steps_per_epoch())
        if loaded != self._corrections:  # another plan: made anew on first use
            self._corrections = loaded
            self._steps_cache = self._offsets_cache = None
        if models is not None:
            self._load_refit_state(state["training_refit"], models, what)

    def _checked_refit_models(self, state: Dict[str, Any], what: str) -> Optional[List[ModelEntry]]:
        """The models of ``state``'s ``training_refit``, checked with it
        (``sampler_refit.checked_training_refit``); None where there is nothing to load: this
        sampler does not refit, or the state has no calibration (written without one). Raises
        ValueError naming what is malformed, or a state that calibrated without its refit."""
        if self._refit is None or state.get("calibration") is None:
            return None
        if state.get("training_refit") is None:
            held = "is None" if "training_refit" in state else "is missing"
            raise ValueError(f"{what} training_refit {held} but the state has a calibration: a calibrating sampler "
                             f"of this model writes both (its refit's window and the model each step was planned "
                             f"with), and without it the steps would be planned with the model given, not as the "
                             f"run that wrote it planned them")
        return checked_training_refit(state["training_refit"], f"{what} training_refit",
                                      self._given_model.formula.variable_names, self.steps_per_epoch())

    def _load_refit_state(self, state: Dict[str, Any], models: List[ModelEntry], what: str) -> None:
        """The refit's window and model, and the model each step of the epoch is planned with
        (``models``: ``state``'s, checked)."""
        assert self._refit is not None
        if state["state"]["given"] != _planner.TrainingRefit.digest(self._given_model._native):
            # Measured against another model (probed again): the refit starts anew, as the C++
            # Learner's does, and the plans follow the model given.
            warnings.warn(f"xpm: {what}'s model refit was measured against another memory model (probed again?); "
                          "the refit starts anew from this sampler's model", RuntimeWarning, stacklevel=4)
            return
        try:
            self._refit.load_state_dict(state["state"])
        except ValueError as error:
            raise ValueError(f"{what} training_refit: {error}") from None
        if [list(entry) for entry in models] == self._packings_state():
            return  # the plan as it is (the Trainer's drop-in loads its own state every step)
        given = dataclasses.replace(self._packing, model=self._given_model)
        try:
            packings = [(first, given if formula is None else dataclasses.replace(
                given, model=MemoryModel(_planner.TrainingRefit.refitted_model(
                    self._given_model._native, formula, coefficients, ranges))))
                for first, formula, coefficients, ranges in models]
        except ValueError as error:
            raise ValueError(f"{what} training_refit models: {error}") from None
        self._packings = packings
        self._packing = self._packings[-1][1]
        self._model = self._packing.model
        self._steps_cache = self._offsets_cache = None

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Resumes at ``state``'s step.

        Args:
            state: a ``state_dict()`` of a sampler with the same settings.

        Raises:
            ValueError: ``state`` was written by a sampler with other settings (seed, outer batch
                size, world size, records, shuffle, drop_last, packer, units), or its
                ``steps_done`` is out of range, or its corrections or ``training_refit`` are
                malformed (the field named, with its value), or it has a calibration but no
                ``training_refit`` where this sampler refits. The state is the same on every
                rank: any rank's loads on every rank.
        """
        check_settings(state, "state_dict", self._settings())
        steps_done = checked_steps_done(state, self.steps_per_epoch())
        epoch = _whole_number("state_dict epoch", state.get("epoch"))
        self._checked_refit_models(state, "state_dict")  # before anything changes (checked again as loaded)
        self._move_to(epoch, steps_done, lambda: self._load_calibration_state(state, "state_dict"))

    def resume_at(self, epoch: int, steps_done: int) -> None:
        """Sets where ``state_dict`` resumes, ``steps_done`` steps into ``epoch``, keeping the
        calibration and the refit as they are: what ``load_state_dict`` of this sampler's own
        ``state_dict`` with those two fields changed does, without writing and reading its window
        (the HF Trainer's drop-in calls it after every step). No communication: each rank
        calls it on its own sampler, with the same values as the other ranks.

        Args:
            epoch: the epoch (a whole number >= 0).
            steps_done: its steps done, in [0, steps_per_epoch()].

        Raises:
            ValueError: ``epoch`` not a whole number >= 0, or ``steps_done`` not a whole number
                (``resume_at: steps_done must be a whole number, got 2.0``) or out of range.
        """
        epoch = _seed_number("resume_at: epoch", epoch)
        steps_done, count = _whole_number("resume_at: steps_done", steps_done), self.steps_per_epoch()
        if not 0 <= steps_done <= count:
            raise ValueError(f"resume_at: steps_done must be in [0, {count}], got {steps_done}")
        self._move_to(epoch, steps_done, lambda: None)

    def _move_to(self, epoch: int, steps_done: int, load: Callable[[], None]) -> None:
        """Enters ``epoch`` (``load`` then loads what a state holds), ``steps_done`` steps in."""
        before = (self._epoch, self._steps_done, self._start)
        ended = self._last_ended if epoch == self._epoch else None
        self._enter_epoch(epoch)
        load()
        self._steps_done, self._start = steps_done, (steps_done, 0)
        self._before_load = (self._generation, before)
        self._last_ended = ended  # the same epoch: its steps ended stay ended
        self._may_end_from(steps_done)

    def mark_step_done(self) -> None:
        """Counts one optimizer step as done, where ``state_dict`` resumes (``microbatch_loop``
        counts them itself; call it after each step when you iterate ``steps()`` or
        ``iter(sampler)`` in a loop of your own).

        Raises:
            ValueError: every step of the epoch is done already (a state saved then could not be
                loaded).
        """
        if self._steps_done >= self.steps_per_epoch():
            raise ValueError(f"mark_step_done: the epoch's {self.steps_per_epoch()} steps are all done already "
                             "(set_epoch starts the next one)")
        self._steps_done += 1
        self._start = (self._steps_done, 0)

    def _step_finished(self, step: int, generation: int) -> None:
        if generation == self._generation:
            self._steps_done, self._start = step + 1, (step + 1, 0)

    # ---- the plan
    def _outer_batches(self) -> List[np.ndarray]:
        """The epoch's outer batches (its permutation cut), made once per epoch."""
        if self._outer_cache is None or self._outer_cache[0] != self._epoch:
            self._outer_cache = (self._epoch, outer_batches(len(self._dims), self._outer, seed=self._seed,
                                                            epoch=self._epoch, shuffle=self._shuffle,
                                                            drop_last=self._drop_last))
        return self._outer_cache[1]

    def _step(self, records: np.ndarray, rank: int, index: int) -> Step:
        return self._steps_of(records, index, [rank])[0]

    def _steps_of(self, records: np.ndarray, index: int, ranks: Sequence[int]) -> List[Step]:
        """Step ``index`` (an outer batch's ``records``) of each of ``ranks``; with lockstep
        every share is packed once, for the counts and for the ranks asked."""
        packing = [p for first, p in self._packings if first <= index][-1]
        plans = packing.packed_shares(records, ranks, self._planning_bytes(index), self._first_phase)
        total_units, correction = float(self._units[records].sum()), self.planned_correction(index)
        return [packing.step_of(plan, total_units, correction) for plan in plans]

    def planned_correction(self, step: int) -> Correction:
        """The calibration's correction step ``step`` of this epoch is planned with (each of its
        microbatches' ``predicted_bytes + correction.bytes_for(predicted_bytes)`` fits
        ``usable_bytes``; ``Step.correction_bytes`` holds those).

        Args:
            step: the step's index in the epoch.

        Returns:
            The correction (zero without calibration, or before any).
        """
        return correction_in_force(self._corrections, step)

    def _planning_bytes(self, index: int) -> int:
        """What step ``index``'s predictions must fit: the budget less its correction (at
        least 1 byte)."""
        return planning_bytes(self.planned_correction(index), self._usable_bytes)

    def _plan(self) -> Tuple[List[Step], List[int]]:
        """This epoch's steps and ``offsets`` (``offsets[k]``: microbatches before step k;
        ``offsets[-1]``: the epoch's microbatches)."""
        if self._steps_cache is None:
            self._steps_cache = [self._step(records, self._rank, k) for k, records in enumerate(self._outer_batches())]
            self._offsets_cache = step_offsets(self._steps_cache)
            self._warn_over_budget()
        return self._steps_cache, self._offsets_cache

    # ---- calibration from training
    @property
    def calibration(self) -> Optional[Calibration]:
        """The calibration (``calibrate=True``), or None."""
        return self._calibration

    @property
    def model(self) -> MemoryModel:
        """The memory model the next steps are planned with: the one given, or its last refit on
        training's peaks (its JSON, ``to_json()``, then holds the ``refit_region``)."""
        return self._model

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

        Raises:
            TypeError: ``microbatch`` is not a ``Microbatch`` (a plain list of records:
                ``record_microbatch_peak``).
            ValueError: the peak is not a finite number of bytes >= 0, or is 2**63 or more
                (``Calibration.record_peak``), or the microbatch's step was ended already.
        """
        self._check_not_ended(checked_microbatch(microbatch, "record_peak"), "record_peak")
        if self._calibration is not None and len(microbatch) > 0:
            position = getattr(microbatch, "position", None)
            self._calibration.record_peak(microbatch.predicted_bytes, peak_allocated_bytes, position)
            self._record_refit_point(microbatch.dims, float(peak_allocated_bytes), position)

    def record_meter_peak(self, microbatch: Microbatch, meter: Meter) -> None:
        """``record_peak`` with the peak ``meter`` measured since ``xpm.meters.start_peak``
        (``Calibration.record_meter_peak``: reserved bytes where the plans bound them, and then
        lower corrections only once settled). ``microbatch_loop(..., meter=...)`` calls it for
        every microbatch.

        Args:
            microbatch: the ``Microbatch`` the sampler yielded (its ``predicted_bytes``).
            meter: the meter that measured its forward and backward (and the optimizer step
                after the step's last microbatch).

        Raises:
            TypeError: ``microbatch`` is not a ``Microbatch``, or ``meter`` is not a meter.
            ValueError: the meter's peak is not a number of bytes in [0, 2**63) (NaN, None, text:
                ``meter.peak_allocated_bytes must be a number of bytes in [0, 2**63), got nan
                from a CudaMeter of cuda:0``), or as ``record_peak`` (its step ended already).
        """
        self._check_not_ended(checked_microbatch(microbatch, "record_meter_peak"), "record_meter_peak")
        if self._calibration is not None and len(microbatch) > 0:
            position = getattr(microbatch, "position", None)
            self._calibration.record_meter_peak(microbatch.predicted_bytes, meter, position)
            self._record_refit_meter_point(microbatch.dims, meter, position)

    def _check_not_ended(self, microbatch: Microbatch, what: str) -> None:
        """Raises ValueError when ``microbatch``'s step was ended already in this pass: its peak
        would count in the next step's calibration and refit (a peak recorded late, or twice)."""
        if self._last_ended is not None and microbatch.step <= self._last_ended:
            raise ValueError(f"{what}: the microbatch is of step {microbatch.step}, which end_step ended already "
                             f"(the last ended: step {self._last_ended}); record a step's peaks before its end_step")

    def record_microbatch_peak(self, records: Sequence[int], predicted_bytes: float, meter: Meter,
                               position: Optional[MicrobatchPosition]) -> None:
        """``record_meter_peak`` of a microbatch the step loaders handed out by its records
        (``xpm.PlannedStep``: ``records[k]``, ``predicted_bytes[k]``; the integrations call it).

        Args:
            records: its record indices (the dataset's, as the sampler's ``record_dims``); none for
                an empty microbatch (lockstep's, weight 0: skipped).
            predicted_bytes: its prediction, as its step was planned.
            meter: the meter that measured its forward and backward.
            position: its position in its step (``xpm.microbatch_position``), or None (always
                for an empty microbatch).

        Raises:
            ValueError: ``records`` are not indices of the sampler's records, or none with a
                ``position`` (an empty microbatch has none), or ``predicted_bytes`` or the
                meter's peak is not a finite number of bytes >= 0 (below 2**63).
            TypeError: ``meter`` is not a meter.
        """
        indices = checked_records(records, len(self._dims), position)
        if self._calibration is None or len(indices) == 0:
            return
        self._calibration.record_meter_peak(predicted_bytes, meter, position)
        if self._refit is not None:  # the dims as the packers aggregate them
            dims = _planner.aggregate_dims(self._given_model._native, self._dims, [int(i) for i in indices])
            self._record_refit_meter_point(dims, meter, position)

    def _record_refit_meter_point(self, dims: Sequence[float], meter: Meter,
                                  position: Optional[MicrobatchPosition]) -> None:
        """The refit's point of a microbatch ``meter`` measured: its allocated peak (none where the
        plans bound reserved bytes)."""
        if planned_bytes_kind(meter) == "allocated":
            self._record_refit_point(dims, float(planned_peak_bytes(meter)), position)

    def _record_refit_point(self, dims: Sequence[float], peak_bytes: float,
                            position: Optional[MicrobatchPosition]) -> None:
        if self._refit is not None and peak_bytes > 0:
            self._refit.record(dims, peak_bytes, position)

    def end_step(self, step: int, *, replan_from: Optional[int] = None) -> Optional[str]:
        """Ends optimizer step ``step`` for calibration: the ranks agree on the correction (one
        all-reduce of 518 numbers when torch.distributed runs more than one rank; every rank
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

        Raises:
            ValueError: ``step`` is not a whole number >= 0, ``replan_from`` not one in [0,
                steps_per_epoch()]; ``step`` is beyond the epoch's steps, or not after the last
                step ended in this pass over the epoch
                (each step is ended once, in order; ``set_epoch``, a new pass or a state loaded
                starts them over, and so does step 0 while no pass of this sampler is under way).
        """
        step = _whole_number("end_step: step", step)
        if replan_from is not None:
            replan_from = _whole_number("end_step: replan_from", replan_from)
            if not 0 <= replan_from <= self.steps_per_epoch():
                raise ValueError(f"end_step: replan_from must be a step in [0, {self.steps_per_epoch()}] (the epoch's "
                                 f"steps, or its end), got {replan_from}")
        check_step_to_end(step, self.steps_per_epoch(), self._last_ended,
                          self._current is not None and self._current._is_current())
        if self._calibration is None:
            self._last_ended = step
            return None
        first = self._first_step_not_handed_out(step) if replan_from is None else max(step + 1, int(replan_from))
        line = self._calibration.end_step(step, replan_from=first)
        self._last_ended = step
        refitted = None if self._refit is None else self._refit.end_step(step)
        if refitted is not None:
            self._take_refit(refitted)
            line = refitted if line is None else f"{line}; {refitted}"
        # A new line, or a position's line now holding for more predictions (no log line).
        if line is not None or self._calibration.correction != self._corrections[-1][1]:
            self._replan_from(self._calibration.replan_from, self._calibration.correction)
        return line

    def _take_refit(self, line: str) -> None:
        """Plans the steps from the calibration's ``replan_from`` on with the refitted model, the
        calibration drawn anew over its window with that model's predictions."""
        assert self._refit is not None and self._calibration is not None
        self._model = self._refit.model
        self._packing = dataclasses.replace(self._packing, model=self._model)
        self._refit.redraw(self._calibration, self._packing._phase_models(self._first_phase), line)
        first = self._calibration.replan_from
        self._packings = [(f, p) for f, p in self._packings if f < first] + [(first, self._packing)]

    def _first_step_not_handed_out(self, step: int) -> int:
        return first_step_not_handed_out(step, self._plan()[1], self._current)

    def _replan_from(self, first: int, correction: Correction) -> None:
        """Steps ``first`` on planned with ``correction``, in place (a pass under way reads them)."""
        self._corrections = corrections_from(self._corrections, first, correction)
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
        offsets[:] = step_offsets(steps)

    def _start_position(self, begin_pass: bool = False) -> int:
        """The microbatch (in the epoch) the next pass begins at; a finished epoch starts over
        (and when ``begin_pass``, its steps count from 0 again)."""
        steps, offsets = self._plan()
        step, offset = self._start
        position = offsets[min(step, len(steps))] + offset
        if position >= offsets[-1]:
            position = 0
            if begin_pass:
                self._steps_done, self._start = 0, (0, 0)
        if begin_pass:  # its steps may be ended (again)
            self._may_end_from(bisect.bisect_right(offsets, position) - 1)
        return position

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
        indices, alone = records_over_budget(self._model, self._dims, self._usable_bytes)
        over = len(indices)
        if over:
            warnings.warn(f"xpm: {over} record(s) are predicted over the budget of {self._usable_bytes} bytes even "
                          f"alone (the largest at {alone.max():.0f} bytes); each gets a microbatch of its own",
                          RuntimeWarning, stacklevel=4)

    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch (the same on every rank).

        Returns:
            The outer batches of an epoch (the last short one left out with ``drop_last``).
        """
        return outer_batch_count(len(self._dims), self._outer, self._drop_last)

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
        return plan_fingerprint(self._rank, self._usable_bytes, self._sort_by, self._given_model)
