"""xpm: predictive memory planning for PyTorch training.

A cost formula (``a*bs*l^2 + b*bs*l + c`` bytes) is fitted to a few probe steps; then every
outer batch is split into microbatches predicted to fit the memory budget, the same plan on
every rank. ``docs/python.md`` has the guide.

- ``CostFormula``, ``fit``, ``MemoryModel``, ``MemoryBudget``, ``plan`` (the planner core;
  it imports without torch, and the names below import torch on first use);
- ``probe`` and its ``ProbeOptions``, ``CpuMeter``, ``CudaMeter`` (the CPU meter's extension loads on first
  ``CpuMeter.install()``), ``OutsideProbes`` (what training allocates that the probes did not measure);
- ``PredictiveBatchSampler``, ``microbatch_loop`` (a ``torch.utils.data`` batch sampler),
  ``check_unplanned_memory`` (memory allocated after probing), ``Calibration`` and ``Correction`` (predictions
  corrected by the peaks training measures, the same on every rank);
- ``StepDataset``, ``accumulate`` (one item per optimizer step, for the HF Trainer, Lightning);
  ``PlannedStep``, the item of the HF Trainer's and Lightning's step loaders (one optimizer step
  of one rank: its collated microbatches, their records and weights; imports without torch);
- the closed sets of string arguments, as ``typing.Literal`` aliases for type checkers (each
  also checked at run time, a one-line ``ValueError`` naming the value): ``PackerName``
  (``plan``'s and the sampler's ``packer``), ``Aggregation`` (``fit``'s ``aggregation`` values),
  ``RecordAggregation`` (``probe``'s), ``GradientPhase`` (``MemoryModel.predict``'s ``phase``:
  a step's first microbatch after ``zero_grad(set_to_none=True)`` runs without gradients),
  ``MicrobatchPosition`` (a microbatch's place in its step, ``microbatch_position``: the
  calibration draws a line per position, ``Correction.positions``),
  ``DeviceKind`` (``probe``'s ``device``), ``AdaptiveStop``
  (``AdaptiveReport.stop``), ``OutsideProbesKind``; ``Meter``, the meters ``probe`` takes;
- ``__version__``, the version of this copy (the same as the installed distribution's).
"""
import importlib as _importlib
from typing import TYPE_CHECKING, Any, List

from ._build_info import VERSION as __version__

try:  # the compiled planner core, without which nothing here works
    _importlib.import_module(f"{__name__}._planner")
except ModuleNotFoundError as _missing:
    if _missing.name != f"{__name__}._planner":
        raise
    raise ImportError(f"xpm: the compiled planner core (_planner) is not in {__path__[0]}: in a build tree, build it "
                      "with `cmake --build build --target xpm_python_planner xpm_python_torch` (make test builds "
                      "it); else install the package (pip install xpm-*.whl)") from None

from .planning import (GRADIENT_PHASES, PACKERS, Aggregation, CostFormula, FitReport, FormulaError, GradientPhase,
                       MemoryBudget, MemoryModel, PackerName, Plan, RecordAggregation, fit, plan,
                       record_dims_from_lengths)
from .planned_step import PlannedStep
from .choices import MICROBATCH_POSITIONS, MicrobatchPosition, microbatch_position

# The torch side, imported on first use: the planner core above imports without torch.
_TORCH_SIDE = {
    "probing": ["AdaptiveReport", "AdaptiveStop", "ProbeOutcome", "probe"],
    "probe_options": ["ProbeOptions"],
    "meters": ["CpuMeter", "CudaMeter", "DeviceKind", "Meter"],
    "adapters": ["StepDataset", "accumulate"],
    "lockstep": ["stop_together"],
    "outside_probes": ["OutsideProbes", "OutsideProbesKind"],
    "calibration": ["Calibration", "Correction"],
    "sampler": ["Microbatch", "PredictiveBatchSampler", "Step", "check_unplanned_memory", "microbatch_loop"],
}
_MODULE_OF = {name: module for module, names in _TORCH_SIDE.items() for name in names}

if TYPE_CHECKING:  # what type checkers and IDEs see at once
    from .adapters import StepDataset, accumulate
    from .calibration import Calibration, Correction
    from .lockstep import stop_together
    from .meters import CpuMeter, CudaMeter, DeviceKind, Meter
    from .outside_probes import OutsideProbes, OutsideProbesKind
    from .probe_options import ProbeOptions
    from .probing import AdaptiveReport, AdaptiveStop, ProbeOutcome, probe
    from .sampler import Microbatch, PredictiveBatchSampler, Step, check_unplanned_memory, microbatch_loop


def __getattr__(name: str) -> Any:
    """The torch side's names (``xpm.probe``, ``xpm.PredictiveBatchSampler``, ...), imported
    on first use; ``ModuleNotFoundError`` in one line without torch."""
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'xpm' has no attribute {name!r}")
    import importlib

    try:
        value = getattr(importlib.import_module(f".{module}", __name__), name)
    except ModuleNotFoundError as error:
        if error.name != "torch":
            raise
        raise ModuleNotFoundError(f"xpm.{name} needs torch (2.11 to 2.14), which this Python cannot import; the "
                                  "planner core (CostFormula, fit, MemoryModel, plan) works without it",
                                  name="torch") from None
    globals()[name] = value
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_MODULE_OF))


__all__ = ["__version__", "PACKERS", "CostFormula", "FitReport", "FormulaError", "MemoryBudget", "MemoryModel", "Plan",
           "fit", "plan", "record_dims_from_lengths", "PredictiveBatchSampler", "Microbatch", "Step", "microbatch_loop",
           "check_unplanned_memory", "Calibration", "Correction", "StepDataset", "accumulate", "PlannedStep",
           "probe", "ProbeOptions", "CpuMeter", "CudaMeter", "ProbeOutcome", "AdaptiveReport", "OutsideProbes",
           "OutsideProbesKind",
           "PackerName", "Aggregation", "RecordAggregation", "DeviceKind", "AdaptiveStop", "Meter", "stop_together",
           "GradientPhase", "GRADIENT_PHASES", "MicrobatchPosition", "MICROBATCH_POSITIONS", "microbatch_position"]
