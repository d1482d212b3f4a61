"""ResNets: a small one for tiny images, and ResNet-50 for ImageNet shapes."""

from __future__ import annotations

import keras
from keras import layers


def _block(x, filters: int, stride: int, kernel_regularizer):
    """A pre-activation basic block (two 3x3 convolutions)."""
    shortcut = x
    x = layers.BatchNormalization(momentum=0.9)(x)
    x = layers.ReLU()(x)
    if stride != 1 or shortcut.shape[-1] != filters:
        shortcut = layers.Conv2D(filters, 1, strides=stride, use_bias=False,
                                 kernel_regularizer=kernel_regularizer)(x)
    x = layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False,
                      kernel_regularizer=kernel_regularizer)(x)
    x = layers.BatchNormalization(momentum=0.9)(x)
    x = layers.ReLU()(x)
    x = layers.Conv2D(filters, 3, padding="same", use_bias=False, kernel_regularizer=kernel_regularizer)(x)
    return layers.Add()([x, shortcut])


def small_resnet(*, input_shape: tuple[int, ...], num_classes: int, widths: tuple[int, ...] = (16, 32, 64),
                 blocks_per_stage: int = 1, kernel_regularizer=None) -> keras.Model:
    """A pre-activation ResNet for small images; stages after the first halve the resolution."""
    inputs = keras.Input(input_shape)
    x = layers.Conv2D(widths[0], 3, padding="same", use_bias=False, kernel_regularizer=kernel_regularizer)(inputs)
    for stage, width in enumerate(widths):
        for block in range(blocks_per_stage):
            x = _block(x, width, 2 if stage > 0 and block == 0 else 1, kernel_regularizer)
    x = layers.BatchNormalization(momentum=0.9)(x)
    x = layers.ReLU()(x)
    x = layers.GlobalAveragePooling2D()(x)
    logits = layers.Dense(num_classes, kernel_regularizer=kernel_regularizer, dtype="float32")(x)
    return keras.Model(inputs, logits, name="resnet_small")


def resnet50(*, input_shape: tuple[int, ...], num_classes: int, kernel_regularizer=None) -> keras.Model:
    """Keras' ResNet-50 (random init) with float32 logits; L2 on every kernel when asked."""
    base = keras.applications.ResNet50(weights=None, include_top=False, input_shape=input_shape, pooling="avg")
    if kernel_regularizer is not None:
        for layer in base.layers:
            if hasattr(layer, "kernel_regularizer"):
                layer.kernel_regularizer = kernel_regularizer
    logits = layers.Dense(num_classes, kernel_regularizer=kernel_regularizer, dtype="float32")(base.output)
    return keras.Model(base.input, logits, name="resnet50")
