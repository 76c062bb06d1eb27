"""Memory allocated at a step's start that no prediction holds (an optimizer or a cache created
after probing): ``check_unplanned_memory`` compares what is allocated with what the probes saw
and warns when microbatches planned up to the budget could run out of memory;
``microbatch_loop(..., meter=...)`` and the Hugging Face integration call it every step.
"""
from __future__ import annotations

import warnings
from typing import Optional, Tuple

import torch

from .memory_model import MemoryModel
from .meters import Meter

# Without a cap on the meter, the unplanned bytes worth a warning: this share of the budget.
UNPLANNED_SHARE_WITHOUT_CAPACITY = 0.10


def check_unplanned_memory(meter: Meter, model: MemoryModel, usable_bytes: int,
                           module: Optional[torch.nn.Module] = None) -> float:
    """Compares the bytes allocated now, at the start of an optimizer step, with what the
    model's probes had allocated before every probe (``model.static_bytes``: weights, gradients,
    optimizer state); warns when the difference, memory no prediction holds (a second optimizer
    created after probing, a cache, a dataset moved into tensors), is large enough that
    microbatches planned up to the budget can run out of memory.

    Call it between optimizer steps (after ``zero_grad``, before the next step's batch is made);
    ``microbatch_loop(..., meter=...)`` calls it at every step's start, and the Hugging Face
    integration at every ``training_step``.

    Args:
        meter: the meter the probes ran under (``xpm.CpuMeter`` or ``xpm.CudaMeter``).
        model: the memory model ``xpm.probe`` fitted (another model checks nothing).
        usable_bytes: the budget the plans fill.
        module: the trained module: the gradients ``zero_grad()`` has set to None are counted as
            allocated (the probes had them), so the check also holds after ``set_to_none``.

    Returns:
        The unplanned bytes (allocated now, plus the freed gradients, minus ``model.static_bytes``;
        0 when the model has no static bytes).

    Warns:
        RuntimeWarning (one line): the unplanned bytes exceed what the budget leaves under the
        meter's capacity (``capacity_bytes - usable_bytes``), or 10 % of ``usable_bytes`` when the
        meter has no capacity.
    """
    unplanned, message = _unplanned_memory(meter, model, usable_bytes, module)
    if message is not None:
        warnings.warn(message, RuntimeWarning, stacklevel=2)
    return unplanned


def _unplanned_memory(meter: Meter, model: MemoryModel, usable_bytes: int,
                      module: Optional[torch.nn.Module]) -> Tuple[float, Optional[str]]:
    """``check_unplanned_memory``'s unplanned bytes and its warning (None when there is none)."""
    static = model.static_bytes
    if static is None:
        return 0.0, None
    allocated = float(meter.current_allocated_bytes)
    if module is not None:
        allocated += sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad and p.grad is None)
    unplanned = allocated - static
    usable, capacity = int(usable_bytes), int(meter.capacity_bytes)
    room = capacity - usable if capacity > usable else UNPLANNED_SHARE_WITHOUT_CAPACITY * usable
    if unplanned <= room:
        return unplanned, None
    where = (f"the {capacity - usable} bytes the budget leaves under the meter's capacity of {capacity}"
             if capacity > usable else f"10 % of the budget of {usable} bytes (the meter has no capacity)")
    return unplanned, (f"xpm: {allocated:.0f} bytes are allocated at the start of a step but the probes saw "
                       f"{static:.0f} (weights, gradients, optimizer state): {unplanned:.0f} bytes no prediction "
                       f"holds, more than {where}, so microbatches can run out of memory; was an optimizer or a "
                       f"cache created after xpm.probe? create it before probing, or reserve it in "
                       f"MemoryBudget(extra_overhead_bytes=...)")
