"""Statistical efficiency: the gradient noise scale and the batch that trains soonest.

* :mod:`batchfit.stats.estimator` - the two-batch estimators, their moving averages and
  interval (no torch);
* :mod:`batchfit.stats.monitor` - :class:`NoiseScaleMonitor`, hooks for a training loop;
* :mod:`batchfit.stats.measure` - :func:`noise_scale`, a standalone measurement;
* :mod:`batchfit.stats.recommend` - noise scale x throughput -> the batch (no torch).

Importing this package does not import torch.
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "noise_scale": "batchfit.stats.measure",
    "NoiseScale": "batchfit.stats.estimator",
    "NoiseScaleEstimator": "batchfit.stats.estimator",
    "NoiseScaleMonitor": "batchfit.stats.monitor",
    "NoiseScaleWarning": "batchfit.stats.monitor",
    "recommend_batch_size": "batchfit.stats.recommend",
    "Recommendation": "batchfit.stats.recommend",
    "learning_rate_change": "batchfit.stats.recommend",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'batchfit.stats' has no attribute {name!r}")
