"""The sampler's packing: an outer batch shared among the ranks and each share packed into
microbatches under the budget, in lockstep split further to the count the largest share packs
into, and each rank's first and last microbatch predicted in its gradient phase (the planner
core's ``plan_step``, the policy the C++ data-parallel step runs too), and the ``Step`` of a
packed share (its weights, each prediction's correction).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import _planner
from .calibration import Correction
from .choices import GradientPhase, PackerName
from .memory_model import MemoryModel
from .planning import Plan, _sort_by_or_default
from .sampler_steps import Step, positions_with_records

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

    def packed_shares(self, records: np.ndarray, ranks: Sequence[int], budget: int,
                      first_phase: GradientPhase) -> List[Packed]:
        """The packed shares of ``ranks`` of one outer batch, by the planner core's step plan
        (``plan_step``, step_plan.hpp: the shares balanced by predicted cost, each packed under
        the budget, in lockstep split to the most microbatches any share packs into; a share's
        first microbatch predicted in ``first_phase``, without the floor when the share has
        several, and its last one, under FSDP2's accumulation, in the "synchronised" phase,
        where the model has fits of them). A share without records packs into one empty
        microbatch.

        Args:
            records: the outer batch's record indices (into the dataset).
            ranks: the ranks whose shares are wanted.
            budget: what each microbatch's prediction must fit, bytes.
            first_phase: the phase each step's first microbatch runs in ("with_gradients":
                every microbatch predicted by the steady model).

        Returns:
            One packed share per rank of ``ranks``, in that order; record indices into the dataset.
        """
        sort_by = _sort_by_or_default(self.sort_by, self.model)
        only_rank = ranks[0] if len(ranks) == 1 and not self.lockstep else -1
        _, plans = _planner.plan_step(self.packer, sort_by, self.dims[records], self.model._native, int(budget),
                                      self.world_size, self.lockstep, int(only_rank), **self._phase_models(first_phase))
        return [self._of_outer_batch(Plan(*plans[rank]), records) for rank in ranks]

    def _phase_models(self, first_phase: GradientPhase) -> Dict[str, Optional[_planner.MemoryModel]]:
        """plan_step's phase models (step_plan.hpp, StepPhaseModels): None where the model has no
        fit of the phase, all None when the first microbatch runs with the gradients held."""
        if first_phase == "with_gradients":
            return {}
        model = self.model
        return {"first_of_several": model._phase_native(first_phase, floor=False),
                "first_alone": model._phase_native(first_phase),
                "synchronised": model._phase_native("synchronised")}

    def _of_outer_batch(self, plan: Plan, records: np.ndarray) -> Packed:
        if len(plan) == 0:
            empty = np.zeros(len(self.model.formula.variable_names))
            return [np.zeros(0, dtype=np.int64)], [empty], [float(self.model.predict(empty)[0])]
        return ([records[k] for k in plan.microbatches], [row.copy() for row in plan.dims],
                [float(b) for b in plan.predicted_bytes])

    def step_of(self, packed: Packed, total_units: float, correction: Correction) -> Step:
        """A ``Step`` of a share's packed microbatches: their weights, each prediction's
        correction.

        Args:
            packed: the packed share.
            total_units: the whole outer batch's units (all ranks).
            correction: the calibration's correction the step is planned with.

        Returns:
            The step.
        """
        microbatches, dims, predicted = packed
        scale = self.world_size / total_units if total_units > 0 else 0.0
        positions = positions_with_records(microbatches)
        return Step(microbatches, [scale * float(self.units[mb].sum()) for mb in microbatches], total_units,
                    dims, predicted, [0.0 if position is None else correction.bytes_for(p, position)
                                      for position, p in zip(positions, predicted)], positions)
