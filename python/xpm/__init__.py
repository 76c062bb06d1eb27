"""xpm: predictive memory planning for PyTorch training.

A cost formula (``a*bs*l^2 + b*bs*l + c`` bytes) is fitted to a few probe steps; then every
outer batch is split into microbatches predicted to fit the memory budget, the same plan on
every rank. ``docs/python.md`` has the guide.

- ``CostFormula``, ``fit``, ``MemoryModel``, ``MemoryBudget``, ``plan`` (no torch needed);
- ``probe``, ``CpuMeter``, ``CudaMeter`` (need torch);
- ``PredictiveBatchSampler``, ``microbatch_loop`` (a ``torch.utils.data`` batch sampler),
  ``check_unplanned_memory`` (memory allocated after probing);
- ``StepDataset``, ``accumulate`` (one item per optimizer step, for the HF Trainer, Lightning).
"""
from .planning import (PACKERS, CostFormula, FitReport, FormulaError, MemoryBudget, MemoryModel, Plan, fit,
                       plan, record_dims_from_lengths)
from .adapters import StepDataset, accumulate
from .sampler import Microbatch, PredictiveBatchSampler, Step, check_unplanned_memory, microbatch_loop

__all__ = ["PACKERS", "CostFormula", "FitReport", "FormulaError", "MemoryBudget", "MemoryModel", "Plan", "fit",
           "plan", "record_dims_from_lengths", "PredictiveBatchSampler", "Microbatch", "Step", "microbatch_loop",
           "check_unplanned_memory", "StepDataset", "accumulate",
           "probe", "CpuMeter", "CudaMeter", "ProbeOutcome", "AdaptiveReport"]


def __getattr__(name):
    # The torch side loads on first use, so the planner core imports without torch.
    if name in ("probe", "CpuMeter", "CudaMeter", "ProbeOutcome", "AdaptiveReport"):
        from . import probing
        return getattr(probing, name)
    raise AttributeError(f"module 'xpm' has no attribute {name!r}")
