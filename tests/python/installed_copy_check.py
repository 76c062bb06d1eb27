"""Checks an installed copy of xpm (run with that environment's Python): it is imported from
site-packages, its version is the distribution's, it probes a PyTorch step under the CPU meter
and plans with the sampler. Used by install_package.sh and wheel_test.sh.

    python installed_copy_check.py "from the wheel"
"""
import importlib.metadata
import pathlib
import sys

import torch

import xpm

location = pathlib.Path(xpm.__file__).resolve().parent
assert "site-packages" in location.parts, f"xpm imported from {location}, not an installed copy"
assert xpm.__version__ == importlib.metadata.version("xpm"), (xpm.__version__, importlib.metadata.version("xpm"))
meter = xpm.CpuMeter.install()  # before the model: the meter must see the weights
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 8))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
meter.capacity_bytes = 128 << 20
# Batches large enough that the activations, not the weights' gradients, set the peak.
probed = xpm.probe(model, optimizer, lambda dims: model(torch.randn(int(dims[0]), 256)).square().sum(),
                   xpm.CostFormula("a*bs + c", ["bs"]), meter=meter,
                   probe_points=[{"bs": bs} for bs in (512, 1024, 2048, 4096)])
sampler = xpm.PredictiveBatchSampler([[1.0]] * 9000, probed.model, int(probed.model.predict([3000])),
                                     outer_batch_size=9000)
sizes = [len(m) for m in next(iter(sampler.steps())).microbatches]
print(f"xpm {xpm.__version__} {sys.argv[1] if len(sys.argv) > 1 else ''} in {location}, torch {torch.__version__}: "
      f"{len(probed.probes)} probes, {probed.model.formula.canonical}; 9000 records in microbatches of {sizes}")
