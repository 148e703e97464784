"""batchfit: predict the GPU memory of a PyTorch step and the largest batch that fits.

``import batchfit`` stays cheap: torch is imported on first use of the engine.
"""

from __future__ import annotations

from typing import Any

from batchfit.errors import (
    BatchfitError,
    DoesNotFitError,
    InputShapeError,
    InvalidInputError,
    ModelForwardError,
    ModelSpecError,
    UntraceableError,
)
from batchfit.spec import Mode, OptimizerName, Precision, TensorSpec, TrainConfig

__version__ = "0.1.0"

_LAZY = {
    "estimate": "batchfit.predict",
    "MemoryEstimate": "batchfit.predict",
    "Category": "batchfit.trace",
    "Phase": "batchfit.trace",
    "DeviceProfile": "batchfit.device",
    "max_batch_size": "batchfit.maxbatch",
    "max_seq_len": "batchfit.maxbatch",
    "MaxBatchResult": "batchfit.maxbatch",
    "search_max_batch": "batchfit.search",
    "SearchResult": "batchfit.search",
    "bench": "batchfit.throughput",
    "BenchResult": "batchfit.throughput",
    "predict_throughput": "batchfit.roofline",
    "find_batch_size": "batchfit.integrations.decorator",
    "FoundBatchSize": "batchfit.integrations._trials",
}

__all__ = [
    "BatchfitError", "DoesNotFitError", "InputShapeError", "InvalidInputError",
    "ModelForwardError", "ModelSpecError", "UntraceableError", "Mode", "OptimizerName",
    "Precision", "TensorSpec", "TrainConfig", *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'batchfit' has no attribute {name!r}")
