"""The xpm package under test is the one the interpreter imports: under CTest, the copy that
`pip install --no-build-isolation .` put into a fresh virtual environment (by hand,
PYTHONPATH=build/python gives the build tree's); bin_dir is the build's programs (xpm-plan)."""
import os
import pathlib

import pytest


@pytest.fixture(scope="session")
def bin_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("XPM_BIN_DIR", "build/bin"))

