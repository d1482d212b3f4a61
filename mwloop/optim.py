"""Optimizer and learning-rate schedule from config."""

from __future__ import annotations

import math

import keras
import ml_collections
import tensorflow as tf

from mwloop import config_check
from mwloop.errors import UserError

# config.optimizer.gradient_accumulation_steps, recorded on the optimizer (a plain int, not checkpointed).
ACCUMULATION_ATTRIBUTE = "mwloop_accumulation_steps"
STEP_DECAY = ((0.3333, 0.1), (0.6667, 0.01), (0.8889, 0.001))  # epochs 30, 60, 80 of 90: x0.1 each


def learning_rate(cfg: ml_collections.ConfigDict, *, global_batch_size: int, total_steps: int):
    """The learning rate: linear warmup, then constant, cosine or linear decay.

    With `cfg.base_batch_size` set, the peak rate follows the linear scaling
    rule: learning_rate * global_batch_size / base_batch_size.
    """
    peak = cfg.learning_rate
    if cfg.get("base_batch_size"):
        peak *= global_batch_size / cfg.base_batch_size
    config_check.check_value("optimizer.schedule", cfg.schedule)  # also for callers that skipped check()
    if cfg.schedule == "constant" and not cfg.warmup_steps:
        return peak
    return WarmupDecay(peak, warmup_steps=min(cfg.warmup_steps, total_steps), total_steps=total_steps,
                       decay=cfg.schedule)


class WarmupDecay(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warmup to `peak` over `warmup_steps`, then constant, cosine or linear decay to 0,
    or step decay (x0.1 at 1/3, 2/3 and 8/9 of training: epochs 30, 60, 80 of 90)."""

    def __init__(self, peak: float, *, warmup_steps: int, total_steps: int, decay: str):
        self.peak, self.warmup_steps, self.total_steps, self.decay = peak, warmup_steps, total_steps, decay

    def __call__(self, step):
        ops = keras.ops
        step = ops.cast(step, "float32")
        warm = self.peak * (step + 1) / max(self.warmup_steps, 1)
        progress = ops.clip((step - self.warmup_steps) / max(self.total_steps - self.warmup_steps, 1), 0.0, 1.0)
        if self.decay == "cosine":
            after = self.peak * 0.5 * (1 + ops.cos(math.pi * progress))
        elif self.decay == "linear":
            after = self.peak * (1 - progress)
        elif self.decay == "step":
            after = self.peak * ops.ones_like(progress)
            for boundary, factor in STEP_DECAY:
                after = ops.where(step >= boundary * self.total_steps, self.peak * factor, after)
        else:
            after = self.peak * ops.ones_like(progress)
        return ops.where(step < self.warmup_steps, warm, after)

    def get_config(self) -> dict:
        return {"peak": self.peak, "warmup_steps": self.warmup_steps, "total_steps": self.total_steps,
                "decay": self.decay}


def create(cfg: ml_collections.ConfigDict, *, global_batch_size: int, total_steps: int) -> keras.optimizers.Optimizer:
    """The optimizer named by `cfg.name` (sgd | adam | adamw) with its schedule."""
    lr = learning_rate(cfg, global_batch_size=global_batch_size, total_steps=total_steps)
    # Keras' own extras: clipping by global norm (of the gradients it applies: with accumulation, the
    # accumulated ones), an EMA of the weights (per update). Not Keras' gradient_accumulation_steps: it
    # accumulates inside a cond that cannot hold the cross-replica sum; mwloop's loop accumulates instead.
    extras = {"global_clipnorm": cfg.clip_global_norm or None, "use_ema": cfg.ema, "ema_momentum": cfg.ema_momentum}
    if cfg.name == "sgd":
        optimizer = keras.optimizers.SGD(lr, momentum=cfg.momentum, nesterov=cfg.nesterov, **extras)
    elif cfg.name == "adam":
        optimizer = keras.optimizers.Adam(lr, **extras)
    elif cfg.name == "adamw":
        optimizer = keras.optimizers.AdamW(lr, weight_decay=cfg.decoupled_weight_decay, **extras)
    else:
        raise UserError(f"config.optimizer.name={cfg.name!r} is unknown; use one of sgd, adam, adamw")
    # Read by loop.make_train_loop (accumulation_steps): the run's loop follows its optimizer's config.
    setattr(optimizer, ACCUMULATION_ATTRIBUTE, cfg.get("gradient_accumulation_steps", 1))
    return optimizer


def accumulation_steps(optimizer: keras.optimizers.Optimizer) -> int:
    """Micro-batches per update of an optimizer made by `create` (under a LossScaleOptimizer too); 1 otherwise."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    return getattr(inner, ACCUMULATION_ATTRIBUTE, 1)


def current_learning_rate(optimizer: keras.optimizers.Optimizer) -> float:
    """The learning rate the optimizer applies at its current iteration."""
    # Keras evaluates the schedule at the current iteration; under a strategy the
    # constant rate is a distributed variable, which float() does not take.
    return float(tf.convert_to_tensor(optimizer.learning_rate))
