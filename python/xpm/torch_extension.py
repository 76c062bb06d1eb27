"""Loads ``xpm._torch``, the extension linked to one torch build, after checking that the torch
this process imported is that build."""
from __future__ import annotations

from types import ModuleType


def load_torch_extension() -> ModuleType:
    """Returns the ``xpm._torch`` module.

    Returns:
        The extension module (the CPU memory meter).

    Raises:
        ImportError: the running torch is not the one xpm was built against (one line naming
            both versions), or the extension cannot be loaded.
    """
    import torch

    from ._build_info import TORCH_VERSION

    if torch.__version__ != TORCH_VERSION:
        raise ImportError(
            f"xpm was built against torch {TORCH_VERSION} but this process runs torch {torch.__version__}; "
            "reinstall xpm in this environment: pip install --no-build-isolation --force-reinstall <xpm source folder>")
    from . import _torch

    return _torch
