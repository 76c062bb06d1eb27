"""Run folders of the robustness tests (xpm-train's hold tens of MB of parameters and checkpoints
each) are removed once the tests that read them have passed, and kept for inspection when one
failed. A test registers its folders with the `remove_when_passed` fixture; a module fixture's
reference run registers with `remove_when_module_passed`, removed after the module's last test
if none of the module's tests failed. The shared memory-model caches are not registered."""
import shutil

import pytest

FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Marks the test and its module as failed when its setup, call or teardown fails."""
    outcome = yield
    if outcome.get_result().failed:
        item.stash[FAILED] = True
        item.getparent(pytest.Module).stash[FAILED] = True


def _remove_when(node):
    """Yields a function registering a folder (and returning it); at teardown, removes the folders
    registered unless `node` (the test, or its module) has failed."""
    folders = []

    def register(folder):
        folders.append(folder)
        return folder

    yield register
    if not node.stash.get(FAILED, False):
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def remove_when_passed(request):
    yield from _remove_when(request.node)


@pytest.fixture(scope="module")
def remove_when_module_passed(request):
    yield from _remove_when(request.node)
