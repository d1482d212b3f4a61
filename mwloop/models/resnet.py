"""ResNets: a small one for tiny images, and ResNet-50 for ImageNet shapes.

Both take `sync_batch_norm` (config `model.sync_batch_norm`): with it, each BatchNormalization normalises a
training batch by the statistics of the global batch (summed over every replica), not the replica's own rows, so a
step's math is the same at any worker count (elastic jobs, a resume with another count; docs/data.md). It costs
three small all-reduces per BatchNormalization layer per step. Inference (moving statistics) is the same either way.
"""

from __future__ import annotations

import functools
from typing import Callable

import keras
from keras import layers


def _batch_norm(synchronized: bool, **kwargs) -> Callable[..., layers.BatchNormalization]:
    """A BatchNormalization maker with the model's settings (`**kwargs`); a call may add its own (e.g. init).

    Args:
      synchronized: batch statistics over all replicas (Keras' TF backend all-reduces sum, sum of squares, count).
      **kwargs: BatchNormalization's arguments shared by the model's layers.
    Returns:
      A callable that builds one layer.
    """
    return functools.partial(layers.BatchNormalization, synchronized=synchronized, **kwargs)


def _block(x, filters: int, stride: int, kernel_regularizer, batch_norm):
    """A pre-activation basic block (two 3x3 convolutions)."""
    shortcut = x
    x = batch_norm()(x)
    x = layers.ReLU()(x)
    if stride != 1 or shortcut.shape[-1] != filters:
        shortcut = layers.Conv2D(filters, 1, strides=stride, use_bias=False,
                                 kernel_regularizer=kernel_regularizer)(x)
    x = layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False,
                      kernel_regularizer=kernel_regularizer)(x)
    x = batch_norm()(x)
    x = layers.ReLU()(x)
    x = layers.Conv2D(filters, 3, padding="same", use_bias=False, kernel_regularizer=kernel_regularizer)(x)
    return layers.Add()([x, shortcut])


def small_resnet(*, input_shape: tuple[int, ...], num_classes: int, widths: tuple[int, ...] = (16, 32, 64),
                 blocks_per_stage: int = 1, kernel_regularizer=None, sync_batch_norm: bool = False) -> keras.Model:
    """A pre-activation ResNet for small images; stages after the first halve the resolution.

    `sync_batch_norm`: batch statistics over the global batch (module docstring).
    """
    batch_norm = _batch_norm(sync_batch_norm, momentum=0.9)
    inputs = keras.Input(input_shape)
    x = layers.Conv2D(widths[0], 3, padding="same", use_bias=False, kernel_regularizer=kernel_regularizer)(inputs)
    for stage, width in enumerate(widths):
        for block in range(blocks_per_stage):
            x = _block(x, width, 2 if stage > 0 and block == 0 else 1, kernel_regularizer, batch_norm)
    x = batch_norm()(x)
    x = layers.ReLU()(x)
    x = layers.GlobalAveragePooling2D()(x)
    logits = layers.Dense(num_classes, kernel_regularizer=kernel_regularizer, dtype="float32", name="logits")(x)
    return keras.Model(inputs, logits, name="resnet_small")


def _bottleneck(x, filters: int, stride: int, kernel_regularizer, batch_norm):
    """A v1.5 bottleneck: the stride sits on the 3x3 convolution, not the first 1x1."""
    shortcut = x
    if stride != 1 or x.shape[-1] != 4 * filters:
        shortcut = layers.Conv2D(4 * filters, 1, strides=stride, use_bias=False,
                                 kernel_regularizer=kernel_regularizer)(x)
        shortcut = batch_norm()(shortcut)
    x = layers.Conv2D(filters, 1, use_bias=False, kernel_regularizer=kernel_regularizer)(x)
    x = layers.ReLU()(batch_norm()(x))
    x = layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False,
                      kernel_regularizer=kernel_regularizer)(x)
    x = layers.ReLU()(batch_norm()(x))
    x = layers.Conv2D(4 * filters, 1, use_bias=False, kernel_regularizer=kernel_regularizer)(x)
    # Zero-init of the last BN's scale: each block starts as the identity (Goyal et al. 2017).
    x = batch_norm(gamma_initializer="zeros")(x)
    return layers.ReLU()(layers.Add()([x, shortcut]))


def resnet50(*, input_shape: tuple[int, ...], num_classes: int, kernel_regularizer=None,
             blocks: tuple[int, ...] = (3, 4, 6, 3), width: int = 64, bn_momentum: float = 0.9,
             sync_batch_norm: bool = False) -> keras.Model:
    """ResNet-50 v1.5 (the MLPerf / NVIDIA reference variant); L2 on kernels only, not on BN or biases.

    `blocks` and `width` shrink it for tests (e.g. blocks=(1, 1), width=8). `sync_batch_norm`: batch statistics
    over the global batch (module docstring).
    """
    batch_norm = _batch_norm(sync_batch_norm, momentum=bn_momentum, epsilon=1e-5)
    inputs = keras.Input(input_shape)
    x = layers.Conv2D(width, 7, strides=2, padding="same", use_bias=False,
                      kernel_regularizer=kernel_regularizer)(inputs)
    x = layers.ReLU()(batch_norm()(x))
    x = layers.MaxPooling2D(3, strides=2, padding="same")(x)
    for stage, num_blocks in enumerate(blocks):
        for block in range(num_blocks):
            x = _bottleneck(x, width * 2 ** stage, 2 if stage > 0 and block == 0 else 1, kernel_regularizer,
                            batch_norm)
    x = layers.GlobalAveragePooling2D()(x)
    logits = layers.Dense(num_classes, kernel_regularizer=kernel_regularizer, dtype="float32",
                          kernel_initializer=keras.initializers.RandomNormal(stddev=0.01), name="logits")(x)
    return keras.Model(inputs, logits, name="resnet50")
