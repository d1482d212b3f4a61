"""Optimizer and learning-rate schedule from config."""

from __future__ import annotations

import math

import keras
import ml_collections
import tensorflow as tf

from mwloop.config import check as config_check
from mwloop.errors import UserError

# Epochs 30, 60, 80 of 90: x0.1 each.
STEP_DECAY = ((0.3333, 0.1), (0.6667, 0.01), (0.8889, 0.001))


def learning_rate(cfg: ml_collections.ConfigDict, *, global_batch_size: int, total_steps: int):
    """The learning rate: linear warmup, then constant, cosine or linear decay.

    With `cfg.base_batch_size` set, the peak rate follows the linear scaling
    rule: learning_rate * global_batch_size / base_batch_size.
    """
    peak = cfg.learning_rate
    if cfg.get("base_batch_size"):
        peak *= global_batch_size / cfg.base_batch_size
    # Checked here too, for callers that skipped check().
    config_check.check_value("optimizer.schedule", cfg.schedule)
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


BUILT_IN = ("sgd", "adam", "adamw")


def create(cfg: ml_collections.ConfigDict, *, global_batch_size: int, total_steps: int,
           task=None) -> keras.optimizers.Optimizer:
    """The run's optimizer with its schedule: the task's own (`Task.build_optimizer`), or the one `cfg.name`
    names: sgd | adam | adamw with mwloop's settings, or any Keras optimizer by name (e.g. "lion",
    "adafactor", "lamb") with its arguments from `cfg.kwargs` (a ConfigDict, if the config has one).

    mwloop adds what it must to any of them: the EMA of the weights (`cfg.ema`), and, in its step, loss scaling,
    clipping of the cross-replica sum and accumulation (steps.StepOptions); the checkpoint holds whatever
    variables the optimizer has.
    """
    lr = learning_rate(cfg, global_batch_size=global_batch_size, total_steps=total_steps)
    # Keras' own extras: clipping by global norm (which mwloop's step turns off: it clips the cross-replica
    # sum itself, steps.apply_gradients; a task's own train_step keeps Keras'), an EMA of the weights (per
    # update). Not Keras' gradient_accumulation_steps: it accumulates inside a cond that cannot hold the
    # cross-replica sum; mwloop's loop accumulates instead (steps.StepOptions).
    extras = {"global_clipnorm": cfg.clip_global_norm or None, "use_ema": cfg.ema, "ema_momentum": cfg.ema_momentum}
    if task is not None and task.overrides("build_optimizer"):
        return _own(task, lr, cfg)
    if cfg.name == "sgd":
        return keras.optimizers.SGD(lr, momentum=cfg.momentum, nesterov=cfg.nesterov, **extras)
    if cfg.name == "adam":
        return keras.optimizers.Adam(lr, **extras)
    if cfg.name == "adamw":
        return keras.optimizers.AdamW(lr, weight_decay=cfg.decoupled_weight_decay, **extras)
    return _by_name(cfg, lr, extras)


def _by_name(cfg: ml_collections.ConfigDict, lr, extras: dict) -> keras.optimizers.Optimizer:
    """Any Keras optimizer by name, with `cfg.kwargs`."""
    try:
        cls = type(keras.optimizers.get(cfg.name))
    except ValueError:
        raise UserError(f"config.optimizer.name={cfg.name!r} is unknown; use one of {', '.join(BUILT_IN)}, a Keras "
                        f"optimizer's name (e.g. 'lion', 'adafactor'), or define Task.build_optimizer") from None
    kwargs = dict(cfg.get("kwargs") or {})
    try:
        return cls(learning_rate=lr, **{**extras, **kwargs})
    except TypeError as e:
        raise UserError(f"config.optimizer.kwargs={kwargs}: {cls.__name__} {e}; use its arguments "
                        f"(keras.optimizers.{cls.__name__})") from None


def _own(task, lr, cfg: ml_collections.ConfigDict) -> keras.optimizers.Optimizer:
    """The task's own optimizer, with mwloop's EMA added (set before it is built, which creates the averages)."""
    # A task's code: its mistakes as one line (imported here, as in `build`).
    from mwloop.step import user_code
    optimizer = user_code.call(task, "build_optimizer", lr)
    name = type(task).__name__
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) or not isinstance(
            optimizer, keras.optimizers.Optimizer):
        raise UserError(f"{name}.build_optimizer returned {type(optimizer).__name__}; return a Keras optimizer "
                        f"(mwloop adds loss scaling itself with config.mixed_precision='mixed_float16')")
    if optimizer.global_clipnorm or optimizer.clipnorm or optimizer.clipvalue:
        raise UserError(f"{name}.build_optimizer's optimizer clips its gradients itself, per replica before the "
                        f"cross-replica sum; leave clipping out and set config.optimizer.clip_global_norm")
    if cfg.ema:
        optimizer.use_ema, optimizer.ema_momentum = True, cfg.ema_momentum
    return optimizer


def current_learning_rate(optimizer: keras.optimizers.Optimizer) -> float:
    """The learning rate the optimizer applies at its current iteration."""
    # Keras evaluates the schedule at the current iteration; under a strategy the
    # constant rate is a distributed variable, which float() does not take.
    return float(tf.convert_to_tensor(optimizer.learning_rate))
