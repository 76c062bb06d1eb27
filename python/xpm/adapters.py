"""For trainers that take one batch per optimizer step (the Hugging Face Trainer, Lightning with
manual optimization): one item per step, holding the step's microbatches and their weights.

    steps = xpm.StepDataset(dataset, sampler, collate_fn)       # item k: [(batch, weight), ...]
    loader = torch.utils.data.DataLoader(steps, batch_size=None, shuffle=False)

    # Hugging Face Trainer (gradient_accumulation_steps=1): return `loader` from
    # get_train_dataloader() and run the microbatches in training_step:
    class PlannedTrainer(transformers.Trainer):
        def get_train_dataloader(self):
            return loader
        def training_step(self, model, inputs):
            return xpm.accumulate(inputs, lambda batch: self.compute_loss(model, batch),
                                  self.accelerator.backward)

    # Lightning (self.automatic_optimization = False): train_dataloader() returns `loader`;
    # training_step(self, inputs, index): xpm.accumulate(inputs, self.mean_loss, self.manual_backward),
    # then self.optimizers().step(); self.optimizers().zero_grad()

The trainer then clips and steps once per item. Neither package is needed here: the contract
is ``accumulate`` over one item, which tests/python checks with a stand-in of the trainer loop.
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
