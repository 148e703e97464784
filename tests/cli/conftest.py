"""Fixtures shared by the CLI tests."""

from __future__ import annotations

import textwrap

import pytest

#: A compiled Keras 3 CNN (16x16x3 per sample; SGD with momentum, sparse cross-entropy) and
#: an uncompiled Dense model, the model file of the Keras CLI and parity tests.
KERAS_MODELS = textwrap.dedent("""
    import keras

    def cnn():
        model = keras.Sequential([
            keras.Input((16, 16, 3)),
            keras.layers.Conv2D(8, 3, activation="relu", name="stem"),
            keras.layers.Flatten(),
            keras.layers.Dense(10, name="classifier"),
        ])
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    def uncompiled():
        return keras.Sequential([keras.Input((16,)), keras.layers.Dense(4)])
""")


@pytest.fixture(scope="module")
def keras_file(tmp_path_factory):
    """The path of a file holding :data:`KERAS_MODELS` (``f"{keras_file}:cnn"``)."""
    path = tmp_path_factory.mktemp("keras") / "kmodels.py"
    path.write_text(KERAS_MODELS)
    return path
