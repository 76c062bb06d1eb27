"""The sampler's own refusal of Lightning's training loop iterating a plain ``DataLoader`` over
it (one optimizer step per microbatch, the weights ignored), which holds where xpm is imported
without its entry point's ``PlainLoaderGuard`` (``xpm.integrations.lightning_guard``).
"""
from __future__ import annotations

import sys

LIGHTNING_PLAIN_LOADER_ERROR = (
    "xpm: Lightning's training loop iterates a DataLoader over PredictiveBatchSampler: it would step the optimizer "
    "once per microbatch and ignore their weights; return xpm.integrations.lightning.planned_dataloader(self.trainer, "
    "dataset, sampler, collate_fn) from train_dataloader()")
"""The refusal of a plain ``DataLoader`` over the sampler under Lightning's training loop."""

_LIGHTNING_PACKAGES = ("lightning.pytorch.", "pytorch_lightning.")


def _refuse_lightning_training_loop() -> None:
    """Refuses Lightning's training loop iterating the sampler through its loader (its combined
    loader, under its fit loop): the loop takes one optimizer step per loader item. Read from the
    call stack once a pass, so it holds however xpm was imported (the entry point's
    ``PlainLoaderGuard`` is there only where xpm is installed): the guard is added to that
    trainer's callbacks, and refuses (``LIGHTNING_PLAIN_LOADER_ERROR``) before the first step,
    since an error raised here, while Lightning sets up its data, ends in one of Lightning's own.
    A user's own iteration inside ``training_step`` passes.

    Raises:
        ValueError: the trainer cannot be found on the stack (the refusal, at once).
    """
    by_loader, trainer = False, None
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith(_LIGHTNING_PACKAGES):
            by_loader = by_loader or module.endswith(".utilities.combined_loader")
            if module.endswith((".loops.fit_loop", ".loops.training_epoch_loop")):
                trainer = getattr(frame.f_locals.get("self"), "trainer", trainer)
                if trainer is None:
                    raise ValueError(LIGHTNING_PLAIN_LOADER_ERROR)
        frame = frame.f_back
    if not by_loader or trainer is None:
        return
    from .integrations.lightning_guard import PlainLoaderGuard

    if not any(isinstance(callback, PlainLoaderGuard) for callback in trainer.callbacks):
        trainer.callbacks.append(PlainLoaderGuard())
