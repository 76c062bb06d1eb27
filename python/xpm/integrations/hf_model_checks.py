"""The checks ``PlannedTrainer`` runs on the model before its first step, through its own
``compute_loss`` on short records of the dataset: that a loss given ``num_items_in_batch``
divides by it (else the microbatch losses are weighted), and that a model fed padding-free
microbatches keeps their records apart. Each leaves the trainer's state as it was.
"""
from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from typing import Any, Dict, List, Optional

import numpy as np
import torch
import transformers

from .dataset_probes import ProbeRecords
from .hf_planning import TrainerSnapshot, label_items, loss_normalisation, planning_mode


def loss_divides_by_items(trainer: transformers.Trainer, logger: logging.Logger) -> bool:
    """Checks on one real microbatch that a loss given ``num_items_in_batch`` divides by it;
    a model that ignores it (its ``forward`` takes ``**kwargs`` but its loss is a plain mean)
    has ``model_accepts_loss_kwargs`` set False and its microbatch losses weighted instead.

    Args:
        trainer: the ``PlannedTrainerMixin`` trainer, its model prepared and its sampler made.
        logger: where a loss that ignores the count, or changes unclearly, is warned about.

    Returns:
        Whether the loss divides by ``num_items_in_batch``: False for a model whose loss takes
        none or ignores it; True where the records have no labels to count.
    """
    if not (trainer.model_accepts_loss_kwargs or trainer.compute_loss_func is not None):
        return False
    collator = trainer._get_collator_with_removed_columns(trainer.data_collator, description="Training")
    batch = trainer._prepare_inputs(collator(small_records(trainer)))
    items = label_items(batch, getattr(trainer, "_loss_shifts_labels", False)) if isinstance(batch, Mapping) else None
    if not items:
        return True
    model = trainer.model

    def loss_of(count: int) -> torch.Tensor:
        with trainer.accelerator.autocast(), trainer.compute_loss_context_manager():
            return trainer.compute_loss(model, dict(batch),
                                        num_items_in_batch=torch.tensor(count, device=trainer.args.device))

    snapshot = TrainerSnapshot(trainer)
    try:
        verdict, ratio = loss_normalisation(loss_of, items)
    finally:
        snapshot.restore()
    name = type(getattr(model, "module", model)).__name__
    if verdict == "ignores":
        if trainer.compute_loss_func is None:
            trainer.model_accepts_loss_kwargs = False
        logger.warning("xpm: %s's loss ignores num_items_in_batch (the same loss at %d and %d items), though the "
                       "Trainer passes it; each microbatch's mean loss is weighted by its share of the outer "
                       "batch's label items instead", name, items, 2 * items)
    elif verdict == "unclear":
        logger.warning("xpm: %s's loss given num_items_in_batch %d and %d changed by a factor %.4f, neither 2 "
                       "(divides) nor 1 (ignores); left as the Trainer passes it", name, items, 2 * items, ratio)
    return verdict != "ignores"


def check_records_kept_apart(trainer: transformers.Trainer, logger: logging.Logger) -> None:
    """Warns when the model attends across the records a padding-free collator flattens: the
    logits of one record, alone and after another, through the trainer's ``compute_loss``.

    Args:
        trainer: the ``PlannedTrainerMixin`` trainer, its model prepared and its sampler made.
        logger: where the warning goes.
    """
    dataset = trainer.train_dataset
    if dataset is None or len(dataset) < 2:
        return
    collator = trainer._get_collator_with_removed_columns(trainer.data_collator, description="Training")
    model = trainer.model
    first, second = small_records(trainer)
    tokens = len(second["input_ids"])

    def logits_of(records) -> Optional[torch.Tensor]:
        batch = trainer._prepare_inputs(collator(records))
        with torch.no_grad(), trainer.accelerator.autocast(), trainer.compute_loss_context_manager(), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # TRL deprecates return_outputs for its own users
            outputs = trainer.compute_loss(model, batch, return_outputs=True)[1]
        logits = outputs.get("logits") if isinstance(outputs, Mapping) else None
        return None if logits is None else logits.reshape(-1, logits.shape[-1])[-tokens:].float()

    snapshot, training = TrainerSnapshot(trainer), model.training
    model.eval()
    try:
        alone, after = logits_of([second]), logits_of([first, second])
    finally:
        model.train(training)
        snapshot.restore()
    if alone is None or after is None or alone.shape != after.shape:
        return
    change = float((alone - after).abs().max())
    if change > 1e-3 * max(1e-6, float(alone.abs().max())):
        logger.warning("xpm: %s attends across the records a padding-free collator flattens (a record's logits "
                       "change by up to %.3g after another record): a microbatch's loss then depends on which "
                       "records share it, with or without xpm; under sdpa attention pass use_cache=False (packed "
                       "records are then told apart by their position_ids) or use flash attention",
                       type(getattr(model, "module", model)).__name__, change)


def small_records(trainer: transformers.Trainer) -> List[Dict[str, Any]]:
    """Two short records made from the dataset's shortest (``ProbeRecords.small``; the
    shortest twice where its shape is not one ``ProbeRecords`` knows), for the checks before
    training: they fit the budget wherever anything does.

    Args:
        trainer: the ``PlannedTrainerMixin`` trainer, its sampler made.

    Returns:
        Two dataset items.
    """
    dataset = trainer.train_dataset
    shortest = int(np.argmin(trainer.xpm_sampler._dims[:, 1:].sum(axis=1)))
    try:
        return ProbeRecords(dataset, None, planning_mode(trainer), source_index=shortest).small()
    except (KeyError, ValueError, TypeError):  # records of the user's own shape: two of them as they are
        return [dataset[shortest], dataset[shortest]]
