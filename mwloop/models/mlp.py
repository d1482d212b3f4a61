"""A small multilayer perceptron."""

from __future__ import annotations

import keras


def mlp(*, input_shape: tuple[int, ...], num_classes: int, hidden: tuple[int, ...] = (32,),
        kernel_regularizer=None) -> keras.Model:
    """Flatten -> Dense(relu) x len(hidden) -> Dense(num_classes) logits."""
    inputs = keras.Input(input_shape)
    x = keras.layers.Flatten()(inputs)
    # Stable layer names: warm starts select weights by them.
    for i, width in enumerate(hidden):
        x = keras.layers.Dense(width, activation="relu", kernel_regularizer=kernel_regularizer, name=f"hidden_{i}")(x)
    logits = keras.layers.Dense(num_classes, kernel_regularizer=kernel_regularizer, dtype="float32",
                                name="logits")(x)
    return keras.Model(inputs, logits, name="mlp")
