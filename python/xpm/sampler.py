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

This module gathers the sampler's parts, each importable from here: ``predictive_batch_sampler``
(the sampler, assembled from ``sampler_checks``, ``sampler_order``,
``sampler_packing``, ``sampler_calibration``, ``sampler_state`` and ``sampler_pass``),
``sampler_steps`` (``Microbatch``, ``Step``), ``sampler_loop`` (``microbatch_loop``),
``unplanned_memory`` (``check_unplanned_memory``) and ``sampler_lightning`` (its refusal of
Lightning's training loop over a plain loader).
"""
from __future__ import annotations

from .predictive_batch_sampler import PredictiveBatchSampler
from .sampler_checks import _checked_record_dims, _first_bad, _rank_and_world_size, _whole_number
from .sampler_lightning import _LIGHTNING_PACKAGES, LIGHTNING_PLAIN_LOADER_ERROR, _refuse_lightning_training_loop
from .sampler_loop import _holds_gradients, microbatch_loop
from .sampler_pass import _MicrobatchIterator
from .sampler_steps import Microbatch, Step
from .unplanned_memory import UNPLANNED_SHARE_WITHOUT_CAPACITY, _unplanned_memory, check_unplanned_memory

__all__ = ["PredictiveBatchSampler", "Microbatch", "Step", "microbatch_loop", "check_unplanned_memory",
           "UNPLANNED_SHARE_WITHOUT_CAPACITY", "LIGHTNING_PLAIN_LOADER_ERROR"]
