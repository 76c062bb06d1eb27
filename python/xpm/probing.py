"""Probing a user's PyTorch training step and fitting its memory model, from Python.

    meter = xpm.CpuMeter.install()          # CPU: before the model is built (it must see the weights)
    meter.capacity_bytes = 200_000_000      # the cap the probes and the steps run under
    model = MyModel(); optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    result = xpm.probe(model, optimizer, lambda dims: model.loss_sum(random_batch(dims)),
                       xpm.CostFormula("a*bs*l + b*bs + c", ["bs", "l"]),
                       variable_max={"bs": 64, "l": 300}, meter=meter)
    result.model.predict([8, 120])          # bytes

What a probe runs, as the C++ probe does: gradients zeroed in place (allocated when missing),
``loss_fn(dims).backward()`` (the forward/backward peak), ``optimizer.step()`` at learning rate
0 (the optimizer-step peak), each phase's peak allocated bytes read from the meter. Before
those, with ``measure_phases`` (the default), one more ``loss_fn(dims).backward()`` with every
gradient set to None: the peak of a step's first microbatch after ``zero_grad()``, fitted as the
model's "without_gradients" phase (``xpm.GradientPhase``), which the sampler predicts each
step's first microbatch with. Before the
first probe every trainable parameter has a gradient and the optimizer its state (one step at
learning rate 0): the steady state of training. Afterwards the optimizer's state, its learning
rates and the CPU (and CUDA) random generators are as they were; the parameters are unchanged
(every ``torch.optim`` optimizer but LBFGS scales its update with the learning rate). A probe
that runs out of memory is an upper bound of what fits, never dropped. The automatic design
(no ``probe_points``): for each fraction of ``design_fractions``, the other variables at that
fraction of their max, the batch size doubling from 1 to ``variable_max[bs]`` until the budget
or the first out-of-memory probe, then one bisection. Under DistributedDataParallel, probe the
wrapped model on every rank with ``lockstep=True``: its gradient buckets are then in the probes.
Probed on rank 0 alone before wrapping (share ``result.model.to_json()`` with the other ranks),
``result.outside_probes`` names the buckets with their bytes.

On a GPU: ``xpm.probe(..., meter=None, device="cuda")`` (or ``meter=xpm.CudaMeter()``) with the
model and the loss's batches on that device. ``device=`` is checked first, against the meter
and the model's parameters: a mismatch, or ``"cuda"`` where torch sees no GPU, is a one-line
``ValueError`` before anything is probed.
"""
from __future__ import annotations

import json
import re
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Literal, Optional, Tuple, Union

import numpy as np
import torch

from . import _planner
from .calibration import covering_correction
from .lockstep import Lockstep
from .outside_probes import OutsideProbes, describe_outside_probes, outside_probes_of, sharded_by_fsdp
from .meters import Meter, PlannedBytes, planned_bytes_kind
from .fitting import _report
from .planning import CostFormula, FitReport, GradientPhase, MemoryModel, RecordAggregation
from .record_dims import _matrix
from .probe_executor import _TorchExecutor, _enter_steady_state
from .probe_options import ProbeOptions, _probe_setup


AdaptiveStop = Literal["not run", "agreed", "probe count", "no candidates"]
"""Why the adaptive probe design stopped (``AdaptiveReport.stop``)."""


@dataclass
class AdaptiveReport:
    """What the adaptive probe design did.

    Attributes:
        stop: why it stopped (``xpm.AdaptiveStop``): "not run", "agreed", "probe count" or
            "no candidates".
        added_probes: the probes it added to the initial design.
        elapsed_s: its time, seconds.
        disagreement: the largest relative disagreement of the candidate models at the last
            check (NaN when never computed).
        disagreement_dims: where that disagreement was (the formula's variables).
        report: a sentence.
    """

    stop: AdaptiveStop
    added_probes: int
    elapsed_s: float
    disagreement: float
    disagreement_dims: List[float]
    report: str


@dataclass
class ProbeOutcome:
    """What ``probe`` returns.

    Attributes:
        model: the fitted memory model.
        probes: every probe (``dims``, ``feasible`` False: ran out of memory,
            ``forward_backward_peak_bytes``, ``optimizer_step_peak_bytes``, ``step_peak_bytes``,
            ``capacity_bytes``, ``duration_s``, ``error``).
        fit: the fit report (``fit.formula_selection`` lists the candidates with ``formula="auto"``).
        floor: how the floor was chosen, a sentence.
        probe_s: the probing and fitting time, seconds.
        adaptive: what the adaptive design added and why it stopped.
        meter: the meter the probes ran under (the ``CudaMeter`` ``probe`` made for
            ``device="cuda"`` without a meter): give it to ``microbatch_loop(..., meter=)``.
        outside_probes: what training will allocate that the probes did not measure, each with
            its bytes (``xpm.OutsideProbes``; empty when nothing is seen coming);
            ``outside_report`` says it in one line.
        planned_bytes: what the peaks are (``xpm.meters.PlannedBytes``): ``"reserved"`` where a
            caching allocator holds segments (a GPU, the CPU meter with caching), measured from
            an emptied cache; else ``"allocated"``.
        reserved_ratios: with reserved peaks, each feasible probe's forward/backward reserved
            peak over its allocated one (``reserved_report`` says their range in one line).
    """

    model: MemoryModel
    probes: List[_planner.ProbeResult]
    fit: FitReport
    floor: str
    probe_s: float
    adaptive: AdaptiveReport
    meter: Optional[Meter] = None
    outside_probes: List[OutsideProbes] = field(default_factory=list)
    planned_bytes: PlannedBytes = "allocated"
    reserved_ratios: List[float] = field(default_factory=list)

    @property
    def reserved_report(self) -> str:
        """One line: what the peaks are, and the reserved / allocated ratios the probes saw."""
        if self.planned_bytes == "allocated":
            return "probes measured allocated bytes (no caching allocator)"
        if not self.reserved_ratios:
            return "probes measured reserved bytes; none was feasible"
        return (f"probes measured reserved bytes (the caching allocator's segments, from an emptied cache): "
                f"{min(self.reserved_ratios):.3f}x to {max(self.reserved_ratios):.3f}x the allocated peak")

    @property
    def outside_report(self) -> str:
        """One line naming what stays outside the probes, with its bytes, for a log."""
        return describe_outside_probes(self.outside_probes)


def probe(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
          loss_fn: Callable[[Union[List[float], List[List[float]]]], torch.Tensor],
          formula: Union[CostFormula, Literal["auto"]], *, meter: Optional[Meter],
          options: Optional[ProbeOptions] = None, **keywords: Any) -> ProbeOutcome:
    """Probes the step (see the module docstring) and fits ``formula``: on rank 0 alone, or on
    every rank in lockstep (an FSDP2 model, ``xpm.lockstep``).

    Args:
        model: the user's module as training steps it: wrapped in DistributedDataParallel or
            sharded by FSDP2 with ``lockstep=True`` (every rank calls ``probe``), else plain.
        optimizer: its optimizer, the one training steps (its state is probed too).
        loss_fn: ``loss_fn(dims)`` builds a batch at ``dims`` (variable order; synthetic data is
            fine) and returns its summed loss, a scalar tensor. With ``record_dims`` it gets the
            probe's records instead: ``loss_fn(records)``, one dims list per record (batch-size
            column 1), and builds a batch of exactly those records (each its own length).
        formula: the cost formula, or ``"auto"``: chosen from the probes (the variables are
            ``variables``, else ``variable_max``'s keys in order, or the first probe point's);
            the candidates and the choice are in ``outcome.fit.formula_selection``.
        meter: ``CpuMeter.install()`` (installed before the model was built: its CPU parameters
            must have been allocated under it) or ``CudaMeter()``; required, None only with
            ``device="cuda"`` (a ``CudaMeter`` of that device is made).
        options: the design, limits, device and lockstep (``xpm.ProbeOptions``, which documents
            each); default ``ProbeOptions(**keywords)``.
        **keywords: ``ProbeOptions`` fields given one by one instead of ``options``
            (``variable_max={"bs": 64, "l": 300}``).

    Returns:
        ProbeOutcome: the model, every probe, the fit report, the floor, the adaptive report and
        the meter.

    Raises:
        TypeError: a keyword that is not a ``ProbeOptions`` field, or ``options`` with keywords.
        ValueError: a ``model``, ``optimizer``, ``loss_fn`` or ``meter`` of the wrong kind, a
            ``lockstep`` or ``measure_phases`` that is not a bool, a DistributedDataParallel
            model, or an FSDP-sharded one at world size > 1, without ``lockstep``; bad options
            (a ``variable_max``, ``aggregation`` or ``probe_points`` key that is not a variable
            of the formula, named with the formula's variables; ``record_dims``
            of the wrong width, with a batch-size column other than 1 or a NaN, infinite or
            negative value, named by row; ``"auto"`` with ``record_dims`` but no ``variables``),
            an ``aggregation`` value other than "max" or "sum" (named with its variable), a
            ``CpuMeter`` that counts fewer bytes than the model's CPU parameters take (installed
            after the model was built), or a budget the probes cannot work under (nothing is
            probed then); a capacity under which too few probes fit for the formula's
            coefficients (after probing; its ``probes`` attribute holds them). ``device`` errors come first, one line each, before anything is
            touched: ``"cuda"`` where ``torch.cuda.is_available()`` is False (with the reason: a
            torch build without CUDA, or no GPU visible), a CUDA index torch does not see, a
            device that is not CPU or CUDA, a ``meter`` of another device (or None with
            ``"cpu"``, or with no ``device``), the model's parameters on another device, a
            ``batch_size_variable`` in which the formula grows faster than linearly (a length
            named as the batch size); a loss that is not finite (``probing at bs=8 l=64: the loss
            is not finite (nan): ...``: its gradients would turn the parameters into NaN at the
            probes' optimizer steps, learning rate 0 or not; the parameters are left as they were).
        RuntimeError: an unusable fit (its ``probes`` attribute holds the probes, so ``xpm.fit``
            can refit them; the note on ``usable_max_rel_error`` only where a reason is that
            limit). With ``lockstep``, every rank raises when one does: that rank its own error,
            the others a RuntimeError naming it.
        Exception: an error of ``loss_fn``, of its own type, its message prefixed with the
            probe's dims ("probing at bs=16 l=48: ...").

    After any error the frames the error passed through hold no locals (the probe's batches,
    graphs and saved optimizer state are freed), so keeping the exception keeps no memory.

    Warns:
        RuntimeWarning: two columns of ``record_dims`` are equal on every record and neither is
            summed (a count of real tokens left at the default aggregation, max).

    Whatever is allocated after probing (a dataset made of tensors, caches, a second optimizer)
    is not in the model: build it before, or leave room for it in ``budget``
    (``xpm.check_unplanned_memory`` warns about it during training). The model records the
    bytes allocated before every probe (``result.model.static_bytes``).
    """
    options = ProbeOptions.from_keywords(options, keywords)
    _check_arguments(model, optimizer, loss_fn, meter, options)
    ranks = Lockstep(options.process_group) if options.lockstep else None
    if ranks is None and options.process_group is not None:
        raise ValueError("probe: process_group names the ranks of lockstep=True probing; give lockstep=True")
    setup_error = None
    try:
        meter, formula, budget, args = _probe_setup(model, meter, formula, options)
    except Exception as error:  # noqa: BLE001 - raised below, on every rank in lockstep
        setup_error = error
    if ranks is not None:
        ranks.agree(setup_error, "probe: checking the options")
        ranks.same(_fingerprint(formula, options), "probe: the formula and options")
    elif setup_error is not None:
        raise setup_error
    try:
        return _probe_and_fit(model, optimizer, loss_fn, meter, formula, budget, args, ranks, options)
    except BaseException as error:
        _release_frames(error)  # the probe's batches, graphs and saved state go with the frames' locals
        raise


def _fingerprint(formula: CostFormula, options: ProbeOptions) -> str:
    """The formula and options as text, the same on ranks that gave the same ones (the process
    group left out; the budget by its bytes)."""
    fields = {name: repr(value) for name, value in vars(options).items() if name not in ("process_group", "budget")}
    budget = options.budget
    fields["budget"] = None if budget is None else [budget.capacity_bytes, budget.usable_bytes]
    return json.dumps({"formula": [formula.canonical, list(formula.variable_names)], **fields}, sort_keys=True)


def _check_arguments(model: Any, optimizer: Any, loss_fn: Any, meter: Any, options: ProbeOptions) -> None:
    """One-line ValueErrors for arguments of the wrong kind, and for a DistributedDataParallel
    or (at world size > 1) FSDP-sharded model without ``lockstep`` (its backward communicates:
    probed on one rank it waits for the others until the process group's timeout; probed on
    every rank apart, each rank's design may go its own way), before anything else."""
    def refuse(name: str, what: str, value: Any) -> None:
        raise ValueError(f"probe: {name} must be {what}, got {value!r}")

    if not isinstance(model, torch.nn.Module):
        refuse("model", "a torch.nn.Module", model)
    if not isinstance(optimizer, torch.optim.Optimizer):
        refuse("optimizer", "a torch.optim.Optimizer", optimizer)
    if not callable(loss_fn):
        refuse("loss_fn", "a function of the dims returning a scalar loss tensor", loss_fn)
    if meter is not None and not isinstance(meter, Meter):
        refuse("meter", "an xpm.CpuMeter or xpm.CudaMeter (or None with device='cuda')", meter)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"probe: model {type(model).__name__} has no parameter that requires grad: a training step "
                         "of it has nothing to train (unfreeze some parameters)")
    for name in ("lockstep", "measure_phases"):
        if not isinstance(getattr(options, name), bool):
            refuse(name, "True or False", getattr(options, name))
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) and not options.lockstep:
        raise ValueError("probe: a DistributedDataParallel model all-reduces in every backward, so one rank cannot "
                         "probe it alone: call probe on every rank with lockstep=True, or probe the unwrapped module "
                         "on one rank (outcome.outside_probes then names DDP's buckets)")
    dist = torch.distributed
    world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world_size > 1 and not options.lockstep and sharded_by_fsdp(model):
        raise ValueError(f"probe: an FSDP-sharded model gathers its parameters from all {world_size} ranks in every "
                         "forward and backward, so each rank's probes must run with the others': call probe on every "
                         "rank with lockstep=True")


def _probe_and_fit(model, optimizer, loss_fn, meter, formula, budget, args, ranks,
                   options: ProbeOptions) -> ProbeOutcome:
    """``probe``'s steps once its options are checked: the steady state, the probes, the fit."""
    start = time.perf_counter()
    steady = _enter_steady_state(model, optimizer, meter, ranks)
    executor = _TorchExecutor(steady, loss_fn, meter, list(formula.variable_names), options.batch_size_variable,
                              options.aggregation, ranks, options.measure_phases)
    try:
        native, probes, summary, floor, adaptive, selection = _planner.probe_and_fit(executor, formula, budget, args)
    except (RuntimeError, ValueError) as error:
        if error is executor.raised:  # a probe's own error (the loss function's): as it was raised
            raise
        # The planner's errors name its C++ class; the caller called probe.
        message = re.sub(r"^PredictiveBatcher: ", "probe: ", str(error)).replace(" (FitOptions::usable_max_rel_error)", "")
        failure = type(error)(f"{message} (xpm.probe(..., usable_max_rel_error=...) sets that limit, and a drop-in's "
                               f"probe_options=xpm.ProbeOptions(usable_max_rel_error=...); this error's .probes holds "
                               f"the {len(executor.results)} probes, for xpm.fit)"
                               if "above the limit" in message else message)
        failure.probes = list(executor.results)
        raise failure from None
    finally:
        try:
            executor.end_accumulation()
        finally:
            steady.__exit__(None, None, None)
    memory_model = MemoryModel(native)
    for phase, peaks in (("without_gradients", executor.without_gradients_peaks),
                         ("synchronised", executor.synchronised_peaks)):
        memory_model = _with_phase_fit(memory_model, phase, executor.results, peaks, options.aggregation,
                                       args.usable_max_rel_error)
    if executor.reserving:
        memory_model = _with_reserved_gap(memory_model, executor, budget)
    return ProbeOutcome(memory_model, list(probes), _report(summary, selection), floor,
                        time.perf_counter() - start, AdaptiveReport(**adaptive), meter, outside_probes_of(model),
                        planned_bytes_kind(meter), list(executor.reserved_ratios))


def _with_reserved_gap(model: MemoryModel, executor: _TorchExecutor, budget) -> MemoryModel:
    """``model`` (fitted to allocated peaks) with the line from its predictions to the reserved
    peaks of the feasible probes (``MemoryModel.reserved_gap``), drawn as the calibration draws
    its corrections: each probe's step against the model, and, where the model has the phase,
    its first microbatch's (the gradients allocated among the activations) against the
    "without_gradients" prediction."""
    points = [(model.predict(list(result.dims)), peak) for result, peak in
              zip(executor.results, executor.reserved_step_peaks) if result.feasible and peak > 0]
    if "without_gradients" in model.phases:  # a step's first microbatch, against its own prediction
        points += [(model.predict(list(result.dims), "without_gradients", floor=False), peak) for result, peak in
                   zip(executor.results, executor.reserved_without_gradients_peaks) if result.feasible and peak > 0]
    if not points:
        return model
    usable = budget.usable_bytes if budget is not None else max(peak for _, peak in points)
    gap = covering_correction([p for p, _ in points], [r for _, r in points], usable)
    return model._with_reserved_gap(gap.intercept_bytes, gap.slope, len(points))


def _with_phase_fit(model: MemoryModel, phase: GradientPhase, results: List[_planner.ProbeResult],
                    peaks: List[float], aggregation: Optional[Dict[str, RecordAggregation]],
                    usable_max_rel_error: float) -> MemoryModel:
    """``model`` with a fit of ``phase``: the model's formula (or two regimes of it,
    ``_phase_fit``) fitted to ``peaks`` (one per probe of ``results``, 0 where not measured) at
    the shapes the model itself was fitted to, else at those of them where the phase peaks above
    the floor; ``model`` as it is when that phase was not measured, or neither fit is
    identifiable and within ``usable_max_rel_error``. Deterministic from the probes, so every
    rank in lockstep agrees."""
    peaks_at: Dict[tuple, float] = {}
    for result, peak in zip(results, peaks):
        if result.feasible and peak > 0:
            key = tuple(result.dims)
            peaks_at[key] = max(peaks_at.get(key, 0.0), peak)
    shapes = [m["dims"] for m in model._parsed().get("metadata", {}).get("fit_measurements", [])]
    if not shapes or any(tuple(dims) not in peaks_at for dims in shapes):
        return model
    # A phase's peaks are forward/backward peaks (no optimizer step in them), so every shape the
    # model was fitted to counts, also where the phase peaks below the optimizer step's floor (a
    # model whose weights and optimizer state dwarf its activations); where that fit misses,
    # the shapes above the floor alone, where the prediction is the phase's fit anyway.
    width = len(model.formula.variable_names)
    floor_at = model.floor_at(_matrix(shapes, width, "dims"))
    above = [dims for dims, floor in zip(shapes, floor_at) if peaks_at[tuple(dims)] > floor]
    for chosen in [shapes] + ([above] if len(above) < len(shapes) else []):
        fitted = _phase_fit(model, chosen, peaks_at, aggregation, usable_max_rel_error)
        if fitted is not None:
            native, max_rel_error, formula = fitted
            # Its lowest peak bounds it below where the optimizer step's floor does not (a
            # forward/backward plateau: a GPT-2's first microbatch of one record peaked 16 % above
            # the phase's formula extrapolated below the shapes it was fitted to).
            return model._with_phase(phase, native.coefficients, native.single_record_factor, max_rel_error,
                                     len(chosen), native.single_record_coefficients, min(peaks_at.values()),
                                     formula)
    return model  # the phase's microbatches are predicted as the others


TWO_REGIMES_MIN_GAIN = 0.005
"""How much lower (a share of the peak) the leave-one-shape-out max error of a phase's fit with
two regimes (``_two_regimes``) must be than the model's formula's for the phase to take it."""

FITTING_REVISION = 2
"""Raised whenever probing fits a memory model differently from the same probes (2: a phase in
two regimes); a cache of fitted models keys on it, so an upgrade never reuses an older fit."""


def _phase_fit(model: MemoryModel, shapes: List[List[float]], peaks_at: Dict[tuple, float],
               aggregation: Optional[Dict[str, RecordAggregation]],
               usable_max_rel_error: float) -> Optional[Tuple[_planner.MemoryModel, float, Optional[Dict[str, Any]]]]:
    """The phase's peaks at ``shapes`` fitted by the model's formula, its max relative error and
    None; or, where the larger of two regimes of that formula (``_two_regimes``) errs less held
    out by ``TWO_REGIMES_MIN_GAIN``, that fit, its error and its formula (JSON). None when too
    few shapes, not identifiable, or not within ``usable_max_rel_error``.

    A step's first microbatch allocates the gradients during its backward: its peak is either
    early in the backward (the activations) or at its end (every gradient, few activations),
    two regimes of the dims. An LSTM language model's phase: 2.80 % fit error with the formula,
    training's first microbatches -13.5 % to +1.4 %; with two regimes 0.20 % and -0.12 % to
    +0.22 %."""
    single = _fit_phase_formula(model, model.formula, shapes, peaks_at, aggregation, usable_max_rel_error)
    plain = None if single is None else (single[0], single[1], None)
    two = _two_regimes(model.formula)
    if two is None or len(shapes) <= len(two.coefficient_names) or (single and single[2] < TWO_REGIMES_MIN_GAIN):
        return plain
    regimes = _fit_phase_formula(model, two, shapes, peaks_at, aggregation, usable_max_rel_error, require_usable=True)
    if regimes is not None and (single is None or regimes[2] <= single[2] - TWO_REGIMES_MIN_GAIN):
        return regimes[0], regimes[1], json.loads(regimes[0].to_json())["formula"]
    return plain


def _two_regimes(formula: CostFormula) -> Optional[CostFormula]:
    """``max(F, F')`` of a formula F linear in its coefficients, F' the same terms with their
    own coefficients (each name with "_2" appended, or "_3", ... where "_2" would repeat a name
    of the formula); None for a formula that is not linear."""
    if not formula.is_linear or "max(" in formula.canonical:
        return None
    names = list(formula.coefficient_names)
    taken = set(names) | set(formula.variable_names)
    suffix = 2
    while any(f"{name}_{suffix}" in taken for name in names):
        suffix += 1
    renamed = {name: f"{name}_{suffix}" for name in names}
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")
    second = pattern.sub(lambda match: renamed[match.group(1)], formula.canonical)
    return CostFormula(f"max({formula.canonical}, {second})", list(formula.variable_names),
                       names + [renamed[name] for name in names])


def _fit_phase_formula(model: MemoryModel, formula: CostFormula, shapes: List[List[float]],
                       peaks_at: Dict[tuple, float], aggregation: Optional[Dict[str, RecordAggregation]],
                       usable_max_rel_error: float,
                       require_usable: bool = False) -> Optional[Tuple[_planner.MemoryModel, float, float]]:
    """``formula`` fitted to the phase's peaks at ``shapes``: the fit, its max relative error
    and its leave-one-shape-out max error; None when too few shapes, not identifiable, or not
    within ``usable_max_rel_error`` (with ``require_usable``, also when the fit's summary says
    it is not usable: terms the shapes cannot separate, a held-out error above the limit)."""
    width = len(model.formula.variable_names)
    if len(shapes) < len(formula.coefficient_names):
        return None
    args = _planner.FitArguments()
    args.batch_size_variable = model.batch_size_variable
    args.aggregation = dict(aggregation or {})
    args.usable_max_rel_error = usable_max_rel_error
    try:
        native, summary, _ = _planner.fit(formula, _matrix(shapes, width, "dims"),
                                          np.array([peaks_at[tuple(dims)] for dims in shapes]),
                                          np.zeros((0, width)), np.zeros(0), args)
    except (ValueError, RuntimeError):
        return None
    if not np.isfinite(summary["max_rel_error"]) or abs(summary["max_rel_error"]) > usable_max_rel_error:
        return None
    if require_usable and not summary["usable"]:
        return None
    held_out = summary.get("leave_one_out_max_rel_error", float("nan"))
    return native, float(summary["max_rel_error"]), abs(float(held_out)) if np.isfinite(held_out) else float("inf")


def _release_frames(error: BaseException) -> None:
    """Clears the local variables of the finished frames in ``error``'s traceback and in those of
    its cause and context (tensors of a failed forward, the probe's state), keeping the
    tracebacks' lines: an exception kept by the caller then holds no memory of the probe."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        for linked in (error.__cause__, error.__context__):
            if linked is not None and id(linked) not in seen:
                traceback.clear_frames(linked.__traceback__)
        error = error.__cause__ or error.__context__
