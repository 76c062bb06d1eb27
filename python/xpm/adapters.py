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

from typing import Callable, List, Tuple

from .sampler import PredictiveBatchSampler


class StepDataset:
    """A map-style dataset of the sampler's remaining steps in this epoch: item k is the list of
    (collate_fn([dataset[i] for i in microbatch]), weight) of step k. ``len``: the steps."""

    def __init__(self, dataset, sampler: PredictiveBatchSampler, collate_fn: Callable):
        self.dataset, self.sampler, self.collate_fn = dataset, sampler, collate_fn
        self._steps = list(sampler.steps())

    def __len__(self) -> int:
        return len(self._steps)

    def __getitem__(self, k: int) -> List[Tuple[object, float]]:
        step = self._steps[k]
        return [(self.collate_fn([self.dataset[int(i)] for i in microbatch]), weight)
                for microbatch, weight in zip(step.microbatches, step.weights) if len(microbatch) > 0]


def accumulate(items, mean_loss: Callable, backward: Callable):
    """Runs one step's microbatches: ``backward(weight * mean_loss(batch))`` for each; returns
    the step's loss (the outer batch's mean over this rank's share), detached. A rank whose
    share is empty returns 0 without a backward; under DDP give it a zero loss of the model's
    parameters so it joins the all-reduce."""
    total = 0.0
    for batch, weight in items:
        loss = weight * mean_loss(batch)
        backward(loss)
        total += float(loss.detach())
    return total
