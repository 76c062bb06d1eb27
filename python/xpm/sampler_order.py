"""The sampler's order of an epoch: its records shuffled with ``seed + epoch`` (the same
permutation on every rank) and cut into outer batches, one per optimizer step.
"""
from __future__ import annotations

from typing import List

import numpy as np


def outer_batches(records: int, outer_batch_size: int, *, seed: int, epoch: int, shuffle: bool,
                  drop_last: bool) -> List[np.ndarray]:
    """The epoch's outer batches: its permutation cut.

    Args:
        records: the number of records.
        outer_batch_size: records per outer batch.
        seed: the shuffle's seed.
        epoch: the epoch (its permutation uses ``seed + epoch``).
        shuffle: shuffle the records (else they go in order).
        drop_last: leave out the last outer batch when it is short.

    Returns:
        The record indices (int64 arrays) of each outer batch, in order.
    """
    order = np.random.default_rng(seed + epoch).permutation(records) if shuffle else np.arange(records)
    cut = records - records % outer_batch_size if drop_last else records
    return [order[i:i + outer_batch_size] for i in range(0, cut, outer_batch_size)]


def outer_batch_count(records: int, outer_batch_size: int, drop_last: bool) -> int:
    """The outer batches of an epoch (the last short one left out with ``drop_last``).

    Args:
        records: the number of records.
        outer_batch_size: records per outer batch.
        drop_last: leave out the last outer batch when it is short.

    Returns:
        The number of outer batches, one optimizer step each.
    """
    return records // outer_batch_size if drop_last else -(-records // outer_batch_size)
