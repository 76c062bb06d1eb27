"""The planner core from Python: formulas, fit, models, budgets, plans equal to the C++ plans."""
import concurrent.futures
import inspect
import doctest
import importlib
import json
import subprocess
import sys
import typing
import warnings

import numpy as np
import pytest
import torch

import xpm


def test_formula_canonical_form_and_identity():
    f = xpm.CostFormula("a*bs*l**2 + b*bs*(l-1) + c", ["bs", "l"])
    assert f.coefficient_names == ["a", "b", "c"]
    assert f.canonical == "a*bs*l^2 + b*bs*l - b*bs + c"
    assert f.is_linear
    g = xpm.CostFormula("c + b*bs*l - b*bs + a*l^2*bs", ["bs", "l"], coefficients=["a", "b", "c"])
    assert g.identity_hash == f.identity_hash and len(f.identity_hash) == 16
    assert f.predict([2.0, 3.0, 1e6], [4, 128]) == pytest.approx(2 * 4 * 128**2 + 3 * (4 * 128 - 4) + 1e6)


def test_the_planner_core_imports_and_fits_without_torch():
    """In a process where torch cannot be imported: the version, a formula, a fit and a plan
    work; the torch side's names fail in one line that says what they need."""
    code = """
import sys
sys.modules["torch"] = None  # import torch now fails, as without torch installed
import numpy as np
import xpm
model, report = xpm.fit(xpm.CostFormula("a*bs*l + c", ["bs", "l"]), [[1, 8], [2, 8], [4, 16], [8, 32]],
                        [1064, 1128, 1512, 3048])
planned = xpm.plan(np.array([[1, 30], [1, 20], [1, 10]], dtype=float), model, 1500)
print(xpm.__version__, report.usable, round(model.predict([2, 10])), sorted(len(m) for m in planned.microbatches))
try:
    xpm.PredictiveBatchSampler
except ModuleNotFoundError as error:
    print(error)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"{xpm.__version__} True 1160 [1, 2]"
    assert lines[1] == ("xpm.PredictiveBatchSampler needs torch (2.11 to 2.14), which this Python cannot import; "
                        "the planner core (CostFormula, fit, MemoryModel, plan) works without it")
    assert "torch" not in done.stderr


def test_formula_errors_are_exceptions_with_the_column():
    with pytest.raises(xpm.FormulaError) as caught:
        xpm.CostFormula("a*bs + x*", ["bs"], coefficients=["a"])
    assert isinstance(caught.value, ValueError)
    assert caught.value.column == caught.value.position + 1
    assert "formula error at column" in caught.value.brief
    with pytest.raises(TypeError) as caught:
        xpm.CostFormula("a*bs + c", "bs")
    assert str(caught.value) == "CostFormula: variables must be a list of names, e.g. ['bs'], got the string 'bs'"
    with pytest.raises(TypeError) as caught:
        xpm.CostFormula("a*bs*l + c", "bs, l")
    assert str(caught.value) == ("CostFormula: variables must be a list of names, e.g. ['bs', 'l'], got the string "
                                 "'bs, l'")
    with pytest.raises(xpm.FormulaError) as undeclared:
        xpm.CostFormula("a*bs + x", ["bs"], coefficients=["a"])
    assert undeclared.value.symbol == "x" and undeclared.value.column == 8
    with pytest.raises(xpm.FormulaError, match="not linear"):
        xpm.CostFormula("a^2*bs", ["bs"])
    assert not xpm.CostFormula("a*bs*l^p + c", ["bs", "l"], allow_nonlinear=True).is_linear


def test_fit_recovers_known_coefficients_and_reports_its_errors():
    rng = np.random.default_rng(3)
    dims = np.stack([rng.integers(1, 64, 40), rng.integers(8, 300, 40)], axis=1).astype(float)
    truth = {"a": 12.5, "b": 3000.0, "c": 4e6}
    peaks = truth["a"] * dims[:, 0] * dims[:, 1] ** 2 + truth["b"] * dims[:, 0] * dims[:, 1] + truth["c"]
    formula = xpm.CostFormula("a*bs*l^2 + b*bs*l + c", ["bs", "l"])
    model, report = xpm.fit(formula, dims, peaks)
    assert report.usable and report.converged
    assert report.max_rel_error < 1e-9
    for name, value in truth.items():
        assert model.coefficients[name] == pytest.approx(value, rel=1e-6)
    assert model.predict([8, 100]) == pytest.approx(12.5 * 8 * 100**2 + 3000 * 800 + 4e6, rel=1e-9)
    assert model.predict(dims) == pytest.approx(peaks, rel=1e-9)


def test_fit_keeps_an_out_of_memory_shape_out_of_every_plan():
    formula = xpm.CostFormula("a*bs*l + c", ["bs", "l"])
    dims = np.array([[1, 10], [2, 10], [4, 10], [8, 10]], dtype=float)
    model, _ = xpm.fit(formula, dims, 100 * dims[:, 0] * dims[:, 1] + 1000,
                       infeasible_dims=[[3, 10]], infeasible_bytes=[5000])
    # 3 records of length 10 ran out of memory under 5000 bytes: no plan under that budget
    # reaches them, whatever the prediction; a larger budget is not bound by that probe.
    assert model.max_batch([1, 10], 5000) == 2
    assert model.max_batch([1, 10], 10**6) > 100


def test_model_json_round_trip_and_max_batch(tmp_path):
    formula = xpm.CostFormula("a*bs*l + c", ["bs", "l"])
    dims = np.array([[1, 10], [4, 20], [8, 40], [16, 10]], dtype=float)
    model, _ = xpm.fit(formula, dims, 50 * dims[:, 0] * dims[:, 1] + 10_000)
    path = tmp_path / "memory_model.json"
    model.save(path)
    loaded = xpm.MemoryModel.load(path)
    assert loaded.coefficients == pytest.approx(model.coefficients)
    assert json.loads(loaded.to_json())["formula"]["canonical"] == "a*bs*l + c"
    assert loaded.max_batch([1, 100], 60_010) == 10  # 50 * 10 * 100 + 10000 = 60000
    with pytest.raises(ValueError, match="over the usable budget of 10000 bytes"):
        loaded.max_batch([1, 100], 10_000)


def test_budget_names_its_bad_field():
    assert xpm.MemoryBudget(1000, 0.9, 100).usable_bytes == 800
    with pytest.raises(ValueError, match="capacity_bytes"):
        xpm.MemoryBudget(0)
    with pytest.raises(ValueError, match=r"^MemoryBudget: capacity_bytes must be a whole number of bytes, got nan$"):
        xpm.MemoryBudget(float("nan"))
    with pytest.raises(ValueError, match=r"^MemoryBudget: extra_overhead_bytes must be a whole number of bytes, got inf$"):
        xpm.MemoryBudget(1000, 0.9, float("inf"))


def test_fit_refuses_a_batch_size_that_does_not_count_records():
    formula = xpm.CostFormula("a*bs*l + c", ["bs", "l"])
    dims = np.array([[1, 10], [2, 10], [4, 20], [0, 43]], dtype=float)
    with pytest.raises(ValueError, match=r"^fit: dims\[3\] is \[0.0, 43.0\]: its bs 0 is not a whole number >= 1 "
                                         r"\(the batch-size variable counts records\)$"):
        xpm.fit(formula, dims, [2000, 3000, 9000, 5000])
    dims[3] = [2.5, 43]
    with pytest.raises(ValueError, match=r"^fit: dims\[3\] is \[2.5, 43.0\]: its bs 2.5 is not a whole number"):
        xpm.fit(formula, dims, [2000, 3000, 9000, 5000])
    with pytest.raises(ValueError, match=r"^fit: infeasible_dims\[0\] is \[0.0, 90.0\]: its bs 0"):
        xpm.fit(formula, dims[:3], [2000, 3000, 9000], infeasible_dims=[[0, 90]], infeasible_bytes=[10**6])


@pytest.mark.parametrize("packer", xpm.PACKERS)
def test_plans_equal_the_cpp_plans_for_the_same_model(tmp_path, bin_dir, packer, timed):
    formula = xpm.CostFormula("a*bs*l^2 + b*bs*l + c", ["bs", "l"])
    probe_dims = np.array([[1, 16], [8, 64], [16, 128], [32, 32], [4, 180]], dtype=float)
    model, _ = xpm.fit(formula, probe_dims, 3 * probe_dims[:, 0] * probe_dims[:, 1] ** 2
                       + 900 * probe_dims[:, 0] * probe_dims[:, 1] + 2e6)
    model = timed(model)  # for "fastest"; the other packers ignore it
    model_path = tmp_path / "model.json"
    model.save(model_path)
    lengths = np.random.default_rng(5).integers(3, 180, 500)
    records = tmp_path / "lengths.txt"
    records.write_text("".join(f"{l}\n" for l in lengths))
    budget = xpm.MemoryBudget(40_000_000)
    sort_by = "l" if packer == "adaptive" else ""
    plan = xpm.plan(xpm.record_dims_from_lengths(lengths), model, budget.usable_bytes, packer=packer,
                    sort_by=sort_by)
    command = [str(bin_dir / "xpm-plan"), "plan", "--model", str(model_path), "--csv", str(records),
               "--capacity-bytes", "40000000", "--packer", packer, "--json"] + (["--sort-by", "l"] if sort_by else [])
    cpp = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    assert len(plan) == cpp["microbatch_count"] > 1
    for k, microbatch in enumerate(cpp["microbatches"]):
        assert plan.microbatches[k].tolist() == microbatch["record_indices"]
        assert plan.predicted_bytes[k] == pytest.approx(microbatch["predicted_bytes"], rel=1e-12)
    assert sorted(plan.indices.tolist()) == list(range(500))


def test_plan_refuses_dims_of_the_wrong_width():
    formula = xpm.CostFormula("a*bs*l + c", ["bs", "l"])
    model, _ = xpm.fit(formula, np.array([[1, 10], [2, 10], [4, 20]], dtype=float), [2000, 3000, 9000])
    with pytest.raises(ValueError, match="column"):
        xpm.plan(np.ones((5, 3)), model, 10**6)
    with pytest.raises(ValueError, match="packer must be"):
        xpm.plan(np.ones((5, 2)), model, 10**6, packer="best")


def test_a_model_budget_or_formula_of_the_wrong_kind_is_refused_in_one_line_naming_it():
    formula = xpm.CostFormula("a*bs*l + c", ["bs", "l"])
    dims = np.array([[1, 10], [2, 10], [4, 20]], dtype=float)
    model, _ = xpm.fit(formula, dims, [2000, 3000, 9000])
    with pytest.raises(ValueError, match=r"^fit: formula must be a CostFormula or 'auto', got None$"):
        xpm.fit(None, dims, [2000, 3000, 9000])
    with pytest.raises(TypeError, match=r"^plan: model must be an xpm.MemoryModel, got NoneType None$"):
        xpm.plan([[1, 10]], None, 10**6)
    with pytest.raises(ValueError, match=r"^plan: usable_bytes must be a number of bytes > 0, got '20MB'$"):
        xpm.plan([[1, 10]], model, "20MB")
    with pytest.raises(TypeError, match=r"MemoryModel.load\(path\) reads a model file\), got str 'model.json'$"):
        xpm.PredictiveBatchSampler([3, 4], "model.json", 10**6, outer_batch_size=2)


def test_shapes_and_variable_names_are_checked_not_guessed(tmp_path):
    formula = xpm.CostFormula("a*bs*l + c", ["l", "bs"])  # the batch size second
    dims = np.array([[10, 1], [10, 2], [20, 4]], dtype=float)
    model, _ = xpm.fit(formula, dims, 100 * dims[:, 0] * dims[:, 1] + 1000)
    assert model.batch_size_variable == "bs"
    assert xpm.record_dims_from_lengths([5, 7], ["l", "bs"]).tolist() == [[5, 1], [7, 1]]
    plan = xpm.plan([30, 40, 10], model, 100 * 2 * 40 + 1000)  # lengths: 1-D for two variables
    assert [m.tolist() for m in plan.microbatches] == [[1, 0], [2]]
    with pytest.raises(ValueError, match=r"shape \[n, 2\]"):
        xpm.fit(formula, dims.T, [1, 2])
    with pytest.raises(ValueError, match="peak_bytes must hold 3 values"):
        xpm.fit(formula, dims, [1, 2])
    with pytest.raises(ValueError, match="batch_size_variable 'n'"):
        xpm.fit(formula, dims, [1, 2, 3], batch_size_variable="n")
    with pytest.raises(ValueError, match="must be finite and >= 0"):
        xpm.plan([[1, -3]], model, 10**6)
    with pytest.raises(ValueError, match="usable_bytes must be > 0"):
        model.max_batch([1, 10], -1)
    assert xpm.MemoryBudget(4e7, 0.99).capacity_bytes == 40_000_000
    with pytest.raises(ValueError, match="whole number of bytes"):
        xpm.MemoryBudget(1.5)
    with pytest.raises(FileNotFoundError, match="is a directory"):
        xpm.MemoryModel.load(tmp_path)
    with pytest.raises(ValueError, match="memory model JSON"):
        xpm.MemoryModel.from_json("[1,2")


def test_plan_warns_of_records_over_the_budget_even_alone_as_the_sampler_does():
    formula = xpm.CostFormula("a*bs*l + c", ["bs", "l"])
    dims = np.array([[1, 10], [2, 10], [4, 20]], dtype=float)
    model, _ = xpm.fit(formula, dims, 100 * dims[:, 0] * dims[:, 1] + 1000)
    with pytest.warns(RuntimeWarning, match=r"^xpm: 2 record\(s\) do not fit the budget of 5000 bytes even alone "
                                            r"\(predicted up to 9000 bytes, or at a shape a probe ran out of memory "
                                            r"at\); each gets a microbatch of its own"):
        planned = xpm.plan([5, 50, 80, 8], model, 5000)
    assert planned.over_budget.tolist().count(True) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        xpm.plan([5, 8, 12], model, 5000)


def _plan_arrays(plan):
    return plan.indices.tolist(), plan.offsets.tolist(), plan.dims.tolist(), plan.predicted_bytes.tolist(), \
        plan.over_budget.tolist()


@pytest.mark.parametrize("packer", xpm.PACKERS)
def test_plans_are_the_same_from_any_layout_or_dtype_of_the_record_dims(packer, timed):
    formula = xpm.CostFormula("a*bs*l^2 + b*bs*l + c", ["bs", "l"])
    probe_dims = np.array([[1, 16], [8, 64], [16, 128], [32, 32], [4, 180]], dtype=float)
    model, _ = xpm.fit(formula, probe_dims, 3 * probe_dims[:, 0] * probe_dims[:, 1] ** 2
                       + 900 * probe_dims[:, 0] * probe_dims[:, 1] + 2e6)
    model = timed(model)
    lengths = np.random.default_rng(9).integers(1, 400, 3000)
    contiguous = xpm.record_dims_from_lengths(lengths)  # C order float64: read in place
    assert contiguous.flags.c_contiguous and contiguous.dtype == np.float64
    wider = np.zeros((3000, 5))
    wider[:, 1], wider[:, 3] = 1, lengths
    layouts = {
        "fortran": np.asfortranarray(contiguous),
        "int64": contiguous.astype(np.int64),
        "float32": contiguous.astype(np.float32),
        "strided columns": wider[:, 1::2][:, :2],
        "every other row of twice the rows": np.repeat(contiguous, 2, axis=0)[::2],
        "lists": contiguous.tolist(),
        "lengths": lengths,
    }
    budget = 30_000_000
    expected = xpm.plan(contiguous, model, budget, packer=packer)
    assert len(expected) > 10 and sorted(expected.indices.tolist()) == list(range(3000))
    for name, dims in layouts.items():
        assert _plan_arrays(xpm.plan(dims, model, budget, packer=packer)) == _plan_arrays(expected), name
    assert contiguous[:, 1].tolist() == lengths.tolist()  # read, not written


def test_plan_rejects_non_finite_dims_and_plans_no_records():
    formula = xpm.CostFormula("a*bs*l + c", ["bs", "l"])
    model, _ = xpm.fit(formula, np.array([[1, 10], [2, 10], [4, 20]], dtype=float), [2000, 3000, 9000])
    for bad in ([[1, np.nan]], [[1, np.inf]], [[np.nan, 10]], [[1, 10], [1, -np.inf]], [[-1, 10]]):
        with pytest.raises(ValueError, match="must be finite and >= 0"):
            xpm.plan(np.array(bad), model, 10**6)
    empty = xpm.plan(np.zeros((0, 2)), model, 10**6)
    assert len(empty) == 0 and empty.indices.tolist() == [] and empty.offsets.tolist() == [0]
    with pytest.raises(ValueError, match="usable_bytes must be a number of bytes > 0"):
        xpm.plan(np.ones((3, 2)), model, 0)


def test_plans_made_in_threads_at_once_equal_the_plan_made_alone():
    # The packer reads the array in place with the GIL released: threads planning from one array
    # at the same time must each get the plan of a call made alone.
    formula = xpm.CostFormula("a*bs*l^2 + b*bs*l + c", ["bs", "l"])
    probe_dims = np.array([[1, 16], [8, 64], [16, 128], [4, 180]], dtype=float)
    model, _ = xpm.fit(formula, probe_dims, 3 * probe_dims[:, 0] * probe_dims[:, 1] ** 2
                       + 900 * probe_dims[:, 0] * probe_dims[:, 1] + 2e6)
    dims = xpm.record_dims_from_lengths(np.random.default_rng(4).integers(1, 300, 200_000))
    alone = {packer: _plan_arrays(xpm.plan(dims, model, 40_000_000, packer=packer)) for packer in ("adaptive", "ffd")}
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        futures = [(packer, pool.submit(xpm.plan, dims, model, 40_000_000, packer=packer))
                   for packer in ("adaptive", "ffd") * 2]
        for packer, future in futures:
            assert _plan_arrays(future.result()) == alone[packer]


def test_closed_sets_are_literals_in_the_signatures_and_checked_at_run_time():
    hints = typing.get_type_hints
    assert typing.get_args(xpm.PackerName) == xpm.PACKERS == ("adaptive", "fastest", "ffd", "uniform")
    assert hints(xpm.plan)["packer"] == xpm.PackerName
    assert hints(xpm.PredictiveBatchSampler.__init__)["packer"] == xpm.PackerName
    assert typing.get_args(xpm.Aggregation) == ("count", "max", "sum")
    assert hints(xpm.fit)["aggregation"] == typing.Optional[typing.Dict[str, xpm.Aggregation]]
    assert hints(xpm.fit)["formula"] == typing.Union[xpm.CostFormula, typing.Literal["auto"]]
    assert typing.get_args(xpm.RecordAggregation) == ("max", "sum")
    assert hints(xpm.ProbeOptions)["aggregation"] == typing.Optional[typing.Dict[str, xpm.RecordAggregation]]
    assert typing.get_args(xpm.DeviceKind) == ("cpu", "cuda")
    assert hints(xpm.ProbeOptions)["device"] == typing.Union[xpm.DeviceKind, torch.device, str, None]
    assert hints(xpm.probe)["options"] == typing.Optional[xpm.ProbeOptions]
    assert hints(xpm.probe)["meter"] == typing.Optional[xpm.Meter]
    assert hints(xpm.AdaptiveReport)["stop"] == xpm.AdaptiveStop
    assert set(typing.get_args(xpm.AdaptiveStop)) == {"not run", "agreed", "probe count", "no candidates"}
    assert hints(xpm.OutsideProbes)["kind"] == xpm.OutsideProbesKind
    assert typing.get_args(xpm.OutsideProbesKind) == ("gradient_buckets",)
    assert hints(xpm.ProbeOutcome)["outside_probes"] == typing.List[xpm.OutsideProbes]

    formula = xpm.CostFormula("a*bs*l + b*bs + c", ["bs", "l"])
    dims = np.array([[1, 10], [2, 10], [4, 20], [8, 40]], dtype=float)
    peaks = 100 * dims[:, 0] * dims[:, 1] + 30 * dims[:, 0] + 1000
    model, _ = xpm.fit(formula, dims, peaks)
    with pytest.raises(ValueError) as caught:
        xpm.plan(np.ones((5, 2)), model, 10**6, packer="FFD")
    assert str(caught.value) == "plan: packer must be 'adaptive', 'fastest', 'ffd' or 'uniform', got 'FFD'"
    for bad in ("avg", "MAX", None):
        with pytest.raises(ValueError) as caught:
            xpm.fit(formula, dims, peaks, aggregation={"l": bad})
        assert str(caught.value) == f"fit: aggregation['l'] must be 'count', 'max' or 'sum', got {bad!r}"
    with pytest.raises(ValueError) as caught:
        xpm.fit(formula, dims, peaks, aggregation="max")
    assert str(caught.value) == "fit: aggregation must be a dict {variable: 'count', 'max' or 'sum'}, got 'max'"
    with pytest.raises(ValueError) as caught:
        xpm.fit("Auto", dims, peaks, variables=["bs", "l"])
    assert str(caught.value) == "fit: formula must be a CostFormula or 'auto', got 'Auto'"
    summed, _ = xpm.fit(formula, dims, peaks, aggregation={"l": "sum"})  # every value of the Literal is taken
    assert json.loads(summed.to_json())["aggregation"] == {"bs": "count", "l": "sum"}


def _public_callables():
    """(name, function, whether a property getter) of every public function, method and
    property of the package."""
    for name in xpm.__all__:
        obj = getattr(xpm, name)
        if inspect.isfunction(obj):
            yield name, obj, False
        elif inspect.isclass(obj) and obj.__module__.startswith("xpm."):
            for member, value in vars(obj).items():
                if member.startswith("_") and member not in ("__init__", "__len__", "__iter__", "__getitem__"):
                    continue
                if member == "__init__" and getattr(obj, "_is_protocol", False):
                    continue  # an interface (xpm.Meter): typing makes its __init__, nothing constructs it
                if isinstance(value, (classmethod, staticmethod)):
                    value = value.__func__
                getter = isinstance(value, property)
                if getter:
                    value = value.fget
                if inspect.isfunction(value):
                    yield f"{name}.{member}", value, getter


def test_every_public_signature_is_typed_and_documented_with_google_style_sections():
    missing = []
    for name, function, getter in _public_callables():
        hints = typing.get_type_hints(function)  # resolvable at run time (Python 3.9 too: no X | Y)
        parameters = [p for p in inspect.signature(function).parameters if p not in ("self", "cls")]
        missing += [f"{name}: no type of {p}" for p in parameters if p not in hints]
        if "return" not in hints:
            missing.append(f"{name}: no return type")
        if name.endswith(".__init__"):  # documented by its class
            owner = getattr(xpm, name.split(".")[0])
            if parameters and "Args:" not in (owner.__doc__ or "") and "Attributes:" not in (owner.__doc__ or ""):
                missing.append(f"{name}: its class's docstring has no Args:")
            continue
        doc = inspect.getdoc(function) or ""
        if not doc:
            missing.append(f"{name}: no docstring")
        elif not getter and "\n" in doc.strip():  # one line: a plain method (a property: its unit named)
            if parameters and "Args:" not in doc:
                missing.append(f"{name}: no Args:")
            if hints.get("return") not in (None, type(None)) and "Returns:" not in doc:
                missing.append(f"{name}: no Returns:")
    assert missing == []


@pytest.mark.parametrize("module", ["xpm.planning", "xpm.sampler"])
def test_the_docstring_examples_run_as_written(module):
    # The >>> examples of the package's docstrings are doctests: an example that goes stale fails here.
    results = doctest.testmod(importlib.import_module(module))
    assert results.attempted >= 5 and results.failed == 0, results


def test_a_malformed_phase_record_is_refused_in_one_line_naming_it():
    formula = xpm.CostFormula("a*bs*l + b*bs + c", ["bs", "l"])
    dims = np.array([[1, 10], [2, 10], [4, 20], [8, 40]], dtype=float)
    model, _ = xpm.fit(formula, dims, 100 * dims[:, 0] * dims[:, 1] + 30 * dims[:, 0] + 1000)
    parsed = json.loads(model.to_json())
    good = {"coefficients": {"a": 90.0, "b": 30.0, "c": 1000.0}, "max_rel_error": 0.01, "fitted_points": 4}
    parsed.setdefault("metadata", {})["phases"] = {"without_gradients": good}
    phased = xpm.MemoryModel.from_json(json.dumps(parsed))
    assert phased.phases == ["with_gradients", "without_gradients"]
    assert phased.predict([2, 10], "without_gradients") == pytest.approx(90 * 20 + 60 + 1000)
    # A phase's own fit of the probes of one record predicts batch size 1 (the smaller of the two).
    single = dict(good, single_record_coefficients={"a": 80.0, "b": 30.0, "c": 1000.0})
    parsed["metadata"]["phases"] = {"without_gradients": single}
    with_single = xpm.MemoryModel.from_json(json.dumps(parsed))
    assert with_single.predict([1, 10], "without_gradients") == pytest.approx(80 * 10 + 30 + 1000)
    assert with_single.predict([2, 10], "without_gradients") == pytest.approx(90 * 20 + 60 + 1000)
    # Without the model's floor (a first microbatch of several), the phase's lowest measured peak
    # bounds its prediction below (and the steady prediction above, as always).
    parsed["metadata"]["phases"] = {"without_gradients": dict(good, lowest_peak_bytes=2900.0)}
    with_lowest = xpm.MemoryModel.from_json(json.dumps(parsed))
    assert with_lowest.predict([2, 10], "without_gradients", floor=False) == 2900.0
    assert with_lowest.predict([8, 40], "without_gradients", floor=False) == pytest.approx(90 * 320 + 240 + 1000)
    for phases, expected in (
            ({"without_gradients": dict(good, lowest_peak_bytes=-1)},
             "metadata.phases['without_gradients'].lowest_peak_bytes must be a number of bytes >= 0, got -1"),
            ({"without_gradients": 5}, "metadata.phases['without_gradients'] must hold 'coefficients', a number "
                                       "of bytes for each of a, b, c; got 5"),
            ({"without_gradients": {"coefficients": {"a": 1.0}}}, "for each of a, b, c; got {'coefficients'"),
            ({"sideways": good}, "metadata.phases has 'sideways'; a phase fitted apart is 'without_gradients' or "
                                 "'synchronised'"),
            ({"without_gradients": dict(good, single_record_coefficients={"a": 1.0})},
             "metadata.phases['without_gradients'].single_record_coefficients must hold a number of bytes for each "
             "of a, b, c; got {'a': 1.0}")):
        parsed["metadata"]["phases"] = phases
        with pytest.raises(ValueError) as caught:
            xpm.MemoryModel.from_json(json.dumps(parsed))
        assert str(caught.value).startswith("memory model JSON: ") and expected in str(caught.value)


def test_option_defaults_are_the_planners_own_in_every_layer():
    """The defaults are written once, in the C++ planner (PredictiveBatcherOptions, FitOptions,
    MemoryBudget): the Python options, the fit and the budget read them, so a value written
    again anywhere fails here."""
    from xpm import _planner
    defaults = _planner.DEFAULTS
    options = xpm.ProbeOptions()
    for name in ("usable_max_rel_error", "batch_size_variable", "adaptive_max_probes", "adaptive_tolerance",
                 "adaptive_grid_steps"):
        assert getattr(options, name) == defaults[name], name
    assert tuple(options.design_fractions) == tuple(defaults["design_fractions"])
    assert inspect.signature(xpm.fit).parameters["usable_max_rel_error"].default == defaults["usable_max_rel_error"]
    assert xpm.MemoryBudget(1_000_000).memory_fraction == defaults["memory_fraction"]
    assert _planner.MemoryBudget(1_000_000).memory_fraction == defaults["memory_fraction"]

