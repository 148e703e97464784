"""A Keras 3 ResNet-50 (``keras.applications``, built without weights), compiled for
ImageNet-style training: SGD with momentum, sparse categorical cross-entropy, accuracy.

    batchfit max examples/keras_resnet.py:build --gpu "RTX 3090"
    batchfit max examples/keras_resnet.py:build --gpu "RTX 3090" --precision amp-fp16
    batchfit estimate examples/keras_resnet.py:build -b 64 --gpu A100-80GB

``--precision amp-fp16`` builds it under Keras's ``mixed_float16`` policy (what
``keras.mixed_precision.set_global_policy("mixed_float16")`` in a training script does).
"""

import keras


def build(classes: int = 1000, size: int = 224) -> keras.Model:
    model = keras.applications.ResNet50(weights=None, input_shape=(size, size, 3),
                                        classes=classes)
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model
