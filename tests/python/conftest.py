"""The xpm package under test is the one the interpreter imports: under CTest, the copy that
`pip install --no-build-isolation .` put into a fresh virtual environment (by hand,
PYTHONPATH=build/python gives the build tree's); bin_dir is the build's programs (xpm-plan)."""
import json
import os
import pathlib

import pytest
import xpm


@pytest.fixture(scope="session")
def bin_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("XPM_BIN_DIR", "build/bin"))



@pytest.fixture(scope="session")
def timed():
    """A function giving a model fitted by xpm.fit (which fits no time model) the time model a
    probe would have written, for packer="fastest": 0.1 ms a microbatch, 1 ns a byte of work."""
    def with_time_model(model: "xpm.MemoryModel") -> "xpm.MemoryModel":
        parsed = json.loads(model.to_json())
        parsed.setdefault("metadata", {})["time_model"] = {"overhead_s": 1e-4, "seconds_per_byte": 1e-9,
                                                           "max_rel_error": 0.0, "fitted_points": 0}
        return xpm.MemoryModel.from_json(json.dumps(parsed))
    return with_time_model
