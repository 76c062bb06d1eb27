"""The sampler's packing: each rank's share of an outer batch packed into microbatches under the
budget (``xpm.plan``'s packers), in lockstep split further to the count the largest share packs
into, and the ``Step`` of a packed share (its weights, the gradient phase of its first and last
microbatch, each prediction's correction).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from .calibration import Correction
from .choices import GradientPhase, PackerName
from .memory_model import MemoryModel
from .planning import _pack
from .sampler_steps import Step

Packed = Tuple[List[np.ndarray], List[np.ndarray], List[float]]
"""A share's microbatches (record index arrays into the dataset), their dims and predicted bytes."""


@dataclass(frozen=True, eq=False)
class StepPacking:
    """How the sampler packs its steps (its settings, fixed when it is built).

    Attributes:
        dims: [n, variables] dims of every record, checked.
        units: [n] loss units per record.
        model: the memory model.
        packer: the packer (``xpm.PackerName``).
        sort_by: the variable the packer sorts by (None: the non-batch-size one).
        world_size: the number of ranks.
        lockstep: every rank packs its share of a step into the same number of microbatches.
    """

    dims: np.ndarray
    units: np.ndarray
    model: MemoryModel
    packer: PackerName
    sort_by: Optional[str]
    world_size: int
    lockstep: bool

    def packed(self, share: np.ndarray, budget: int) -> Packed:
        """A share's microbatches (one empty microbatch for an empty share), their dims and
        predicted bytes.

        Args:
            share: the share's record indices.
            budget: what each microbatch's prediction must fit, bytes.

        Returns:
            The packed share.
        """
        if len(share) == 0:
            empty = np.zeros(len(self.model.formula.variable_names))
            return [np.zeros(0, dtype=np.int64)], [empty], [self.model.predict(empty)]
        planned = _pack(self.dims[share], self.model, budget, self.packer, self.sort_by)
        return ([share[k] for k in planned.microbatches], [row.copy() for row in planned.dims],
                [float(b) for b in planned.predicted_bytes])

    def split_to(self, target: int, packed: Packed) -> Packed:
        """``target`` microbatches: the one with the most records halved (in record order) until
        there are enough, then empty ones when every microbatch holds one record.

        Args:
            target: the number of microbatches.
            packed: a packed share of at most ``target`` microbatches (left unchanged).

        Returns:
            The share in ``target`` microbatches.
        """
        microbatches, dims, predicted = (list(part) for part in packed)
        while len(microbatches) < target:
            k = max(range(len(microbatches)), key=lambda i: len(microbatches[i]))
            if len(microbatches[k]) < 2:
                empty = np.zeros(len(self.model.formula.variable_names))
                microbatches.append(np.zeros(0, dtype=np.int64))
                dims.append(empty)
                predicted.append(self.model.predict(empty))
                continue
            halves = np.array_split(microbatches[k], 2)
            whole = [_pack(self.dims[half], self.model, 1 << 62, "uniform", "") for half in halves]
            microbatches[k:k + 1] = halves
            dims[k:k + 1] = [plan.dims[0].copy() for plan in whole]
            predicted[k:k + 1] = [float(plan.predicted_bytes[0]) for plan in whole]
        return microbatches, dims, predicted

    def packed_shares(self, shares: List[np.ndarray], ranks: Sequence[int], budget: int) -> List[Packed]:
        """The packed shares of ``ranks``; with lockstep every share is packed once, for the
        common count (the most microbatches any share packs into) and for the ranks asked.

        Args:
            shares: every rank's share of the outer batch.
            ranks: the ranks whose shares are wanted.
            budget: what each microbatch's prediction must fit, bytes.

        Returns:
            One packed share per rank of ``ranks``, in that order.
        """
        if not self.lockstep:
            return [self.packed(shares[rank], budget) for rank in ranks]
        packed = [self.packed(share, budget) for share in shares]
        target = max(len(plan[0]) for plan in packed)
        return [self.split_to(target, packed[rank]) for rank in ranks]

    def step_of(self, packed: Packed, total_units: float, first_phase: GradientPhase,
                correction: Correction) -> Step:
        """A ``Step`` of a share's packed microbatches: their weights, the first microbatch's
        phase, each prediction's correction.

        Args:
            packed: the packed share (its predictions are updated in place).
            total_units: the whole outer batch's units (all ranks).
            first_phase: the phase of each step's first microbatch.
            correction: the calibration's correction the step is planned with.

        Returns:
            The step.
        """
        microbatches, dims, predicted = packed
        model = self.model
        if first_phase != "with_gradients" and len(microbatches[0]):
            # A first of several microbatches runs no optimizer step: its phase without the floor.
            predicted[0] = float(model.predict(dims[0], first_phase, floor=len(microbatches) == 1))
        # FSDP2's last microbatch reduce-scatters, the sharded gradients set to None (as the phase was measured).
        if first_phase != "with_gradients" and "synchronised" in model.phases and len(microbatches[-1]):
            last = len(microbatches) - 1
            synchronised = float(model.predict(dims[last], "synchronised"))
            # A step of one microbatch starts without gradients and reduce-scatters too: the larger
            # of its two phases (each at most the steady prediction), never the smaller.
            predicted[last] = max(predicted[last], synchronised) if last == 0 else min(predicted[last], synchronised)
        scale = self.world_size / total_units if total_units > 0 else 0.0
        return Step(microbatches, [scale * float(self.units[mb].sum()) for mb in microbatches], total_units,
                    dims, predicted, [correction.bytes_for(p) if len(mb) else 0.0
                                      for mb, p in zip(microbatches, predicted)])
