"""batchfit: predict the GPU memory of a PyTorch step and the largest batch that fits.

``import batchfit`` stays cheap: torch is imported on first use of the engine.
"""

from __future__ import annotations

from typing import Any

from batchfit.engine.spec import Mode, OptimizerName, Precision, TensorSpec, TrainConfig
from batchfit.errors import (
    BatchfitError,
    DoesNotFitError,
    InputShapeError,
    InvalidInputError,
    MemoryBelowOverheadError,
    ModelForwardError,
    ModelSpecError,
    UntraceableError,
)

__version__ = "0.1.0"

_LAZY = {
    "estimate": "batchfit.api",
    "Answer": "batchfit.api",
    "MemoryEstimate": "batchfit.answers.estimate",
    "Category": "batchfit.engine.tracer",
    "Phase": "batchfit.engine.tracer",
    "DeviceProfile": "batchfit.device.profile",
    "gpu_profile": "batchfit.device.profile",
    "find_gpu": "batchfit.device.catalog",
    "max_batch_size": "batchfit.api",
    "max_seq_len": "batchfit.api",
    "MaxBatchResult": "batchfit.answers.maxbatch",
    "search_max_batch": "batchfit.api",
    "SearchResult": "batchfit.realrun.search",
    "bench": "batchfit.api",
    "BenchResult": "batchfit.speed.bench",
    "TimingConfig": "batchfit.speed.timing",
    "predict_throughput": "batchfit.api",
    "serve": "batchfit.api",
    "plan": "batchfit.api",
    "noise_scale": "batchfit.api",
    "NoiseScale": "batchfit.stats.estimator",
    "NoiseScaleMonitor": "batchfit.stats.monitor",
    "recommend_batch_size": "batchfit.api",
    "Recommendation": "batchfit.stats.recommend",
    "find_batch_size": "batchfit.integrations.decorator",
    "FoundBatchSize": "batchfit.integrations._trials",
}

__all__ = [
    "BatchfitError", "DoesNotFitError", "InputShapeError", "InvalidInputError",
    "MemoryBelowOverheadError", "ModelForwardError", "ModelSpecError", "UntraceableError", "Mode", "OptimizerName",
    "Precision", "TensorSpec", "TrainConfig", *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'batchfit' has no attribute {name!r}")
