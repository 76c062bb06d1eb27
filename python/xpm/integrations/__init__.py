"""xpm where PyTorch users train: the Hugging Face Trainer, Lightning, accelerate.

Each submodule imports its package only when imported itself, so ``import xpm`` needs none of
them.
"""
