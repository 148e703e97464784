"""Shared test set-up: this folder is on ``sys.path`` (pytest puts a rootless conftest's
folder there), so test modules in the subfolders and the trial processes they start can
import ``capped_models`` by that name."""

import os
import tempfile
from pathlib import Path

import pytest

# Keras 3 picks its backend when first imported: the Keras tests (tests/engine/test_keras.py,
# tests/integrations/test_keras_finder.py) run it on torch, the backend batchfit traces.
os.environ.setdefault("KERAS_BACKEND", "torch")
# A CUDA target's allocator options default to the environment's (PYTORCH_CUDA_ALLOC_CONF):
# the tests' expected values are for torch's defaults; tests of the variables set them.
for _name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
    os.environ.pop(_name, None)
# Tests never download: ``hf:`` ids resolve from the offline table or a cache folder a test
# builds (tests/models/test_hub.py), never from this machine's Hugging Face cache. Set before
# huggingface_hub is imported, which reads both once.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_CACHE"] = tempfile.mkdtemp(prefix="batchfit-test-hf-cache-")


# Tests listed in tests/slow_tests.txt are marked ``slow`` as well as those marked in their
# modules: what a real process or a long sweep makes slow is marked where the test is; the
# list holds the tests whose measured duration puts them out of `make test-fast`'s budget.
_SLOW_LIST = Path(__file__).with_name("slow_tests.txt")


def _listed_slow() -> set[str]:
    lines = (line.split("#", 1)[0].strip() for line in _SLOW_LIST.read_text().splitlines())
    return {line for line in lines if line}


def pytest_collection_modifyitems(config, items):
    listed = _listed_slow()
    for item in items:
        if item.nodeid in listed or item.nodeid.split("[", 1)[0] in listed:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _no_onednn_jit_error_left():
    """A test that leaves oneDNN's JIT allocation error set on this thread would fail every
    later test that builds a new CPU kernel ("could not create a primitive"; see
    :mod:`batchfit.integrations._jit_error`): fail that test instead, and clear the error."""
    from batchfit.integrations._jit_error import clear_jit_allocation_error, jit_error

    yield
    left = jit_error()
    if left:
        clear_jit_allocation_error()
        pytest.fail(f"the test left oneDNN's JIT error {left} set on the main thread (an "
                    "allocation failed under an in-process memory cap and was not cleared)")
