"""Shared test set-up: this folder is on ``sys.path`` (pytest puts a rootless conftest's
folder there), so test modules in the subfolders and the trial processes they start can
import ``capped_models`` by that name."""

import os

# Keras 3 picks its backend when first imported: the Keras tests (tests/engine/test_keras.py,
# tests/integrations/test_keras_finder.py) run it on torch, the backend batchfit traces.
os.environ.setdefault("KERAS_BACKEND", "torch")
