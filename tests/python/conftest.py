"""The xpm package under test is the build tree's (PYTHONPATH set by CTest); bin_dir is the
build's programs (xpm-plan)."""
import os
import pathlib

import pytest


@pytest.fixture(scope="session")
def bin_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("XPM_BIN_DIR", "build/bin"))

