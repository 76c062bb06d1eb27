"""For trainers that take one batch per optimizer step: one item per step, holding the step's
microbatches and their weights.

    steps = xpm.StepDataset(dataset, sampler, collate_fn)       # item k: [(batch, weight), ...]
    loader = torch.utils.data.DataLoader(steps, batch_size=None, shuffle=False)
    for items in loader:                                        # one optimizer step each
        loss = xpm.accumulate(items, mean_loss, backward)
        optimizer.step(); optimizer.zero_grad(set_to_none=False)

``StepDataset`` plans the sampler's current epoch once, when it is built: build one per epoch
(after ``sampler.set_epoch``). For the Hugging Face Trainer, Lightning and accelerate use
``xpm.integrations`` (``hf_trainer.PlannedTrainer``, ``lightning.planned_dataloader``,
``accelerate.prepare_data_loader``), which handle their sharding, gradient synchronisation and
resume; this module is the same pattern for a loop of your own.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, List, Sequence, Tuple

import torch

from .sampler import PredictiveBatchSampler


class StepDataset:
    """A map-style dataset of the sampler's remaining steps in this epoch: item k is the list of
    (collate_fn([dataset[i] for i in microbatch]), weight) of step k. ``len``: the steps.

    Args:
        dataset: the records, indexed by the sampler's record indices (``dataset[i]``).
        sampler: the sampler, at the epoch to plan (``set_epoch`` first); planned here, once.
        collate_fn: makes one microbatch's batch from its records (a list).
    """

    def __init__(self, dataset: Sequence[Any], sampler: PredictiveBatchSampler,
                 collate_fn: Callable[[List[Any]], Any]) -> None:
        self.dataset, self.sampler, self.collate_fn = dataset, sampler, collate_fn
        self._steps = list(sampler.steps())

    def __len__(self) -> int:
        """The number of steps."""
        return len(self._steps)

    def __getitem__(self, k: int) -> List[Tuple[Any, float]]:
        """Step ``k``'s microbatches.

        Args:
            k: the step, in [0, ``len(self)``).

        Returns:
            ``[(collate_fn(records), weight), ...]``, one per microbatch (an empty one left out).

        Raises:
            IndexError: ``k`` out of range.
        """
        step = self._steps[k]
        return [(self.collate_fn([self.dataset[int(i)] for i in microbatch]), weight)
                for microbatch, weight in zip(step.microbatches, step.weights) if len(microbatch) > 0]


def accumulate(items: Iterable[Tuple[Any, float]], mean_loss: Callable[[Any], torch.Tensor],
               backward: Callable[[torch.Tensor], Any]) -> float:
    """Runs one step's microbatches: ``backward(weight * mean_loss(batch))`` for each. A rank
    whose share is empty returns 0 without a backward; under DDP give it a zero loss of the
    model's parameters so it joins the all-reduce.

    Args:
        items: one ``StepDataset`` item: ``[(batch, weight), ...]``.
        mean_loss: the loss of a batch, averaged over its units (a scalar tensor).
        backward: runs the backward of a loss (``loss.backward``, ``accelerator.backward``).

    Returns:
        The step's loss (the outer batch's mean over this rank's share), detached, a float.
    """
    total = 0.0
    for batch, weight in items:
        loss = weight * mean_loss(batch)
        backward(loss)
        total += float(loss.detach())
    return total
