"""build_run: a run's config checked once, then every part of the run built from it, policies registered.

What it builds (a `Run`): the strategy (first, before any other op), the task, the state a checkpoint holds,
the evaluators, the actions (built-in, the config's, the caller's, preemption) and their schedule, the
checkpointers, the metrics writer, the workdir's guard, and the hooks around loop calls and saves (the goodput
clock, the non-finite guard). The controller (`mwloop.run.controller`) and the Trainer only run what is
built here: no policy is decided anywhere else.

Order matters, and is the one place it is written down:
  1. the config's own rules (`config.check`), before the strategy: a bad distribution setting is one line;
  2. the strategy, before any other TensorFlow op;
  3. the cluster's agreement (every task runs the chief's settings), before anything is built: a task with
     other settings is named and nobody trains;
  4. the rules that need the strategy and the task (batch divides among replicas, elastic counts, ...);
  5. state (eagerly, on every worker), evaluators (their traces surface eval mistakes before any update),
     actions, checkpointers, writer, hooks.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import keras
import ml_collections
import tensorflow as tf

from mwloop import task as task_lib
from mwloop.artifacts import checkpoint, workdir_lock
from mwloop.artifacts.writers import MetricWriter, make_sinks
from mwloop.cluster import agreement, distribute
from mwloop.config import check as config_check
from mwloop.config import schema
from mwloop.errors import UserError
from mwloop.loop import engine as engine_lib
from mwloop.loop import inputs
from mwloop.run import actions as actions_lib
from mwloop.run import cost, evaluation, goodput_clock, hooks, nonfinite, preemption, schedule, state

Broadcast = Callable[[list[float]], list[bool]]


@dataclasses.dataclass
class Run:
    """A built run: what it is, its parts, and the policies around them.

    Attributes:
      config, workdir, strategy, task: what the run is.
      engine: how it trains on its strategy (the plain loop or the parameter servers').
      chief, num_workers: whether this process writes the run's files; how many run it in step.
      state: model, optimizer, step (what the checkpoint holds).
      evaluators: split name ("eval", "eval_<set>") -> function evaluating that set once; empty without eval.
      evaluation: the evaluators with their writer and EMA swap.
      actions, schedule: what runs between loop calls, in order, and when each is due.
      checkpointer, best_checkpointer: the rotating checkpoints; the best eval's (workdir/best_checkpoint).
      writer: the chief's metrics.jsonl, TensorBoard and MLflow.
      workdir_guard: the chief's hold on the workdir, asked before every write.
      goodput: the goodput clock (one of `hooks`; the end-of-run summary reads its report).
      nonfinite: the non-finite guard (one of `hooks`; it counts skipped updates).
      hooks: the policies told of every loop call, save and timed section.
      broadcast: the chief's values on every worker (a collective across workers; the identity on one).
    """
    config: ml_collections.ConfigDict
    workdir: str
    strategy: tf.distribute.Strategy
    task: task_lib.Task
    engine: engine_lib.Engine
    chief: bool
    num_workers: int
    state: state.State
    evaluators: dict[str, evaluation.Evaluator]
    evaluation: evaluation.Evaluation
    actions: list[actions_lib.Action]
    schedule: schedule.Schedule
    checkpointer: checkpoint.Checkpointer
    best_checkpointer: checkpoint.Checkpointer
    writer: MetricWriter
    workdir_guard: workdir_lock.WorkdirGuard
    goodput: goodput_clock.GoodputClock
    nonfinite: nonfinite.NonfiniteGuard
    hooks: hooks.Hooks
    broadcast: Broadcast


def build_run(config: ml_collections.ConfigDict, workdir: str, *, strategy: tf.distribute.Strategy | None = None,
              task: task_lib.Task | None = None, actions: Sequence[actions_lib.Action] = (), evaluate: bool = True,
              preemption_checkpoints: bool = True, checked: bool = False) -> Run:
    """Checks `config` once and builds every part of its run in `workdir` (every worker calls it alike).

    Args:
      config: the run's config.
      workdir: the run's directory.
      strategy: the strategy to use (default: the config's, `distribute.create_strategy`).
      task: the task (default: `config.task` resolved).
      actions: the caller's own actions, after the built-in and the config's.
      evaluate: build the evaluators (False: --mode=train, or an evaluator task evaluates).
      preemption_checkpoints: SIGTERM and Ctrl-C save a checkpoint at one step on every worker and exit
        (False leaves the signals alone: benchmarks, notebooks).
      checked: `config` already passed the edge: `config.check`, then `schema.TABLE.complete`
        (`train.run_checked`).
    Returns:
      The built run.
    Raises:
      UserError: a setting that cannot work, in one line, before anything trains.
    """
    if not checked:
        config_check.check(config)
        # Every knob present: no layer below repeats a default.
        config = schema.TABLE.complete(config)
    if strategy is None and task is None:
        task = check_elastic_data_early(config)
    strategy = strategy or distribute.create_strategy(config.distribution)
    task = task or task_lib.resolve(config.task, config)
    chief, num_workers = distribute.is_chief(strategy), distribute.num_workers(strategy)
    engine = engine_lib.for_strategy(strategy)
    agreement.check_cluster(strategy, config, task, chief=chief, timeout_s=config.distribution.startup_timeout_s,
                            extra={"trainer.evaluate": evaluate})
    _check_with_strategy(config, strategy, task, engine, num_workers)
    if config.deterministic:
        tf.config.experimental.enable_op_determinism()
    # Seeds the initial weights.
    keras.utils.set_random_seed(config.seed)
    run_state = state.create(config, strategy, task)
    evaluators = state.make_evaluators(config, engine.eval_strategy, task, run_state.model) if evaluate else {}
    run_actions = [*actions_lib.built_in(config, evaluate=bool(evaluators)), *actions_lib.from_config(config),
                   *actions]

    def broadcast(values: list[float]) -> list[bool]:
        return distribute.broadcast_from_chief(strategy, values)

    guard = workdir_lock.WorkdirGuard(workdir, chief=chief)
    checkpointers = _checkpointers(config, workdir, strategy, chief, run_state, run_actions, guard.why_lost,
                                   broadcast if num_workers > 1 and not engine.parameter_servers else None)
    if preemption_checkpoints:
        run_actions.append(actions_lib.Preempted(lambda: preemption.PreemptionWatcher(strategy, checkpointers[0])))
    writer = MetricWriter(workdir, enabled=chief, sinks=make_sinks(config, workdir, enabled=chief),
                          why_lost=guard.why_lost)
    # Where this process's time goes (the chief records it).
    clock = goodput_clock.GoodputClock(writer)
    guard_nonfinite = nonfinite.NonfiniteGuard(run_state.model, skip=config.on_nonfinite == "skip",
                                               fix=engine.nonfinite_fix)
    return Run(config=config, workdir=workdir, strategy=strategy, task=task, engine=engine, chief=chief,
               num_workers=num_workers, state=run_state, evaluators=evaluators,
               evaluation=evaluation.Evaluation(evaluators, writer, run_state.optimizer, ema=config.optimizer.ema,
                                                skip_bad_records=config.dataset.skip_bad_records),
               actions=run_actions,
               schedule=schedule.Schedule(run_actions, chief=chief, num_workers=num_workers, broadcast=broadcast),
               checkpointer=checkpointers[0], best_checkpointer=checkpointers[1], writer=writer,
               workdir_guard=guard, goodput=clock, nonfinite=guard_nonfinite,
               hooks=hooks.Hooks([clock, guard_nonfinite,
                                  *([cost.CostRecorder(writer, run_state.model)] if config.record_cost else [])]),
               broadcast=broadcast)


def _check_with_strategy(config: ml_collections.ConfigDict, strategy: tf.distribute.Strategy, task: task_lib.Task,
                         engine: engine_lib.Engine, num_workers: int) -> None:
    """The rules that need the strategy and the task: the batch divides among the replicas (of every worker
    count an elastic job may take: that message names them all, so it comes first), the step's options."""
    if (counts := distribute.elastic_worker_counts()) is not None:
        config_check.check_worker_counts(config, counts=counts, replicas_per_worker=max(
            1, strategy.num_replicas_in_sync // num_workers))
        _check_elastic_data(task, counts)
    config_check.check_run(config, num_replicas=strategy.num_replicas_in_sync,
                           custom_train_step=task.overrides("train_step"), parameter_server=engine.parameter_servers,
                           num_workers=num_workers)


def check_elastic_data_early(config: ml_collections.ConfigDict) -> task_lib.Task | None:
    """In an elastic job (--num_workers=MIN:MAX, MIN < MAX), the task resolved and its data checked before the
    strategy: a task whose own train_dataset cannot keep its order across worker counts is one line before any
    collective exists (no cluster to form, nothing to tear down: mwloop.main then exits without TensorFlow's
    teardown, BENCHMARKS.md "Refused early").

    Call it before the strategy exists, and pass the task it returns on (`build_run(task=...)`): the task is
    resolved once. Outside an elastic job it does nothing (the task is resolved after the strategy, as always).

    Returns:
      The resolved task in an elastic job, else None.
    Raises:
      TaskError: the task's data reads other examples per step at another worker count; or its data made a
        TensorFlow op before the strategy, which a multi-worker strategy cannot start after.
    """
    counts = distribute.elastic_worker_counts()
    if counts is None or len(counts) < 2:
        return None
    started = distribute.eager_context_started()
    task = task_lib.resolve(config.task, config)
    _check_elastic_data(task, counts)
    if not started and distribute.eager_context_started():
        # A multi-worker strategy configures TensorFlow's runtime: it cannot start once an op has run.
        raise task_lib.TaskError(
            f"{type(task).__name__} ran a TensorFlow op when it was made or asked for train_arrays()/"
            f"train_records(), before the strategy exists, which an elastic job needs; return numpy arrays "
            f"(or mwloop.open_dataset) there and build TensorFlow objects in build_model or train_dataset")
    return task


def _check_elastic_data(task: task_lib.Task, counts: range) -> None:
    """An elastic job re-forms with other worker counts: its data must read the same examples per step at every
    count, or the job would end at its first re-form (the resume check refuses it). Refused now, at the start."""
    if len(counts) > 1 and not inputs.keeps_order_across_worker_counts(task):
        raise task_lib.TaskError(
            f"an elastic job (--num_workers={counts.start}:{counts.stop - 1}) needs data that reads the same examples "
            f"at every worker count, and {type(task).__name__}.train_dataset shards its own way; give the task "
            f"train_records() (mwloop.open_dataset of a dataset written by python -m mwloop.data.convert) or "
            f"train_arrays(), or run a fixed --num_workers")


def _checkpointers(config: ml_collections.ConfigDict, workdir: str, strategy: tf.distribute.Strategy, chief: bool,
                   run_state: state.State, run_actions: Sequence[actions_lib.Action],
                   why_lost: Callable[[], str | None], broadcast: Broadcast | None
                   ) -> tuple[checkpoint.Checkpointer, checkpoint.Checkpointer]:
    """The rotating checkpointer and the best one, of the state and the actions' own checkpoint items. Every
    save first asks whether the workdir is still the run's (the chief's answer broadcast to every worker)."""
    trackables = run_state.trackables()
    action_items = {}
    # Named by class, not position: adding an action keeps the others' state.
    for action in run_actions:
        for name, variable in action.checkpoint_items().items():
            key = f"{type(action).__name__}_{name}"
            if key in action_items:
                raise UserError(f"two {type(action).__name__} actions keep checkpoint state; use one")
            action_items[key] = variable
    if action_items:
        trackables["actions"] = tf.train.Checkpoint(**action_items)
    common = dict(chief=chief, async_writes=config.train.async_checkpoint, why_lost=why_lost, broadcast=broadcast,
                  config_record=config.to_json_best_effort(indent=2, sort_keys=True) + "\n")
    return (checkpoint.Checkpointer(strategy, workdir, max_to_keep=config.train.max_to_keep, **common, **trackables),
            checkpoint.Checkpointer(strategy, workdir, max_to_keep=1, subdir="best_checkpoint", **common,
                                    **trackables))
