"""The check every Lightning ``Trainer`` runs where xpm is installed: the package registers
``callbacks`` under Lightning's ``lightning.pytorch.callbacks_factory`` entry point, so Lightning
adds a ``PlainLoaderGuard`` to each Trainer it builds.

A training ``DataLoader(batch_sampler=xpm.PredictiveBatchSampler)`` under Lightning would take one
optimizer step per microbatch with the microbatches' weights ignored; the guard refuses it on every
rank before the first training step, naming ``planned_dataloader``:

    trainer = lightning.Trainer(..., use_distributed_sampler=False)
    trainer.fit(module)   # module.train_dataloader() returns DataLoader(data, batch_sampler=sampler)
    # ValueError: xpm: Lightning's training loop iterates a DataLoader over PredictiveBatchSampler: ...

It costs nothing where no ``xpm.PredictiveBatchSampler`` exists (the sampler's module is not even
imported then) and imports nothing of xpm's torch side. Where xpm is imported without its entry
point (from a build tree), the sampler refuses the same loader itself when Lightning's loop first
iterates it (``xpm.sampler_lightning._refuse_lightning_training_loop``).
"""
from __future__ import annotations

import sys
from typing import Any, List

import lightning.pytorch as pl
from lightning_utilities.core.apply_func import apply_to_collection
from torch.utils.data import DataLoader

__all__ = ["PlainLoaderGuard", "callbacks"]

class PlainLoaderGuard(pl.Callback):
    """Refuses, at ``on_train_start`` on every rank, a training loader whose batch sampler is an
    ``xpm.PredictiveBatchSampler`` (``planned_dataloader``'s loaders have none)."""

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Raises ValueError (one line naming ``planned_dataloader``) for a plain loader over the sampler."""
        sampler_module = sys.modules.get("xpm.predictive_batch_sampler")  # where the class is defined
        if sampler_module is None:
            return
        loaders: List[DataLoader] = []
        apply_to_collection(trainer.train_dataloader, DataLoader, loaders.append)
        if any(isinstance(loader.batch_sampler, sampler_module.PredictiveBatchSampler) for loader in loaders):
            raise ValueError(sys.modules["xpm.sampler_lightning"].LIGHTNING_PLAIN_LOADER_ERROR)


def callbacks() -> List[Any]:
    """Lightning's entry point: the callbacks xpm adds to every ``Trainer``.

    Returns:
        ``[PlainLoaderGuard()]``.
    """
    return [PlainLoaderGuard()]
