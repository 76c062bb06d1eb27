"""What a training step will hold that ``xpm.probe`` did not measure, named with its bytes.

    outcome = xpm.probe(model, optimizer, loss_fn, formula, meter=meter)
    for part in outcome.outside_probes:      # [] when the probes saw the step as it runs
        print(part.kind, part.bytes, part.note)

The probes measure the step they run: weights, gradients, optimizer state and whatever else is
allocated then are in every prediction. Some memory of the real step can only come later, and
``probe`` names what it can see coming:

- ``"gradient_buckets"``: a process group of more than one rank is initialised but the probed
  model is neither wrapped in ``DistributedDataParallel`` nor sharded by FSDP, nor part of a
  module a live ``DistributedDataParallel`` wraps (as Lightning wraps the LightningModule whose
  submodule is probed: its buckets exist and are in the probes). Wrapping it after
  the probes allocates DDP's gradient buckets, as many bytes as the trainable parameters'
  gradients (``gradient_as_bucket_view=False``, DDP's default; with True the gradients are views
  of the buckets and the figure is an upper bound). Probe the wrapped model on every rank
  (``lockstep=True``) and they are in the probes.

What cannot be seen at probe time is measured in training: memory allocated after probing by
``xpm.check_unplanned_memory`` at each step's start (``microbatch_loop(..., meter=...)`` and the
integrations call it), what a step allocates beyond its prediction by the calibration's
correction.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import List, Literal

import torch
import torch.distributed as dist

OutsideProbesKind = Literal["gradient_buckets"]
"""What memory outside the probes is (``OutsideProbes.kind``)."""


@dataclass(frozen=True)
class OutsideProbes:
    """Memory a training step will hold that the probes did not measure.

    Attributes:
        kind: what it is (``xpm.OutsideProbesKind``).
        bytes: how much, per rank, estimated at probe time.
        note: one sentence: where it comes from and how to bring it into the probes.
    """

    kind: OutsideProbesKind
    bytes: int
    note: str


def sharded_by_fsdp(model: torch.nn.Module) -> bool:
    """True when ``model`` or any submodule is sharded by FSDP (1 or 2)."""
    fsdp = getattr(torch.distributed, "fsdp", None)
    wrappers = tuple(w for w in (getattr(fsdp, "FSDPModule", None), getattr(fsdp, "FullyShardedDataParallel", None))
                     if isinstance(w, type))
    return bool(wrappers) and any(isinstance(module, wrappers) for module in model.modules())


def _wrapped_for_data_parallel(model: torch.nn.Module) -> bool:
    """True when ``model`` is DDP or FSDP (1 or 2, the root or any submodule sharded)."""
    return isinstance(model, torch.nn.parallel.DistributedDataParallel) or sharded_by_fsdp(model)


def _inside_data_parallel(model: torch.nn.Module) -> bool:
    """True when a live ``DistributedDataParallel`` wraps a module that holds ``model`` (Lightning
    wraps the LightningModule, whose submodule the user probes): its buckets exist already."""
    ddp = torch.nn.parallel.DistributedDataParallel
    return any(isinstance(holder, ddp) and any(m is model for m in holder.module.modules())
               for holder in gc.get_objects())


def trainable_gradient_bytes(model: torch.nn.Module) -> int:
    """The bytes of ``model``'s trainable parameters' gradients: what DDP's buckets hold
    (``gradient_as_bucket_view=False``, the default)."""
    return int(sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad))


def outside_probes_of(model: torch.nn.Module) -> List[OutsideProbes]:
    """What ``probe`` can tell, from the probed module and the process group, will be allocated
    after the probes (see the module docstring).

    Args:
        model: the module ``probe`` measured.

    Returns:
        The parts, possibly none.
    """
    parts: List[OutsideProbes] = []
    world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world_size > 1 and not _wrapped_for_data_parallel(model) and not _inside_data_parallel(model):
        gradient_bytes = trainable_gradient_bytes(model)
        parts.append(OutsideProbes(
            "gradient_buckets", gradient_bytes,
            f"the probed model is not wrapped for data parallelism although the process group has {world_size} "
            f"ranks: DistributedDataParallel allocates gradient buckets of {gradient_bytes} bytes when it wraps it "
            f"(none with gradient_as_bucket_view=True); "
            f"probe the wrapped model on every rank (lockstep=True) to measure them, or leave them out of the "
            f"budget (MemoryBudget(extra_overhead_bytes=...))"))
    return parts


def describe_outside_probes(parts: List[OutsideProbes]) -> str:
    """One line for a log: "outside the probes: nothing xpm can see" or each part with its bytes.

    Args:
        parts: ``ProbeOutcome.outside_probes``.

    Returns:
        The line.
    """
    if not parts:
        return ("outside the probes: nothing xpm can see before training (memory allocated after probing is "
                "measured at each step's start; the calibration measures the rest)")
    return "outside the probes: " + "; ".join(f"{p.kind} {p.bytes} bytes ({p.note})" for p in parts)
