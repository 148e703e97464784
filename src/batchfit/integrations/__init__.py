"""Surfaces users already know, backed by batchfit's prediction and its boundary search.

* :func:`find_batch_size`: a decorator in the spirit of accelerate's
  ``find_executable_batch_size``, seeded by a prediction and able to search upward.
* :class:`batchfit.integrations.lightning.BatchfitFinder`: a Lightning callback, like
  Lightning's ``BatchSizeFinder`` (needs ``lightning``).
* :func:`batchfit.integrations.huggingface.find_trainer_batch_size`: sets a Hugging Face
  ``Trainer``'s batch sizes before ``train()`` (needs ``transformers``).
* :class:`batchfit.integrations.lightning.NoiseScaleLogger` and
  :class:`batchfit.integrations.huggingface.NoiseScaleCallback`: log the gradient noise scale
  during training (see :mod:`batchfit.stats`).

Importing this package imports neither Lightning nor transformers (nor torch, until a name
below is used).
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "find_batch_size": "batchfit.integrations.decorator",
    "FoundBatchSize": "batchfit.integrations._trials",
    "BatchSizeSearch": "batchfit.integrations._trials",
}

__all__ = ["BatchSizeSearch", "FoundBatchSize", "find_batch_size"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'batchfit.integrations' has no attribute {name!r}")
