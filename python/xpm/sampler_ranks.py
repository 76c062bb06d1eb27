"""The sampler's rank assignment: an outer batch's records shared among the ranks, balanced by
their predicted cost (longest processing time first, by the planner core), the same shares on
every rank.
"""
from __future__ import annotations

from typing import List

import numpy as np

from . import _planner
from .memory_model import MemoryModel


def record_costs(model: MemoryModel, dims: np.ndarray, usable_bytes: int, outer_batch_size: int,
                 world_size: int) -> np.ndarray:
    """What the rank assignment balances: each record's share of the largest microbatch of its
    kind, of at most a rank's share of an outer batch.

    Args:
        model: the memory model.
        dims: [n, variables] record dims.
        usable_bytes: the budget.
        outer_batch_size: records per optimizer step, over all ranks.
        world_size: the number of ranks.

    Returns:
        [n] costs.
    """
    return _planner.record_costs(model._native, dims, usable_bytes, -(-outer_batch_size // world_size))


def rank_shares(records: np.ndarray, costs: np.ndarray, world_size: int) -> List[np.ndarray]:
    """An outer batch's records shared among the ranks.

    Args:
        records: the outer batch's record indices.
        costs: every record's cost (``record_costs``).
        world_size: the number of ranks.

    Returns:
        Each rank's record indices (int64 arrays, possibly empty), in rank order.
    """
    shares = _planner.assign_records_to_ranks(costs[records].tolist(), world_size)
    return [records[np.asarray(share, dtype=np.int64)] for share in shares]
