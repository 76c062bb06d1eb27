"""``PredictiveBatchSampler``: a ``torch.utils.data.Sampler`` of microbatch index lists, planned
by a memory model, the same on every rank, with weights for exact gradient accumulation.

    sampler = xpm.PredictiveBatchSampler(dims, model, usable_bytes, outer_batch_size=64,
                                         rank=rank, world_size=world_size, seed=1, units=lengths)
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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List, Optional

import warnings

import numpy as np

from . import _planner
from .planning import PACKERS, MemoryModel, _record_dims, plan


@dataclass
class Step:
    """One optimizer step of this rank: its microbatches (record index arrays into the dataset)
    and their weights; ``units``: the whole outer batch's units (every rank)."""

    microbatches: List[np.ndarray]
    weights: List[float]
    units: float


class PredictiveBatchSampler:
    """See the module docstring. ``record_dims``: [n, variables] dims of every record (batch-size
    entry 1) or [n] lengths for variables (bs, l); ``units``: [n] loss units per record (tokens;
    default 1 each); ``usable_bytes``: the budget (``MemoryBudget.usable_bytes``)."""

    def __init__(self, record_dims, model: MemoryModel, usable_bytes: int, *, outer_batch_size: int,
                 rank: int = 0, world_size: int = 1, seed: int = 0, units=None, shuffle: bool = True,
                 drop_last: bool = False, packer: str = "adaptive", sort_by: Optional[str] = None):
        dims = _record_dims(record_dims, model, "record_dims")
        if len(dims) == 0:
            raise ValueError("record_dims: no records")
        for name, value in (("outer_batch_size", outer_batch_size), ("world_size", world_size), ("rank", rank)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"{name} must be a whole number, got {value!r}")
        if outer_batch_size < 1:
            raise ValueError(f"outer_batch_size must be >= 1, got {outer_batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank {rank}, world_size {world_size}")
        if int(usable_bytes) <= 0:
            raise ValueError(f"usable_bytes must be > 0, got {usable_bytes}")
        if packer not in PACKERS:
            raise ValueError(f"packer must be one of {', '.join(PACKERS)}, got '{packer}'")
        self._dims = dims
        self._units = np.ones(len(dims)) if units is None else np.asarray(units, dtype=np.float64)
        if self._units.shape != (len(dims),) or (self._units < 0).any():
            raise ValueError(f"units must be {len(dims)} values >= 0, got shape {self._units.shape}")
        self._model, self._usable_bytes = model, int(usable_bytes)
        self._outer, self._rank, self._world = int(outer_batch_size), int(rank), int(world_size)
        self._seed, self._shuffle, self._drop_last = int(seed), shuffle, drop_last
        self._packer, self._sort_by = packer, sort_by
        self._costs = _planner.record_costs(model._native, dims)
        self._epoch, self._steps_done = 0, 0
        self._steps_cache: Optional[List[Step]] = None

    # ---- epochs and resume
    def set_epoch(self, epoch: int) -> None:
        """Starts epoch ``epoch`` (a new permutation) from its first step."""
        self._epoch, self._steps_done, self._steps_cache = int(epoch), 0, None

    def _settings(self) -> dict:
        return {"seed": self._seed, "outer_batch_size": self._outer, "world_size": self._world,
                "records": len(self._dims), "shuffle": self._shuffle, "drop_last": self._drop_last,
                "packer": self._packer, "units": float(self._units.sum())}

    def state_dict(self) -> dict:
        """Where the epoch is: ``load_state_dict`` of it yields exactly the remaining steps."""
        return {"epoch": self._epoch, "steps_done": self._steps_done, **self._settings()}

    def load_state_dict(self, state: dict) -> None:
        """Resumes at ``state``'s step; ValueError when it was written by a sampler with other
        settings (seed, outer batch size, world size, records, shuffle, drop_last, packer, units)."""
        for key, mine in self._settings().items():
            if state.get(key) != mine:
                raise ValueError(f"state_dict {key} {state.get(key)!r} differs from this sampler's {mine!r}")
        steps_done = state.get("steps_done")
        if not isinstance(steps_done, int) or not 0 <= steps_done <= self.steps_per_epoch():
            raise ValueError(f"state_dict steps_done must be in [0, {self.steps_per_epoch()}], got {steps_done!r}")
        self._epoch, self._steps_done, self._steps_cache = int(state["epoch"]), steps_done, None

    def mark_step_done(self) -> None:
        """Counts one optimizer step as done (``microbatch_loop`` calls it when it hands out a
        step's last microbatch; call it yourself after each step when you iterate ``steps()``)."""
        self._steps_done += 1

    # ---- the plan
    def _outer_batches(self) -> List[np.ndarray]:
        n = len(self._dims)
        order = np.random.default_rng(self._seed + self._epoch).permutation(n) if self._shuffle else np.arange(n)
        cut = n - n % self._outer if self._drop_last else n
        return [order[i:i + self._outer] for i in range(0, cut, self._outer)]

    def _step(self, records: np.ndarray) -> Step:
        shares = _planner.assign_records_to_ranks(self._costs[records].tolist(), self._world)
        mine = records[np.asarray(shares[self._rank], dtype=np.int64)]
        total_units = float(self._units[records].sum())
        if len(mine) == 0:
            return Step([np.zeros(0, dtype=np.int64)], [0.0], total_units)
        planned = plan(self._dims[mine], self._model, self._usable_bytes, packer=self._packer, sort_by=self._sort_by)
        microbatches = [mine[k] for k in planned.microbatches]
        scale = self._world / total_units if total_units > 0 else 0.0
        return Step(microbatches, [scale * float(self._units[mb].sum()) for mb in microbatches], total_units)

    def steps(self) -> Iterator[Step]:
        """This rank's remaining steps of the epoch, in order. Once the epoch is done, iterating
        again starts it over (the same order, as without ``set_epoch`` in PyTorch's samplers)."""
        if self._steps_cache is None:
            self._steps_cache = [self._step(records) for records in self._outer_batches()]
            self._warn_over_budget()
        if self._steps_done >= len(self._steps_cache):
            self._steps_done = 0
        start = self._steps_done
        for step in self._steps_cache[start:]:
            yield step

    def _warn_over_budget(self) -> None:
        alone = self._model.predict(self._dims)
        over = int((alone > self._usable_bytes).sum())
        if over:
            warnings.warn(f"xpm: {over} record(s) are predicted over the budget of {self._usable_bytes} bytes even "
                          f"alone (the largest at {alone.max():.0f} bytes); each gets a microbatch of its own",
                          RuntimeWarning, stacklevel=3)

    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch (the same on every rank)."""
        n = len(self._dims)
        return n // self._outer if self._drop_last else -(-n // self._outer)

    def __iter__(self) -> Iterator[List[int]]:
        """Microbatch index lists of the remaining steps (for ``DataLoader(batch_sampler=...)``)."""
        for step in self.steps():
            for microbatch in step.microbatches:
                yield microbatch.tolist()

    def __len__(self) -> int:
        """Microbatches this rank yields over the rest of the epoch."""
        return sum(len(step.microbatches) for step in self.steps())

    def weights(self) -> Iterator[tuple]:
        """(weight, last of its step) of every microbatch ``__iter__`` yields, in the same order."""
        for step in self.steps():
            for k, weight in enumerate(step.weights):
                yield weight, k == len(step.weights) - 1


def microbatch_loop(loader, sampler: PredictiveBatchSampler):
    """Yields ``(batch, weight, last)`` for every microbatch of ``loader`` (a DataLoader over
    ``batch_sampler=sampler``): ``weight`` multiplies the microbatch's mean loss, ``last`` ends
    the optimizer step (step the optimizer, and under DDP let this backward all-reduce).
    The step counts as done when its last microbatch is handed out, so a ``state_dict()`` taken
    after that optimizer step resumes at the next step."""
    weights = sampler.weights()
    for batch in loader:
        weight, last = next(weights)
        if last:
            sampler.mark_step_done()
        yield batch, weight, last
