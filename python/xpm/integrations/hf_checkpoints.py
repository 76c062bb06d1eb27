"""The sampler's state in ``PlannedTrainer``'s checkpoints: written beside the Trainer's own
(``SAMPLER_STATE_NAME``), and on resume loaded into the sampler and checked against it (same
settings) and against the Trainer's step count.
"""
from __future__ import annotations

import json
import os

from transformers.trainer import TRAINER_STATE_NAME

from ..sampler import PredictiveBatchSampler

SAMPLER_STATE_NAME = "xpm_sampler_state.json"
"""File in each checkpoint folder holding the sampler's ``state_dict()``."""


def save_sampler_state(folder: str, sampler: PredictiveBatchSampler) -> None:
    """Writes ``sampler.state_dict()`` into a checkpoint folder (``SAMPLER_STATE_NAME``).

    Args:
        folder: the checkpoint folder the Trainer has just written.
        sampler: the trainer's sampler.
    """
    with open(os.path.join(folder, SAMPLER_STATE_NAME), "w") as out:
        json.dump(sampler.state_dict(), out, indent=1)


def check_sampler_checkpoint(sampler: PredictiveBatchSampler, checkpoint: str) -> None:
    """Loads a checkpoint's sampler state into ``sampler`` and checks it against the Trainer's
    step count in the same checkpoint.

    Args:
        sampler: the trainer's sampler.
        checkpoint: the checkpoint folder.

    Raises:
        ValueError: the checkpoint has no sampler state, was written by a sampler with other
            settings, or its step count differs from the Trainer's.
    """
    path = _sampler_state_path(checkpoint)
    with open(path) as source:
        saved = json.load(source)
    try:
        sampler.load_state_dict(saved)  # ValueError for other settings
    except ValueError as error:
        raise ValueError(f"PlannedTrainer: {path} was written by another plan: {error} (the outer batch is "
                         "per_device_train_batch_size x gradient_accumulation_steps x world size; resume with "
                         "the arguments the checkpoint was trained with)") from None
    with open(os.path.join(checkpoint, TRAINER_STATE_NAME)) as source:
        global_step = json.load(source)["global_step"]
    done = saved["epoch"] * sampler.steps_per_epoch() + saved["steps_done"]
    if done != global_step:
        raise ValueError(f"PlannedTrainer: checkpoint '{checkpoint}' is at global step {global_step} but its "
                         f"sampler state is at step {done} (epoch {saved['epoch']}, step {saved['steps_done']})")


def _sampler_state_path(checkpoint: str) -> str:
    """The sampler state file of ``checkpoint``; ValueError in one line when it has none."""
    path = os.path.join(checkpoint, SAMPLER_STATE_NAME)
    if not os.path.isfile(path):
        raise ValueError(f"PlannedTrainer: checkpoint '{checkpoint}' has no {SAMPLER_STATE_NAME} (not written by "
                         "PlannedTrainer); resume from one that is, or start without resume_from_checkpoint")
    return path
