"""The one place a run's config is checked: every entry point calls `check` (and `check_run` once it knows
the strategy and the task), so the Python API fails as clearly as the command line.

Each rule names the key, the value and the fix in one line (`ConfigError`, a UserError: exit 2 from
`mwloop.main`). No TensorFlow here: sweep planning checks every point with `check` before anything runs.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable
from typing import Any

import ml_collections

from mwloop.errors import UserError

MODES = ("train", "eval", "train_and_eval", "continuous_eval", "export")

# Enumerated settings: key -> allowed values. The modules that act on them import these tuples.
CHOICES: dict[str, tuple[str, ...]] = {
    "on_nonfinite": ("fail", "skip"),
    "mixed_precision": ("float32", "mixed_bfloat16", "mixed_float16"),
    "train.feed": ("resident", "iterator"),
    "eval.checkpoint": ("latest", "best"),
    "best_checkpoint.mode": ("max", "min"),
    "early_stopping.mode": ("min", "max"),
    "optimizer.schedule": ("constant", "cosine", "linear", "step"),
    "distribution.strategy": ("auto", "default", "one_device", "mirrored", "multi_worker", "parameter_server"),
    "distribution.collective": ("auto", "ring", "nccl"),
}

WRITERS = ("tensorboard", "mlflow")  # what config.writers may name; metrics.jsonl is always written

INTERVAL = "use 0 (never) or a positive interval"
# Numeric settings: key -> (is the value allowed, what to use instead).
RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "seed": (lambda v: v >= 0, "use a non-negative integer"),
    "train.steps": (lambda v: v >= 1, "train for at least 1 step"),
    "train.steps_per_loop": (lambda v: v >= 1, "use 1 or more steps per loop call"),
    "train.global_batch_size": (lambda v: v >= 1, "use a positive number of examples per update"),
    "eval.global_batch_size": (lambda v: v >= 1, "use a positive number of examples per eval batch"),
    "train.log_every_steps": (lambda v: v >= 0, INTERVAL),
    "train.eval_every_steps": (lambda v: v >= 0, INTERVAL),
    "train.checkpoint_every_steps": (lambda v: v >= 0, INTERVAL),
    "train.eval_every_secs": (lambda v: v >= 0, INTERVAL),
    "train.checkpoint_every_secs": (lambda v: v >= 0, INTERVAL),
    "train.max_to_keep": (lambda v: v >= 1, "keep at least 1 checkpoint"),
    "export_keep": (lambda v: v >= 0, "keep 1 or more exported versions (0: all)"),
    "train.label_smoothing": (lambda v: 0 <= v < 1, "use a value in [0, 1)"),
    "eval.continuous_timeout_s": (lambda v: v >= 0, "use 0 (wait forever) or a positive number of seconds"),
    "early_stopping.patience": (lambda v: v >= 1, "use 1 or more evals"),
    "early_stopping.min_delta": (lambda v: v >= 0, "use 0 or a positive improvement"),
    "optimizer.learning_rate": (lambda v: v >= 0, "use a non-negative learning rate"),
    "optimizer.base_batch_size": (lambda v: v >= 0, "use 0 (no linear scaling) or a batch size"),
    "optimizer.warmup_steps": (lambda v: v >= 0, "use 0 (no warmup) or a number of steps"),
    "optimizer.momentum": (lambda v: 0 <= v <= 1, "use a value in [0, 1]"),
    "optimizer.weight_decay": (lambda v: v >= 0, "use 0 (none) or a positive L2 factor"),
    "optimizer.decoupled_weight_decay": (lambda v: v >= 0, "use 0 (none) or a positive factor"),
    "optimizer.clip_global_norm": (lambda v: v >= 0, "use 0 (no clipping) or a positive norm"),
    "optimizer.ema_momentum": (lambda v: 0 <= v <= 1, "use a value in [0, 1]"),
    "optimizer.gradient_accumulation_steps": (lambda v: v >= 1,
                                              "use 1 (one update per batch) or more micro-batches per update"),
    "distribution.num_cpu_devices": (lambda v: v >= 0, "use 0 (as the machine has) or a number of devices"),
    "distribution.collective_timeout_s": (lambda v: v >= 0, "use 0 (no timeout) or a number of seconds"),
    "distribution.startup_timeout_s": (lambda v: v >= 0, "use 0 (wait forever) or a number of seconds"),
    "distribution.peer_timeout_s": (lambda v: v >= 0, "use 0 (wait forever) or a number of seconds"),
    "distribution.bytes_per_pack": (lambda v: v >= 0, "use 0 (one pack) or a byte count"),
}
INTEGERS = ("seed", "train.steps", "train.steps_per_loop", "train.global_batch_size", "eval.global_batch_size",
            "train.max_to_keep", "export_keep", "early_stopping.patience", "optimizer.gradient_accumulation_steps",
            "optimizer.warmup_steps")


class ConfigError(UserError):
    """A setting that cannot work: one line naming the key, its value and the fix."""


def _get(config: ml_collections.ConfigDict, key: str) -> tuple[bool, Any]:
    """(present, value) of a dotted key; a task's config may leave out the built-in task's keys."""
    node: Any = config
    for part in key.split("."):
        if not hasattr(node, "keys") or part not in node:
            return False, None
        node = node[part]
    return True, node


def _fail(key: str, value: Any, fix: str) -> ConfigError:
    return ConfigError(f"config.{key}={value!r}; {fix}")


def check(config: ml_collections.ConfigDict, mode: str | None = None) -> None:
    """Every enumerated setting against its values, every count against its range; `mode` too if given.

    Args:
      config: a run's config (base_config and the user's changes).
      mode: the run's mode (`--mode`), or None when not known here.
    Raises:
      ConfigError: the first setting that cannot work, in one line.
    """
    if mode is not None and mode not in MODES:
        raise ConfigError(f"--mode={mode!r} is unknown; use one of {', '.join(MODES)}")
    for key in (*CHOICES, *RANGES):
        present, value = _get(config, key)
        if present:
            check_value(key, value)
    _check_profile_steps(config)
    _check_allow_changed(config)
    present, strategy = _get(config, "distribution.strategy")
    if present and strategy == "parameter_server":  # before the strategy: the ps tasks would serve a run that fails
        _check_deterministic_ps(config)
    present, writers = _get(config, "writers")
    check_writers(writers if present else ())
    for key in ("best_checkpoint.metric", "early_stopping.metric"):
        present, metric = _get(config, key)
        if present and metric and not _is_metric_name(metric):
            raise _fail(key, metric, "name an eval metric as 'SPLIT/NAME', e.g. 'eval/accuracy'")


def check_value(key: str, value: Any) -> None:
    """One setting against its rule in CHOICES or RANGES (for code handed one part of a config).

    Raises:
      ConfigError: the value is not allowed, in one line.
    """
    if key in CHOICES and value not in CHOICES[key]:
        raise _fail(key, value, f"use one of {', '.join(CHOICES[key])}")
    if key in RANGES:
        allowed, fix = RANGES[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or (
                key in INTEGERS and not float(value).is_integer()):
            raise _fail(key, value, f"use a number ({fix.removeprefix('use ')})")
        if not allowed(value):
            raise _fail(key, value, fix)


def check_writers(writers: Any) -> None:
    """Each name in config.writers against WRITERS (also for the writer, handed only that key)."""
    for name in writers:
        if name not in WRITERS:
            raise ConfigError(f"config.writers has {name!r}; use any of {', '.join(map(repr, WRITERS))} "
                              f"(metrics.jsonl is always written)")


def _is_metric_name(metric: Any) -> bool:
    split, sep, name = str(metric).partition("/")
    return bool(sep and split and name)


def _check_profile_steps(config: ml_collections.ConfigDict) -> None:
    present, value = _get(config, "profile_steps")
    if not present:
        return
    fix = "use (first, last) steps with last > first, or (0, 0) for no profile"
    if not isinstance(value, (tuple, list)) or len(value) != 2 or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise _fail("profile_steps", value, fix)
    if value[1] < value[0]:
        raise _fail("profile_steps", value, fix)


def check_run(config: ml_collections.ConfigDict, *, num_replicas: int, custom_train_step: bool = False,
              parameter_server: bool = False, num_workers: int = 1) -> None:
    """The rules that depend on the run's strategy and task, after `check`.

    Args:
      config: the run's config, already through `check`.
      num_replicas: replicas in sync (all workers).
      custom_train_step: whether the task defines its own whole `train_step`.
      parameter_server: whether the run uses parameter servers.
      num_workers: worker processes of the run.
    Raises:
      ConfigError: the first combination that cannot work, in one line.
    """
    _check_async_checkpoint(config, num_workers=num_workers, parameter_server=parameter_server)
    for name in ("train", "eval"):
        batch = config[name].global_batch_size
        if batch % num_replicas:
            raise ConfigError(f"config.{name}.global_batch_size={batch} does not divide among {num_replicas} "
                              f"replicas; set it to a positive multiple of {num_replicas}")
    check_step(accumulation_steps=config.optimizer.gradient_accumulation_steps,
               global_batch_size=config.train.global_batch_size, num_replicas=num_replicas,
               custom_train_step=custom_train_step, skip_nonfinite=config.on_nonfinite == "skip")
    if config.optimizer.clip_global_norm and num_replicas > 1 and custom_train_step:
        raise ConfigError(f"config.optimizer.clip_global_norm={config.optimizer.clip_global_norm} with a task's own "
                          f"train_step on {num_replicas} replicas: Keras would clip each replica's part of the "
                          f"gradient, not their sum; clip in your train_step with mwloop.apply_gradients(model, "
                          f"optimizer, grads, clip_global_norm) and set clip_global_norm=0, or override "
                          f"compute_loss instead of train_step")
    if parameter_server:
        _check_parameter_server(config)


def check_worker_counts(config: ml_collections.ConfigDict, *, replicas_per_worker: int, counts: range) -> None:
    """An elastic job's rule: the global batches divide among the replicas of every worker count it may train with,
    so that a re-formed job trains on the same examples at every step (mwloop.launcher.elastic).

    Args:
      config: the run's config.
      replicas_per_worker: replicas of each worker (every worker has the same devices).
      counts: the worker counts the job may train with (MIN..MAX).
    Raises:
      ConfigError: naming the counts that do not divide and the nearest batch sizes that divide for all.
    """
    k = config.optimizer.gradient_accumulation_steps
    for name in ("train", "eval"):
        batch = config[name].global_batch_size
        step = k if name == "train" else 1  # each replica's share must split into the micro-batches too
        failing = [n for n in counts if batch % (n * replicas_per_worker * step)]
        if failing:
            multiple = math.lcm(*(n * replicas_per_worker * step for n in counts))
            nearest = sorted({max(multiple, batch // multiple * multiple), (batch // multiple + 1) * multiple})
            raise ConfigError(
                f"config.{name}.global_batch_size={batch} does not divide among the replicas of "
                f"{', '.join(map(str, failing))} worker(s) ({replicas_per_worker} replica(s) each"
                f"{f' x {k} micro-batches' if step > 1 else ''}), a count this elastic job "
                f"(--num_workers={counts.start}:{counts.stop - 1}) may train with; set it to a multiple of "
                f"{multiple}, e.g. {' or '.join(map(str, nearest))}, or narrow --num_workers")


def check_step(*, accumulation_steps: int, global_batch_size: int, num_replicas: int,
               custom_train_step: bool = False, skip_nonfinite: bool = False) -> None:
    """The rules of the train step's options, also for code that builds a loop without a config (the loop and
    the feed call it with their arguments).

    Raises:
      ConfigError: the first option the step cannot honour, in one line.
    """
    k = accumulation_steps
    check_value("optimizer.gradient_accumulation_steps", k)
    if k > 1 and custom_train_step:
        raise ConfigError(f"config.optimizer.gradient_accumulation_steps={k} with a task's own train_step, which "
                          f"applies its updates itself, so mwloop cannot accumulate its gradients; override "
                          f"compute_loss(model, batch, training) instead of train_step (mwloop's step then "
                          f"accumulates), or set config.optimizer.gradient_accumulation_steps=1")
    if k > 1 and global_batch_size % (num_replicas * k):
        raise ConfigError(f"config.train.global_batch_size={global_batch_size} does not divide into {k} micro-batches "
                          f"on each of {num_replicas} replica(s); set it to a multiple of {num_replicas} x {k} = "
                          f"{num_replicas * k}, or change config.optimizer.gradient_accumulation_steps")
    if skip_nonfinite and custom_train_step:
        raise ConfigError("config.on_nonfinite='skip' with a task's own train_step, which applies its updates "
                          "itself, so mwloop cannot skip non-finite ones; override compute_loss(model, batch, "
                          "training) instead of train_step (mwloop's step then skips them), or set "
                          "config.on_nonfinite='fail'")


def _config_keys(tree: Any, prefix: str = "") -> list[str]:
    """Every dotted key of the config, leaves and the sections above them (`optimizer`, `optimizer.lr`)."""
    keys = []
    for name in tree.keys():
        key = f"{prefix}{name}"
        keys.append(key)
        if hasattr(tree[name], "keys"):
            keys.extend(_config_keys(tree[name], key + "."))
    return keys


def _check_allow_changed(config: ml_collections.ConfigDict) -> None:
    """Each key of train.allow_changed names a setting or section of the config: a misspelt one would let
    nothing through and look as if it did."""
    present, text = _get(config, "train.allow_changed")
    if not present or not text:
        return
    known = _config_keys(config)
    for key in (k.strip() for k in str(text).split(",")):
        if key and key not in known:
            nearest = difflib.get_close_matches(key, known, n=1, cutoff=0.0)
            hint = f" (nearest valid key: {nearest[0]})" if nearest else ""
            raise ConfigError(f"config.train.allow_changed names {key!r}, which is not a setting of this config"
                              f"{hint}; give existing keys or sections, comma-separated")


def _check_deterministic_ps(config: ml_collections.ConfigDict) -> None:
    if config.get("deterministic", False):
        raise ConfigError("config.deterministic=True does not work with parameter servers (each worker applies its "
                          "update as soon as its step ends, in no fixed order, so no run can be repeated); set "
                          "config.deterministic=False, or use config.distribution.strategy='multi_worker'")


def _check_parameter_server(config: ml_collections.ConfigDict) -> None:
    _check_deterministic_ps(config)
    if config.on_nonfinite == "skip":
        raise ConfigError("config.on_nonfinite='skip' is not supported with parameter servers (each worker applies "
                          "its update as soon as its step ends, with no common point at which to skip it); set "
                          "config.on_nonfinite='fail'")
    if config.optimizer.gradient_accumulation_steps > 1:
        raise ConfigError(f"config.optimizer.gradient_accumulation_steps={config.optimizer.gradient_accumulation_steps}"
                          f" does not work with parameter servers (each scheduled step is one whole update by one "
                          f"worker); raise config.train.global_batch_size instead")
    if any(s > 0 for s in config.get("nan_at_steps", ())):
        raise ConfigError("config.nan_at_steps (the NaN fault drill) is not available with parameter servers; "
                          "leave it at (0,)")


def _check_async_checkpoint(config: ml_collections.ConfigDict, *, num_workers: int, parameter_server: bool) -> None:
    """Asynchronous checkpoints on one process or MultiWorkerMirrored, not parameter servers (BENCHMARKS.md)."""
    present, enabled = _get(config, "train.async_checkpoint")
    if present and enabled and parameter_server:
        raise ConfigError("config.train.async_checkpoint=True does not work with parameter servers: the variables "
                          "live on the ps tasks, where an asynchronous copy is not tried by mwloop; set "
                          "config.train.async_checkpoint=False")
