"""xpm: predictive memory planning for PyTorch training.

A cost formula (``a*bs*l^2 + b*bs*l + c`` bytes) is fitted to a few probe steps; then every
outer batch is split into microbatches predicted to fit the memory budget, the same plan on
every rank. ``docs/python.md`` has the guide.

- ``CostFormula``, ``fit``, ``MemoryModel``, ``MemoryBudget``, ``plan`` (the planner core);
- ``probe``, ``CpuMeter``, ``CudaMeter`` (the CPU meter's extension loads on first
  ``CpuMeter.install()``);
- ``PredictiveBatchSampler``, ``microbatch_loop`` (a ``torch.utils.data`` batch sampler),
  ``check_unplanned_memory`` (memory allocated after probing), ``Calibration`` and ``Correction`` (predictions
  corrected by the peaks training measures, the same on every rank);
- ``StepDataset``, ``accumulate`` (one item per optimizer step, for the HF Trainer, Lightning);
- the closed sets of string arguments, as ``typing.Literal`` aliases for type checkers (each
  also checked at run time, a one-line ``ValueError`` naming the value): ``PackerName``
  (``plan``'s and the sampler's ``packer``), ``Aggregation`` (``fit``'s ``aggregation`` values),
  ``RecordAggregation`` (``probe``'s), ``GradientPhase`` (``MemoryModel.predict``'s ``phase``:
  a step's first microbatch after ``zero_grad(set_to_none=True)`` runs without gradients),
  ``DeviceKind`` (``probe``'s ``device``), ``AdaptiveStop``
  (``AdaptiveReport.stop``); ``Meter``, the meters ``probe`` takes;
- ``__version__``, the version of this copy (the same as the installed distribution's).
"""
from ._build_info import VERSION as __version__
from .planning import (GRADIENT_PHASES, PACKERS, Aggregation, CostFormula, FitReport, FormulaError, GradientPhase,
                       MemoryBudget, MemoryModel, PackerName, Plan, RecordAggregation, fit, plan,
                       record_dims_from_lengths)
from .probing import AdaptiveReport, AdaptiveStop, CpuMeter, CudaMeter, DeviceKind, Meter, ProbeOutcome, probe
from .adapters import StepDataset, accumulate
from .lockstep import stop_together
from .calibration import Calibration, Correction
from .sampler import Microbatch, PredictiveBatchSampler, Step, check_unplanned_memory, microbatch_loop

__all__ = ["PACKERS", "CostFormula", "FitReport", "FormulaError", "MemoryBudget", "MemoryModel", "Plan", "fit",
           "plan", "record_dims_from_lengths", "PredictiveBatchSampler", "Microbatch", "Step", "microbatch_loop",
           "check_unplanned_memory", "Calibration", "Correction", "StepDataset", "accumulate",
           "probe", "CpuMeter", "CudaMeter", "ProbeOutcome", "AdaptiveReport",
           "PackerName", "Aggregation", "RecordAggregation", "DeviceKind", "AdaptiveStop", "Meter", "stop_together",
           "GradientPhase", "GRADIENT_PHASES"]
