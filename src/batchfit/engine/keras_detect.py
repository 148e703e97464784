"""Recognising a Keras model without importing Keras: what the rest of the engine asks
before it hands a model to :mod:`batchfit.engine.keras_step` (or refuses one)."""

from __future__ import annotations

import sys
from typing import Any


def keras_module() -> Any | None:
    """The ``keras`` module if it has been imported (never imports it)."""
    return sys.modules.get("keras")


def is_keras_model(obj: Any) -> bool:
    """``obj`` is a ``keras.Model`` (any backend); False when Keras is not imported."""
    keras = keras_module()
    model_class = getattr(keras, "Model", None) if keras is not None else None
    return isinstance(model_class, type) and isinstance(obj, model_class)
