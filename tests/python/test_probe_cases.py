"""The Python side of the probe table (tests/probe_cases/cases.json): each case's MLP probed
through ``_SteadyState`` and ``_TorchExecutor`` (the measuring ``xpm.probe`` does), the table's
expectations checked, then the same table run by the C++ probe (planner_torch_tests' "probe
cases" test case, which writes its peaks as JSON) and the two implementations compared probe by
probe: the same feasibility, the same peaks above the steady state within 1 % or 1 KiB.

Measured (torch 2.13, CPU): every forward/backward peak equal to the byte but the first probe of
the SGD case (+384 bytes in Python); Adam's optimizer step +512 bytes in Python (torch.optim.Adam
keeps each parameter's step count as a tensor, LibTorch's as an integer): the optimizers differ,
not the probes."""
import json
import os
import pathlib
import subprocess

import pytest
import torch

import xpm
from xpm.probe_executor import _SteadyState, _TorchExecutor

CASES = json.loads((pathlib.Path(__file__).resolve().parents[1] / "probe_cases" / "cases.json").read_text())["cases"]
METER = xpm.CpuMeter.install()


def _mlp(widths):
    return torch.nn.Sequential(torch.nn.Linear(widths[0], widths[1]), torch.nn.ReLU(),
                               torch.nn.Linear(widths[1], widths[2]))


def _optimizer(name, model):
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-3)
    assert name == "sgd_momentum"
    return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)


def _measure(spec):
    torch.manual_seed(0)
    widths = spec["widths"]
    model = _mlp(widths)
    optimizer = _optimizer(spec["optimizer"], model)

    def loss_fn(dims):
        return model(torch.randn(int(dims[0]), int(dims[1]), widths[0])).sum()

    steady = _SteadyState(model, optimizer).__enter__()
    probes = []
    try:
        executor = _TorchExecutor(steady, loss_fn, METER, ["bs", "l"], measure_phases=False)
        static_bytes = executor.static_bytes()
        cap_above = spec["cap_above_static_bytes"]
        METER.capacity_bytes = int(static_bytes) + cap_above if cap_above > 0 else 0
        for point in spec["points"]:
            result = executor.run_probe([float(d) for d in point])
            probes.append({"dims": point, "feasible": bool(result.feasible),
                           "forward_backward_above_static_bytes": result.forward_backward_peak_bytes - static_bytes,
                           "optimizer_step_above_static_bytes": result.optimizer_step_peak_bytes - static_bytes})
    finally:
        METER.capacity_bytes = 0
        steady.__exit__(None, None, None)
    assert len(optimizer.state) == 0  # the steady state's optimizer state is gone again
    return probes


@pytest.fixture(scope="module")
def measured():
    return {spec["name"]: _measure(spec) for spec in CASES}


@pytest.mark.parametrize("spec", CASES, ids=[spec["name"] for spec in CASES])
def test_the_python_probe_measures_the_table_as_it_expects(measured, spec):
    probes = measured[spec["name"]]
    assert [p["feasible"] for p in probes] == spec["feasible"]
    for k, probe in enumerate(probes):
        if not probe["feasible"]:
            continue
        assert probe["forward_backward_above_static_bytes"] > 0
        for earlier in probes[:k]:  # a shape probed again, an out-of-memory probe between: the same peak
            if earlier["dims"] == probe["dims"] and earlier["feasible"]:
                assert earlier["forward_backward_above_static_bytes"] == probe["forward_backward_above_static_bytes"]


def test_the_cpp_and_python_probes_measure_the_table_alike(measured, tmp_path):
    bin_dir = os.environ.get("XPM_BIN_DIR")
    if not bin_dir:
        pytest.skip("XPM_BIN_DIR (the build's bin/, with planner_torch_tests) is not set")
    out = tmp_path / "cpp.json"
    run = subprocess.run([os.path.join(bin_dir, "planner_torch_tests"), "--test-case=probe cases*"],
                         env={**os.environ, "XPM_PROBE_CASES_OUT": str(out)}, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    cpp = json.loads(out.read_text())
    lines = []
    for spec in CASES:
        assert len(measured[spec["name"]]) == len(cpp[spec["name"]]), spec["name"]
        for ours, theirs in zip(measured[spec["name"]], cpp[spec["name"]]):
            assert ours["dims"] == theirs["dims"] and ours["feasible"] == theirs["feasible"], (spec["name"], ours, theirs)
            if not ours["feasible"]:
                continue
            for phase in ("forward_backward_above_static_bytes", "optimizer_step_above_static_bytes"):
                difference = (ours[phase] - theirs[phase]) / max(theirs[phase], 1.0)
                lines.append((f"{spec['name']} {ours['dims']} {phase.split('_above')[0]}: Python {ours[phase]:.0f} "
                              f"C++ {theirs[phase]:.0f} ({100 * difference:+.2f} %)", ours[phase] - theirs[phase],
                              difference))
    print("\n" + "\n".join(line for line, _, _ in lines))
    for line, bytes_apart, difference in lines:
        assert abs(difference) <= 0.01 or abs(bytes_apart) <= 1024, line
