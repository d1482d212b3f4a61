"""Keras 3 models by name, built inside strategy.scope()."""

from __future__ import annotations

import inspect
from typing import Callable

import keras
import ml_collections

from mwloop.errors import UserError
from mwloop.models import mlp, resnet

MODELS: dict[str, Callable[..., keras.Model]] = {
    "mlp": mlp.mlp,
    "resnet_small": resnet.small_resnet,
    "resnet50": resnet.resnet50,
}


def build(cfg: ml_collections.ConfigDict, *, input_shape: tuple[int, ...], num_classes: int,
          weight_decay: float) -> keras.Model:
    """Builds `cfg.name` with the other fields of `cfg` as keyword arguments.

    `weight_decay` becomes an L2 penalty of weight_decay / 2 on kernels, so its
    gradient is weight_decay * w as in SGD's classic weight decay.
    """
    if cfg.name not in MODELS:
        raise UserError(f"config.model.name={cfg.name!r} is unknown; use one of {', '.join(MODELS)}")
    kwargs = {k: v for k, v in cfg.items() if k != "name"}
    accepted = set(inspect.signature(MODELS[cfg.name]).parameters) - {"input_shape", "num_classes",
                                                                         "kernel_regularizer"}
    unknown = sorted(set(kwargs) - accepted)
    # E.g. another model's keys left in the config after --config.model.name=...
    if unknown:
        raise UserError(f"config.model has {', '.join(unknown)}, which model {cfg.name!r} does not take "
                         f"(it takes {', '.join(sorted(accepted)) or 'nothing'}); remove them or pick the model "
                         f"they belong to")
    regularizer = keras.regularizers.L2(weight_decay / 2) if weight_decay else None
    return MODELS[cfg.name](input_shape=input_shape, num_classes=num_classes,
                            kernel_regularizer=regularizer, **kwargs)
