"""The one place a run's config is checked: every entry point calls `check` (and `check_run` once it knows
the strategy and the task), so the Python API fails as clearly as the command line.

Each rule names the key, the value and the fix in one line (`ConfigError`, a UserError: exit 2 from
`mwloop.main`). Each knob's own rule is declared with it in `mwloop.config.schema`; the rules here join
several knobs, the strategy or the task. No TensorFlow here: sweep planning checks every point with `check`
before anything runs.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable
from typing import Any

import ml_collections

from mwloop.config import schema
from mwloop.config.knobs import ConfigError

MODES = ("train", "eval", "train_and_eval", "continuous_eval", "export")
WRITERS = schema.WRITERS
INTERVAL = schema.INTERVAL

# Views of the table (mwloop.config.schema), for code that wants one kind of rule.
CHOICES: dict[str, tuple[Any, ...]] = {k.key: k.choices for k in schema.TABLE if k.choices is not None}
RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {k.key: k.range for k in schema.TABLE if k.range is not None}
INTEGERS = tuple(k.key for k in schema.TABLE if k.integer)


def _get(config: ml_collections.ConfigDict, key: str) -> tuple[bool, Any]:
    """(present, value) of a dotted key; a task's config may leave out the built-in task's keys."""
    node: Any = config
    for part in key.split("."):
        if not hasattr(node, "keys") or part not in node:
            return False, None
        node = node[part]
    return True, node


def check(config: ml_collections.ConfigDict, mode: str | None = None) -> None:
    """Every knob present in the config against its rule (mwloop.config.schema), then the rules that join
    several knobs; `mode` too if given.

    Args:
      config: a run's config (base_config and the user's changes).
      mode: the run's mode (`--mode`), or None when not known here.
    Raises:
      ConfigError: the first setting that cannot work, in one line.
    """
    if mode is not None and mode not in MODES:
        raise ConfigError(f"--mode={mode!r} is unknown; use one of {', '.join(MODES)}")
    for knob in schema.TABLE:
        present, value = _get(config, knob.key)
        if present:
            knob.check(value)
    _check_allow_changed(config)
    present, strategy = _get(config, "distribution.strategy")
    # Before the strategy: the ps tasks would serve a run that fails.
    if present and strategy == "parameter_server":
        _check_deterministic_ps(config)


def check_value(key: str, value: Any) -> None:
    """One setting against its declared rule (for code handed one part of a config).

    Raises:
      ConfigError: the value is not allowed, in one line.
    """
    knob = schema.TABLE.knobs.get(key)
    if knob is not None:
        knob.check(value)


def check_writers(writers: Any) -> None:
    """Each name in config.writers against WRITERS (also for the writer, handed only that key)."""
    schema.check_writers("writers", writers)


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
        # Each replica's share must split into the micro-batches too.
        step = k if name == "train" else 1
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
    if _get(config, "deterministic")[1]:
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
    if any(s > 0 for s in _get(config, "nan_at_steps")[1] or ()):
        raise ConfigError("config.nan_at_steps (the NaN fault drill) is not available with parameter servers; "
                          "leave it at (0,)")


def _check_async_checkpoint(config: ml_collections.ConfigDict, *, num_workers: int, parameter_server: bool) -> None:
    """Asynchronous checkpoints on one process or MultiWorkerMirrored, not parameter servers (BENCHMARKS.md)."""
    present, enabled = _get(config, "train.async_checkpoint")
    if present and enabled and parameter_server:
        raise ConfigError("config.train.async_checkpoint=True does not work with parameter servers: the variables "
                          "live on the ps tasks, where an asynchronous copy is not tried by mwloop; set "
                          "config.train.async_checkpoint=False")
