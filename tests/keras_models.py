"""Keras 3 models for the Keras tests (importable by name, like ``capped_models``, so trial
processes can build them): a Sequential CNN, a functional model with two inputs, a
subclassed model and a mixed-bfloat16 CNN, each compiled with its own loss and optimizer.
Keras must already be imported on the torch backend (tests/conftest.py sets it)."""

from __future__ import annotations

import keras

from batchfit import TensorSpec


def sequential_cnn() -> keras.Model:
    """Conv-BN-pool-conv-dense with Adam and an accuracy metric; 1.4 M parameters, most in
    the first dense layer, so at batch 64 activations and Keras Adam's state both count."""
    model = keras.Sequential([
        keras.Input((32, 32, 3)),
        keras.layers.Conv2D(16, 3, activation="relu", name="conv_a"),
        keras.layers.BatchNormalization(),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile(optimizer="adam", metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def two_inputs() -> keras.Model:
    """An image and a feature vector, merged; SGD with momentum, softmax + categorical
    cross-entropy against one-hot-like targets."""
    image = keras.Input((24, 24, 3), name="image")
    features = keras.Input((12,), name="features")
    x = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(image)
    x = keras.layers.GlobalAveragePooling2D()(x)
    f = keras.layers.Dense(32, activation="relu")(features)
    h = keras.layers.Dense(64, activation="relu")(keras.layers.Concatenate()([x, f]))
    out = keras.layers.Dense(5, activation="softmax")(h)
    model = keras.Model([image, features], out)
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                  loss="categorical_crossentropy")
    return model


class Block(keras.layers.Layer):
    """dense-gelu-dense with a residual and a layer norm."""

    def __init__(self, units: int, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.up = keras.layers.Dense(units, activation="gelu")
        self.down = keras.layers.Dense(units)
        self.norm = keras.layers.LayerNormalization()

    def call(self, x):
        return self.norm(x + self.down(self.up(x)))


class Residual(keras.Model):
    """A subclassed model: three blocks of width 256 on 64 features."""

    def __init__(self, width: int = 256, **kwargs):
        super().__init__(**kwargs)
        self.width = width
        self.stem = keras.layers.Dense(width)
        self.blocks = [Block(width, name=f"block{i}") for i in range(3)]
        self.head = keras.layers.Dense(10)

    def call(self, x, training=False):
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def subclassed() -> tuple[keras.Model, TensorSpec]:
    """AdamW; a subclassed model declares no input, so the factory gives the spec."""
    model = Residual()
    model.compile(optimizer=keras.optimizers.AdamW(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, TensorSpec((64,))


def mixed_bfloat16_cnn() -> keras.Model:
    """Two convolutions under Keras's mixed_bfloat16 policy (float32 head), RMSprop."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        model = keras.Sequential([
            keras.Input((32, 32, 3)),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(10, dtype="float32"),
        ])
    finally:
        keras.config.set_dtype_policy(previous)
    model.compile(optimizer="rmsprop",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def uncompiled() -> keras.Model:
    return keras.Sequential([keras.Input((16,)), keras.layers.Dense(8), keras.layers.Dense(4)])
