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
    logits = layers.Dense(num_classes, kernel_regularizer=kernel_regularizer, dtype="float32", name="logits")(x)
    return keras.Model(inputs, logits, name="resnet_small")


def _bottleneck(x, filters: int, stride: int, kernel_regularizer, bn_momentum: float):
    """A v1.5 bottleneck: the stride sits on the 3x3 convolution, not the first 1x1."""
    shortcut = x
    if stride != 1 or x.shape[-1] != 4 * filters:
        shortcut = layers.Conv2D(4 * filters, 1, strides=stride, use_bias=False,
                                 kernel_regularizer=kernel_regularizer)(x)
        shortcut = layers.BatchNormalization(momentum=bn_momentum, epsilon=1e-5)(shortcut)
    x = layers.Conv2D(filters, 1, use_bias=False, kernel_regularizer=kernel_regularizer)(x)
    x = layers.ReLU()(layers.BatchNormalization(momentum=bn_momentum, epsilon=1e-5)(x))
    x = layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False,
                      kernel_regularizer=kernel_regularizer)(x)
    x = layers.ReLU()(layers.BatchNormalization(momentum=bn_momentum, epsilon=1e-5)(x))
    x = layers.Conv2D(4 * filters, 1, use_bias=False, kernel_regularizer=kernel_regularizer)(x)
    # Zero-init of the last BN's scale: each block starts as the identity (Goyal et al. 2017).
    x = layers.BatchNormalization(momentum=bn_momentum, epsilon=1e-5, gamma_initializer="zeros")(x)
    return layers.ReLU()(layers.Add()([x, shortcut]))


def resnet50(*, input_shape: tuple[int, ...], num_classes: int, kernel_regularizer=None,
             blocks: tuple[int, ...] = (3, 4, 6, 3), width: int = 64, bn_momentum: float = 0.9) -> keras.Model:
    """ResNet-50 v1.5 (the MLPerf / NVIDIA reference variant); L2 on kernels only, not on BN or biases.

    `blocks` and `width` shrink it for tests (e.g. blocks=(1, 1), width=8).
    """
    inputs = keras.Input(input_shape)
    x = layers.Conv2D(width, 7, strides=2, padding="same", use_bias=False,
                      kernel_regularizer=kernel_regularizer)(inputs)
    x = layers.ReLU()(layers.BatchNormalization(momentum=bn_momentum, epsilon=1e-5)(x))
    x = layers.MaxPooling2D(3, strides=2, padding="same")(x)
    for stage, num_blocks in enumerate(blocks):
        for block in range(num_blocks):
            x = _bottleneck(x, width * 2 ** stage, 2 if stage > 0 and block == 0 else 1, kernel_regularizer,
                            bn_momentum)
    x = layers.GlobalAveragePooling2D()(x)
    logits = layers.Dense(num_classes, kernel_regularizer=kernel_regularizer, dtype="float32",
                          kernel_initializer=keras.initializers.RandomNormal(stddev=0.01), name="logits")(x)
    return keras.Model(inputs, logits, name="resnet50")
