"""Every task of a cluster runs the same run as the chief, or nobody trains.

Workers started with different settings used to train anyway: with another
`train.global_batch_size` every update divided its sums by the wrong count and
the run exited 0; with another model size the first collective died with a
`Shape mismatch` traceback; with another `train.steps` or eval interval one
worker waits forever in a collective the others never join.

So each task compares with the chief's, through TensorFlow's coordination-service
key-value store, twice:

  - right after the strategy exists and before its first collective
    (`check_environment`, from `distribute.create_strategy`): what the task
    takes from its machine rather than its config (`environment`: the cluster
    TF_CONFIG or Slurm told it about, its local devices, the TensorFlow, Keras,
    Python and mwloop it runs). Workers told of different clusters used to
    abort the first all-reduce with a CollectiveReduceV2 traceback on every
    task;
  - before any variable or dataset exists (`check_cluster`, from `build_run`):
    its run settings (`settings`: the flattened config but for the knobs whose
    policy in `mwloop.config.schema` says `per_task`, the task class and the
    source of its file), with the environment again for a strategy the caller
    made.

Each is the same exchange (`_agree`):

  1. the chief publishes its facts;
  2. every other task reads them, publishes its verdict (what differs, or
     nothing), and a task that differs exits with one line naming the keys,
     the values on each side and the fix;
  3. the chief reads every verdict (bounded, logging whom it waits for) and
     publishes the outcome; a difference anywhere ends the chief and the tasks
     that agreed with the same line, naming the task that differs.

What no key-value store can see: tasks told of different coordination leaders
(task 0's address) never meet in one service; they wait until
config.distribution.startup_timeout_s, and the startup watchdog names the tasks
it cannot reach.

Each exchange is three small key-value round trips: a few milliseconds at a 2-worker start.

The side-car evaluator is outside the coordination service: it compares with
the run's record, `workdir/config.json` (`check_recorded`), but for the knobs
whose `evaluator` policy lets it run its own way. Under parameter
servers only the chief runs mwloop's code: workers and ps tasks serve the
functions the chief traced, so their own config never enters the math (the
chief still checks its config as every run does).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import inspect
import itertools
import json
import os
import platform
import time
from typing import Any

import keras
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
_strategies = itertools.count()  # a key per strategy created in this process (the environment's check)
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    (for the side-car `evaluator`: those it may run its own way, or by a rule `check_recorded` applies), and the
    task's class and source. What comes from the worker's environment is `environment`'s."""
    table = schema.TABLE
    flat = {k: v for k, v in resume_check.flatten(json.loads(config.to_json_best_effort())).items()
            if not (table.policy(k).evaluator is True if evaluator else table.policy(k).per_task)}
    if task is not None:
        flat["task.class"] = type(task).__qualname__
        flat["task.source_sha256"] = _source_digest(type(task))
    return flat


@functools.cache
def _mwloop_source_digest() -> str:
    """sha256 (12 hex digits) of mwloop's own .py files: an editable install keeps its version number while its
    code changes, so two checkouts of one version are told apart by this."""
    digest = hashlib.sha256()
    for directory, folders, names in sorted(os.walk(_PACKAGE)):
        folders.sort()
        for name in sorted(n for n in names if n.endswith(".py")):
            path = os.path.join(directory, name)
            digest.update(os.path.relpath(path, _PACKAGE).encode())
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()[:12]


def environment(strategy: tf.distribute.Strategy) -> dict[str, Any]:
    """What a trainer task's run takes from its machine rather than its config: the cluster its TF_CONFIG (or
    Slurm) describes, the elastic bounds, its local devices, the TensorFlow, Keras, Python and mwloop it runs.
    Two workers told of different clusters, or with another device count, meet in collectives that never match
    (an aborted CollectiveReduceV2, or a hang); other versions may compute or save differently."""
    resolver = getattr(strategy, "cluster_resolver", None)
    try:
        cluster = resolver.cluster_spec().as_dict() if resolver is not None else None
    except (AttributeError, ValueError):
        cluster = None
    if not cluster:
        cluster = (json.loads(os.environ.get("TF_CONFIG", "") or "{}") or {}).get("cluster")
    return {"cluster": cluster,
            "cluster.elastic_workers": os.environ.get("MWLOOP_ELASTIC_WORKERS") or None,
            "local_devices": _local_devices(strategy),
            "versions.tensorflow": tf.__version__,
            "versions.keras": keras.__version__,
            # Python's minor version: a patch release changes nothing a run computes or saves.
            "versions.python": ".".join(platform.python_version_tuple()[:2]),
            "versions.mwloop": _mwloop_version(),
            "mwloop.source_sha256": _mwloop_source_digest()}


def _local_devices(strategy: tf.distribute.Strategy) -> int:
    """The devices this worker's replicas run on (the default strategy has no list: its one device)."""
    try:
        return len(strategy.extended.worker_devices)
    except RuntimeError:
        return 1


def _mwloop_version() -> str | None:
    try:
        return importlib.metadata.version("mwloop")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return None


def differences(mine: dict[str, Any], theirs: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{key: (mine, theirs)} of the settings that differ (a key only one side has counts, as None)."""
    return {key: (mine.get(key), theirs.get(key)) for key in sorted(set(mine) | set(theirs))
            if not resume_check.same(mine.get(key), theirs.get(key))}


def _counts(cluster: dict) -> dict:
    return {k: len(v) if isinstance(v, (list, dict)) else v for k, v in cluster.items()}


def _show(value: Any, other: Any = None) -> str:
    if isinstance(value, dict):
        # The cluster: its tasks' counts say more than a wall of addresses, unless the counts are what agree.
        same_counts = isinstance(other, dict) and _counts(value) == _counts(other)
        return "{" + ", ".join(f"{k}: [{', '.join(map(str, v))}]" if same_counts and isinstance(v, list) else
                               f"{k}: {_counts({k: v})[k]}" for k, v in value.items()) + "}"
    return "(unset)" if value is None else resume_check.show(value)


# What to change, for the keys (whole, or their first part) that do not come from the config: FIX for the others.
ENVIRONMENT_FIXES = {
    "task.source_sha256": "deploy the same code of the task's module on every machine",
    "cluster": "give every task the same cluster in TF_CONFIG (only its task differs)",
    "local_devices": "give every worker as many devices (CUDA_VISIBLE_DEVICES)",
    "versions": "install the same TensorFlow, Keras, Python and mwloop on every machine",
    "mwloop": "install the same TensorFlow, Keras, Python and mwloop on every machine",
}


def describe(who: str, found: dict[str, tuple[Any, Any]], here: str = "here", there: str = "on the chief") -> str:
    """The one line: `worker 1 runs another run than the chief: KEY=MINE here, THEIRS on the chief; FIX`."""
    listed = "; ".join(f"{key}={_show(mine, theirs)} {here}, {_show(theirs, mine)} {there}"
                       for key, (mine, theirs) in found.items())
    fixes = list(dict.fromkeys(ENVIRONMENT_FIXES.get(key, ENVIRONMENT_FIXES.get(key.split(".")[0], FIX))
                               for key in found))
    return f"{who} runs another run than the chief: {listed}; {' and '.join(fixes)}"


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


def _multi_worker(strategy: tf.distribute.Strategy) -> bool:
    return getattr(strategy.extended, "_num_workers", 1) > 1 and context.context().coordination_service is not None


def _agree(strategy: tf.distribute.Strategy, base: str, mine: dict[str, Any], *, chief: bool, timeout_s: float,
           what: str) -> None:
    """The three key-value round trips under `base`: the chief publishes `mine`, every other task publishes its
    verdict, the chief publishes the outcome; UserError with the first differing task's line on every task."""
    started = time.perf_counter()
    me, others = _tasks(strategy)
    if chief:
        context.context().set_config_key_value(f"{base}/chief", json.dumps(mine, sort_keys=True, default=str))
        verdicts = {name: _get(f"{base}/verdict/{name}", f"{name}'s check of the {what}", timeout_s)
                    for name in others}
        outcome = next((line for line in verdicts.values() if line), "")
        context.context().set_config_key_value(f"{base}/outcome", outcome)
    else:
        chiefs = json.loads(_get(f"{base}/chief", f"the chief's {what}", timeout_s))
        found = differences(json.loads(json.dumps(mine, default=str)), chiefs)
        line = describe(me, found) if found else ""
        context.context().set_config_key_value(f"{base}/verdict/{me}", line)
        outcome = line or _get(f"{base}/outcome", f"the chief's verdict on the {what}", timeout_s)
    if outcome:
        raise UserError(outcome)
    logging.info("every task runs the chief's %s (%d keys, checked in %.1f ms)", what, len(mine),
                 (time.perf_counter() - started) * 1000)


def check_environment(strategy: tf.distribute.Strategy, *, chief: bool, timeout_s: float = 300.0) -> None:
    """Every task of a multi-worker strategy calls it once, right after creating the strategy and before its
    first collective: returns when every task's `environment` is the chief's, else raises UserError naming what
    differs on every task (a differing cluster used to abort the first all-reduce with a traceback on all)."""
    if _multi_worker(strategy):
        _agree(strategy, f"{_PREFIX}/environment/{next(_strategies)}", environment(strategy), chief=chief,
               timeout_s=timeout_s, what="environment")


def check_cluster(strategy: tf.distribute.Strategy, config: ml_collections.ConfigDict, task: object | None = None,
                  *, chief: bool, timeout_s: float = 300.0, extra: dict[str, Any] | None = None) -> None:
    """Every task of a multi-worker strategy calls it once per Trainer, before any variable: returns when every
    task runs the chief's settings (`settings`, and `environment` again for a strategy the caller made), else
    raises UserError with `describe`'s line on every task.

    Args:
      strategy: a MultiWorkerMirroredStrategy with its coordination service (any other strategy: nothing to do).
      config, task: this task's run.
      chief: whether this task is the chief (it publishes; the others compare).
      timeout_s: how long one wait for another task may take (0: forever).
      extra: more facts of this task's run that must agree (e.g. whether the Trainer evaluates: --mode=train on
        one task and train_and_eval on another would leave one waiting in the other's eval).
    """
    if _multi_worker(strategy):
        mine = {**settings(config, task), **environment(strategy), **(extra or {})}
        _agree(strategy, f"{_PREFIX}/{next(_generation)}", mine, chief=chief, timeout_s=timeout_s, what="settings")


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
