"""Shared test set-up: this folder is on ``sys.path`` (pytest puts a rootless conftest's
folder there), so test modules in the subfolders and the trial processes they start can
import ``capped_models`` by that name."""

import os

# Keras 3 picks its backend when first imported: the Keras tests (tests/engine/test_keras.py,
# tests/integrations/test_keras_finder.py) run it on torch, the backend batchfit traces.
os.environ.setdefault("KERAS_BACKEND", "torch")
# A CUDA target's allocator options default to the environment's (PYTORCH_CUDA_ALLOC_CONF):
# the tests' expected values are for torch's defaults; tests of the variables set them.
for _name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
    os.environ.pop(_name, None)
