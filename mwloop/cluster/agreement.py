"""Every task of a cluster runs the same run as the chief, or nobody trains.

Workers started with different settings used to train anyway: with another
`train.global_batch_size` every update divided its sums by the wrong count and
the run exited 0; with another model size the first collective died with a
`Shape mismatch` traceback; with another `train.steps` or eval interval one
worker waits forever in a collective the others never join.

So before any variable or dataset exists, each task compares its run settings
(`settings`: the flattened config but for the knobs whose policy in
`mwloop.config.schema` says `per_task`, the task class and the source of its
file, the cluster TF_CONFIG told it about) with the chief's, through
TensorFlow's coordination-service key-value store (`check_cluster`,
MultiWorkerMirroredStrategy):

  1. the chief publishes its settings;
  2. every other task reads them, publishes its verdict (what differs, or
     nothing), and a task that differs exits with one line naming the keys,
     the values on each side and the fix;
  3. the chief reads every verdict (bounded, logging whom it waits for) and
     publishes the outcome; a difference anywhere ends the chief and the tasks
     that agreed with the same line, naming the task that differs.

Three small key-value round trips: a few milliseconds at a 2-worker start.

The side-car evaluator is outside the coordination service: it compares with
the run's record, `workdir/config.json` (`check_recorded`), but for the knobs
whose `evaluator` policy lets it run its own way. Under parameter
servers only the chief runs mwloop's code: workers and ps tasks serve the
functions the chief traced, so their own config never enters the math (the
chief still checks its config as every run does).
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import json
import os
import time
from typing import Any

import ml_collections
import tensorflow as tf
from absl import logging
from tensorflow.python.eager import context

from mwloop.artifacts import files, resume_check
from mwloop.config import schema
from mwloop.errors import UserError

FIX = "start every task with the same config and overrides"
POLL_S = 5.0  # a wait for another task logs whom it waits for this often
_PREFIX = "mwloop/agreement"
_generation = itertools.count()  # a key per Trainer built in this process: every task builds them in one order


def _source_digest(cls: type) -> str | None:
    """sha256 (12 hex digits) of the file defining `cls`: the same task name with other code is another run."""
    try:
        path = inspect.getsourcefile(cls)
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()[:12]
    except (TypeError, OSError):  # a class built at run time, or a file gone: nothing to compare
        return None


def settings(config: ml_collections.ConfigDict, task: object | None = None, *,
             evaluator: bool = False) -> dict[str, Any]:
    """This task's run as {dotted key: value}: the config but the knobs whose policy lets them differ per task
    (for the side-car `evaluator`: those it may run its own way, or by a rule `check_recorded` applies), the
    task's class and source, and (trainer tasks) the cluster TF_CONFIG describes (the chief's and each worker's
    view of it must be the same)."""
    table = schema.TABLE
    flat = {k: v for k, v in resume_check.flatten(json.loads(config.to_json_best_effort())).items()
            if not (table.policy(k).evaluator is True if evaluator else table.policy(k).per_task)}
    if task is not None:
        flat["task.class"] = type(task).__qualname__
        flat["task.source_sha256"] = _source_digest(type(task))
    if not evaluator:  # the side-car runs a strategy of its own
        raw = os.environ.get("TF_CONFIG", "") or "{}"
        flat["cluster"] = (json.loads(raw) or {}).get("cluster")
        flat["cluster.elastic_workers"] = os.environ.get("MWLOOP_ELASTIC_WORKERS") or None
    return flat


def differences(mine: dict[str, Any], theirs: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{key: (mine, theirs)} of the settings that differ (a key only one side has counts, as None)."""
    return {key: (mine.get(key), theirs.get(key)) for key in sorted(set(mine) | set(theirs))
            if not resume_check.same(mine.get(key), theirs.get(key))}


def _show(value: Any) -> str:
    if isinstance(value, dict):  # the cluster: its tasks' counts say more than a wall of addresses
        return "{" + ", ".join(f"{k}: {len(v)}" if isinstance(v, list) else f"{k}: {v}" for k, v in value.items()) \
            + "}"
    return "(unset)" if value is None else resume_check.show(value)


def describe(who: str, found: dict[str, tuple[Any, Any]], here: str = "here", there: str = "on the chief") -> str:
    """The one line: `worker 1 runs another run than the chief: KEY=MINE here, THEIRS on the chief; FIX`."""
    listed = "; ".join(f"{key}={_show(mine)} {here}, {_show(theirs)} {there}" for key, (mine, theirs) in found.items())
    return f"{who} runs another run than the chief: {listed}; {FIX}"


# ---------------------------------------------------------------------------- the cluster's check

def _get(key: str, what: str, timeout_s: float) -> str:
    """The value of `key` once set; logs every POLL_S that it waits for `what`; UserError after `timeout_s`
    (0: wait forever). A task that died meanwhile fails the coordination service's call instead."""
    started = time.monotonic()
    while True:
        waited = time.monotonic() - started
        left = timeout_s - waited if timeout_s else POLL_S
        try:
            return context.context().get_config_key_value(key, int(max(1.0, min(POLL_S, left) * 1000)))
        except tf.errors.DeadlineExceededError:
            waited = time.monotonic() - started
            if timeout_s and waited >= timeout_s:
                raise UserError(f"{what} did not come within {timeout_s:.0f} s "
                                f"(config.distribution.startup_timeout_s): that task is stuck before training; "
                                f"look at its output, or raise the timeout") from None
            logging.info("waiting for %s (%.0f s%s)", what, waited, f" of {timeout_s:.0f} s" if timeout_s else "")


def _tasks(strategy: tf.distribute.Strategy) -> tuple[str, list[str]]:
    """(this task's name, the names of the tasks that are not the chief), e.g. ("worker 1", ["worker 1"])."""
    resolver = strategy.cluster_resolver
    spec = resolver.cluster_spec()
    names = [f"{kind} {i}" for kind in ("chief", "worker") if kind in spec.jobs for i in range(spec.num_tasks(kind))]
    return f"{resolver.task_type} {resolver.task_id}", names[1:]


def check_cluster(strategy: tf.distribute.Strategy, config: ml_collections.ConfigDict, task: object | None = None,
                  *, chief: bool, timeout_s: float = 300.0, extra: dict[str, Any] | None = None) -> None:
    """Every task of a multi-worker strategy calls it once per Trainer, before any variable: returns when every
    task runs the chief's settings (`settings`), else raises UserError with `describe`'s line on every task.

    Args:
      strategy: a MultiWorkerMirroredStrategy with its coordination service (any other strategy: nothing to do).
      config, task: this task's run.
      chief: whether this task is the chief (it publishes; the others compare).
      timeout_s: how long one wait for another task may take (0: forever).
      extra: more facts of this task's run that must agree (e.g. whether the Trainer evaluates: --mode=train on
        one task and train_and_eval on another would leave one waiting in the other's eval).
    """
    if getattr(strategy.extended, "_num_workers", 1) <= 1 or context.context().coordination_service is None:
        return
    started = time.perf_counter()
    me, others = _tasks(strategy)
    base = f"{_PREFIX}/{next(_generation)}"
    mine = {**settings(config, task), **(extra or {})}
    if chief:
        context.context().set_config_key_value(f"{base}/chief", json.dumps(mine, sort_keys=True, default=str))
        verdicts = {name: _get(f"{base}/verdict/{name}", f"{name}'s check of the run settings", timeout_s)
                    for name in others}
        outcome = next((line for line in verdicts.values() if line), "")
        context.context().set_config_key_value(f"{base}/outcome", outcome)
    else:
        chiefs = json.loads(_get(f"{base}/chief", "the chief's run settings", timeout_s))
        found = differences(json.loads(json.dumps(mine, default=str)), chiefs)
        line = describe(me, found) if found else ""
        context.context().set_config_key_value(f"{base}/verdict/{me}", line)
        outcome = line or _get(f"{base}/outcome", "the chief's verdict on the run settings", timeout_s)
    if outcome:
        raise UserError(outcome)
    logging.info("every task runs the chief's settings (%d keys, checked in %.1f ms)", len(mine),
                 (time.perf_counter() - started) * 1000)


# ---------------------------------------------------------------------------- the side-car

def check_recorded(config: ml_collections.ConfigDict, workdir: str, task: object | None = None) -> bool:
    """The side-car evaluator's check against the chief's record, workdir/config.json: UserError naming what
    differs; False when there is no record yet (the chief writes it before its first checkpoint)."""
    recorded = resume_check.recorded_config(workdir)
    if recorded is None:
        return False
    theirs = resume_check.flatten(recorded)
    mine = settings(config, task, evaluator=True)
    found = {k: v for k, v in differences(mine, {k: theirs.get(k) for k in mine}).items()
             if k in theirs}  # a key the record lacks (an older mwloop, task.*): nothing to compare
    for key, (evaluators, trainers) in list(found.items()):
        rule = schema.TABLE.policy(key).evaluator
        if callable(rule) and rule(evaluators, trainers):  # e.g. train.steps: more steps only waits longer
            del found[key]
    if found:
        raise UserError(describe("the evaluator", found, there=f"in {os.path.join(workdir, files.CONFIG)}"))
    return True
