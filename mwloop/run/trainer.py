"""The Trainer: one run's parts (state, checkpointer, writer, train input, evaluators, actions) and the
loop that drives them: `train(until_step)`, `evaluate()`, `export()`.

`mwloop.main` uses it through `train.train_and_evaluate`; a user script can drive it the same way:

    with mwloop.Trainer(config, workdir, actions=[MyAction(every_secs=30)]) as trainer:
        trainer.train()
        trainer.export()
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Sequence

import keras
import ml_collections
import tensorflow as tf
from absl import logging

from mwloop import task as task_lib
from mwloop.artifacts import checkpoint, export, files, warm_start, workdir_lock
from mwloop.artifacts.resume_check import check as check_resume
from mwloop.artifacts.writers import MetricWriter, make_sinks
from mwloop.cluster import agreement, distribute
from mwloop.config import check as config_check
from mwloop.errors import UserError
from mwloop.loop import engine, inputs, loops
from mwloop.run import actions as actions_lib
from mwloop.run import evaluation, goodput_clock, preemption, schedule, state
from mwloop.run.context import ActionContext


class Trainer:
    """A run in `workdir`: build it, enter it (`with`: lock, restore or warm start), then train, evaluate
    and export; every worker of a cluster makes the same calls.

    Attributes:
      config, workdir, strategy, task: what the run is.
      state: model, optimizer, step (what the checkpoint holds).
      evaluators: split name ("eval", "eval_<set>") -> function evaluating that set once.
      actions: what runs between loop calls, in order (built-in from the config, then the config's
        `actions`, then `actions=`, then preemption).
      metrics: the latest figures by split ("train", "eval", "eval_ema", ...).
      checkpointer, writer: the rotating checkpoints; the chief's metrics.jsonl and TensorBoard.

    `evaluate=False` builds no evaluators (--mode=train); `preemption=False` leaves SIGTERM and Ctrl-C alone
    (benchmarks, notebooks): without it they save a checkpoint at one step on every worker and exit.
    """

    def __init__(self, config: ml_collections.ConfigDict, workdir: str, *,
                 strategy: tf.distribute.Strategy | None = None, task: task_lib.Task | None = None,
                 actions: Sequence[actions_lib.Action] = (), evaluate: bool = True, preemption: bool = True):
        self.config, self.workdir = config, workdir
        config_check.check(config)  # the same one-line errors as the command line, before anything is built
        self.strategy = strategy or distribute.create_strategy(config.distribution)  # first: before any other op
        self.task = task or task_lib.resolve(config.task, config)
        # Before anything is built or checked against the replica count: a task with other settings is named
        # (its own checks would fail alone, or pass and train another run) and nobody trains.
        agreement.check_cluster(self.strategy, config, self.task, chief=distribute.is_chief(self.strategy),
                                timeout_s=config.distribution.get("startup_timeout_s", 300.0),
                                extra={"trainer.evaluate": evaluate})
        self.engine = engine.for_strategy(self.strategy)  # the plain loop, or the parameter servers'
        # first: its message names every count the job may take, not only the current one
        if (counts := distribute.elastic_worker_counts()) is not None:
            config_check.check_worker_counts(config, counts=counts, replicas_per_worker=max(
                1, self.strategy.num_replicas_in_sync // distribute.num_workers(self.strategy)))
        config_check.check_run(config, num_replicas=self.strategy.num_replicas_in_sync,
                               custom_train_step=self.task.overrides("train_step"),
                               parameter_server=self.engine.parameter_servers,
                               num_workers=distribute.num_workers(self.strategy))
        if config.deterministic:
            tf.config.experimental.enable_op_determinism()
        keras.utils.set_random_seed(config.seed)  # the initial weights
        self.chief = distribute.is_chief(self.strategy)
        self.state = state.create(config, self.strategy, self.task)
        self._weights_finite: tf.types.experimental.PolymorphicFunction | None = None  # made at the first save
        self.evaluators = state.make_evaluators(config, self.engine.eval_strategy, self.task, self.state.model) \
            if evaluate else {}
        self.actions = [*actions_lib.built_in(config, evaluate=bool(self.evaluators)),
                        *actions_lib.from_config(config), *actions,
                        *([actions_lib.Preempted(self._preemption_watcher)] if preemption else [])]
        self.num_workers = distribute.num_workers(self.strategy)
        self.schedule = schedule.Schedule(self.actions, chief=self.chief, num_workers=self.num_workers,
                                          broadcast=self._broadcast)
        trackables = self.state.trackables()
        action_items = {}
        for action in self.actions:  # named by class (not position: adding an action keeps the others' state)
            for name, variable in action.checkpoint_items().items():
                key = f"{type(action).__name__}_{name}"
                if key in action_items:
                    raise UserError(f"two {type(action).__name__} actions keep checkpoint state; use one")
                action_items[key] = variable
        if action_items:
            trackables["actions"] = tf.train.Checkpoint(**action_items)
        async_writes = bool(config.train.get("async_checkpoint", False))
        self.checkpointer = checkpoint.Checkpointer(self.strategy, workdir, chief=self.chief,
                                                    max_to_keep=config.train.max_to_keep,
                                                    async_writes=async_writes, **trackables)
        self.best_directory = os.path.join(workdir, "best_checkpoint")
        self._best = checkpoint.Checkpointer(self.strategy, workdir, chief=self.chief, max_to_keep=1,
                                             subdir="best_checkpoint", async_writes=async_writes,
                                             **trackables)
        # The workdir is the run's truth: every save (and metrics.jsonl line) first checks it is still this run's.
        broadcast = self._broadcast if self.num_workers > 1 and not self.engine.parameter_servers else None
        for checkpointer in (self.checkpointer, self._best):
            checkpointer.own(self._lost, broadcast, config.to_json_best_effort(indent=2, sort_keys=True) + "\n")
        if self.chief:
            workdir_lock.make(workdir)  # a file in the way is a one-line error, before the writer needs it
        self.writer = MetricWriter(workdir, enabled=self.chief, sinks=make_sinks(config, workdir, enabled=self.chief))
        self.writer.guard = self._lost
        self.goodput = goodput_clock.GoodputClock(self.writer)  # where this process's time goes (the chief records)
        self.evaluation = evaluation.Evaluation(self.evaluators, self.writer, self.state.optimizer,
                                                ema=config.optimizer.ema)
        self.context = ActionContext(self)  # all an action may touch of this run
        for action in self.actions:
            action.check(self.context)
        self.metrics: dict[str, dict[str, float]] = {}
        self.last_eval_step: int | None = None
        self.stop_reason: str | None = None
        self._lock = None
        self.restored: str | None = None  # the checkpoint restored, if any
        self._train_loop = self._train_input = None
        self._workdir_prepared = False
        self.skipped_updates = 0  # non-finite updates skipped in this train() call
        self._observers = [a for a in self.actions if type(a).observe is not actions_lib.Action.observe]
        self._running: actions_lib.Action | None = None

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Trainer:
        """Locks the workdir (chief), restores the newest checkpoint (or warm-starts)."""
        if self.chief:
            self._lock = workdir_lock.acquire(self.workdir)
        try:
            self.restore()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close("FINISHED" if exc_type is None else
                   "KILLED" if issubclass(exc_type, (SystemExit, KeyboardInterrupt)) else "FAILED")

    def close(self, status: str = "FINISHED") -> None:
        """Waits for a checkpoint write in flight, ends the writer (its sinks get `status`: FINISHED, FAILED,
        KILLED) and releases the workdir."""
        failed = None
        try:
            self.wait_for_checkpoints()
        except checkpoint.CheckpointError as e:  # an asynchronous write that failed
            failed = e
        self._release("FAILED" if failed and status == "FINISHED" else status)
        if failed and status == "FINISHED":
            raise failed
        if failed:
            logging.warning("%s", failed)  # the run already ends with an error of its own

    def _release(self, status: str) -> None:
        if self.chief:
            saved = checkpoint.saved_checkpoints(self.checkpointer.directory)
            self.goodput.close(self.step)  # the attempt's `goodput` event, on errors and preemption too
            self.writer.close(status, durable_step=files.checkpoint_step(saved[0]) if saved else None)
        if self._lock:
            self._lock.close()
            self._lock = None

    @property
    def step(self) -> int:
        return int(self.state.step.numpy())

    def restore(self, which: str = "latest") -> str | None:
        """Restores the newest checkpoint ("latest") or the best one ("best"); returns its path.

        A fresh run (no checkpoint of its own) with config.init_checkpoint takes the model weights from
        there instead; a run that resumes ignores it.
        """
        source = self._best if which == "best" else self.checkpointer
        restored = self.restored = source.restore()
        if restored:
            logging.info("%s step %d (%s)", "restored the best checkpoint," if which == "best" else "resumed from",
                         self.step, restored)
            state.check_input_pipelines(self.state, self.task, self.strategy)
        elif which == "best":
            raise checkpoint.CheckpointError(f"no best checkpoint in {self.best_directory}; set "
                                             f"config.best_checkpoint.metric when training")
        elif self.config.get("init_checkpoint"):
            warm_start.load(self.state.model, self.checkpointer.checkpoint, self.config.init_checkpoint,
                            self.config.init_checkpoint_include)
        return restored

    # ------------------------------------------------------------------ training
    def train(self, until_step: int | None = None) -> int:
        """Trains from the current step to `until_step` (default: config.train.steps), running the actions
        between loop calls; returns the step reached (earlier if an action stopped training)."""
        total = self.config.train.steps
        until = min(until_step or total, total)
        start = self.step
        nothing_to_do = start >= until or self.stop_reason
        if self.restored and not self._workdir_prepared:  # before config.json, the run's record, is rewritten
            check_resume(self.config, self.workdir, start, self.writer, checkpoint=self.restored)
        if not nothing_to_do:
            self._build_train_loop()  # its checks (data, writable checkpoints) come before anything is written
        if not self._workdir_prepared:
            # Events past the checkpoint (or of a run that died before its first one) describe weights that
            # were never saved: the rerun writes them again.
            self.goodput.dropping(self.writer.truncate_after(start), start)  # their time was lost to a crash
            self.writer.write_config(self.config)
            self._workdir_prepared = True
        if nothing_to_do:
            logging.info("at step %d of %d: nothing to train", start, until)
            return start
        self.goodput.started_training(start)
        for action in self.actions:
            action.start(self.context, start)
        try:
            step = self._run(start, until, total)
            self.wait_for_checkpoints()  # the end of training: what follows (export, summary) reads them
            return step
        finally:
            for action in self.actions:
                action.end(self.context)

    def _build_train_loop(self) -> None:
        if self._train_loop is not None:
            return
        inputs.check_train_arrays(self.task)
        if self.chief:
            checkpoint.check_writable(self.checkpointer.directory)
        self._train_input = self.engine.train_input(self.config, self.strategy, self.task, self.state.step)
        self._train_loop = self.engine.make_train_loop(self.config, self.strategy, self.task, self.state.model,
                                                       self.state.optimizer)
        self.goodput.tracing_count = getattr(self._train_loop, "tracing_count", None)

    def _run(self, step: int, until: int, total: int) -> int:
        steps_per_loop, skip_nonfinite = self.config.train.steps_per_loop, self.config.on_nonfinite == "skip"
        self.skipped_updates = 0
        while step < until:
            stop = self.schedule.call_end(step, until, steps_per_loop)
            started = self.goodput.calling = time.perf_counter()  # a call that never returns: waiting for a peer
            sums, status = self._train_loop(self._train_input, tf.constant(stop - step))
            seconds = time.perf_counter() - started  # the call returns floats: its work is done
            self.goodput.loop_call(started, seconds, stop - step)
            bad_step = loops.first_nonfinite_step(status, step)
            if bad_step is not None and not skip_nonfinite:
                raise FloatingPointError(loops.nonfinite_message(bad_step, sums, self.engine.nonfinite_fix))
            if bad_step is not None:
                self.skipped_updates += round(status["skipped"])
                logging.warning("skipped %d non-finite update(s) from step %d (%d so far)",
                                round(status["skipped"]), bad_step, self.skipped_updates)
            step = stop
            self.state.step.assign(step, read_value=False)  # no read back: ~10 us a call
            for action in self._observers:
                action.observe(self.context, step, sums, seconds)
            if self._run_actions(step, final=step == total):
                break
        logging.info("training %s at step %d", "stopped" if self.stop_reason else "done", step)
        return step

    def _run_actions(self, step: int, final: bool) -> bool:
        """The actions due at `step` (`schedule.Schedule.run`); whether training stops here."""
        stopping = self.schedule.run(step, final=final, call=lambda action: self._call(action, step),
                                     last_eval_step=lambda: self.last_eval_step,
                                     stop_reason=lambda: self.stop_reason)
        if not stopping:
            self.stop_reason = None  # a worker's own request counts only if the chief agreed
            return False
        self.stop_reason = self.stop_reason or "the chief stopped training"
        if not final:
            self.writer.write_event(step, "stop", {"reason": self.stop_reason})
            logging.info("stopping at step %d: %s", step, self.stop_reason)
        return True

    def _call(self, action: actions_lib.Action, step: int) -> None:
        self._running = action
        try:
            action(self.context, step)
        finally:
            self._running = None

    def request_stop(self, reason: str) -> None:
        """Ends training after the current step's actions, on every worker (the chief's request decides).
        An action that calls it declares `may_stop = True`, so that every worker knows when to agree."""
        if self._running is not None and not self._running.may_stop and self.num_workers > 1:
            raise UserError(f"{type(self._running).__name__} asked to stop training but does not declare "
                            f"may_stop = True; add it, so that every worker agrees on the stop")
        self.stop_reason = self.stop_reason or reason

    def broadcast_from_chief(self, flag: bool) -> bool:
        """The chief's `flag` on every worker (one small all-reduce across workers; free on one worker)."""
        if self.num_workers == 1:
            return flag
        return bool(self._broadcast([float(flag)])[0])

    def _preemption_watcher(self) -> preemption.PreemptionWatcher:
        return preemption.PreemptionWatcher(self.strategy, self.checkpointer)

    def _lost(self) -> str | None:
        return workdir_lock.lost(self.workdir, self._lock)

    def _broadcast(self, values: list[float]) -> list[bool]:
        return distribute.broadcast_from_chief(self.strategy, values)

    # ------------------------------------------------------------------ saving
    def save(self, step: int) -> None:
        """The rotating checkpoint of `step` (every worker); refused if a weight is NaN or Inf. With
        config.train.async_checkpoint it returns while the write goes on (after waiting for the one before)."""
        # The clock record a killed attempt's goodput is read back from goes first: once an asynchronous write
        # started, TensorFlow's writing thread holds the GIL in 5 ms slices, and this small append took 5-16 ms.
        self.goodput.saved(step)
        with self.goodput.timing("checkpoint"):
            self._check_finite(step)
            self.checkpointer.save(step)
        self._tell_durable()

    def wait_for_checkpoints(self) -> None:
        """Waits for the checkpoint writes in flight (config.train.async_checkpoint; none otherwise)."""
        with self.goodput.timing("checkpoint"):
            self._best.wait()
            self.checkpointer.wait()
        self._tell_durable()

    def _tell_durable(self) -> None:
        # Only a complete checkpoint counts: with asynchronous writes, the previous save's once it ended.
        durable = self.checkpointer.durable_step
        if durable is not None:
            self.writer.durable(durable)  # the sinks may publish the points up to it (mwloop.artifacts.mlflow_sink)

    def save_best(self, step: int) -> None:
        """The best checkpoint, replacing the previous best (every worker)."""
        with self.goodput.timing("checkpoint"):
            self._check_finite(step)
            self._best.save(step)

    def _check_finite(self, step: int) -> None:
        # Such a checkpoint would poison every resume. One traced call over every weight: checked one eager op
        # at a time it took 42 ms per save of ResNet-50, 80 % of what an asynchronous save blocked.
        if self._weights_finite is None:
            weights = list(self.state.model.weights)
            self._weights_finite = tf.function(
                lambda: tf.reduce_all([tf.reduce_all(tf.math.is_finite(v)) for v in weights]), autograph=False)
        if not bool(self._weights_finite()):
            raise FloatingPointError(f"weights are not finite at step {step}; not saving a checkpoint. "
                                     f"Lower the learning rate and resume from the last checkpoint")

    # ------------------------------------------------------------------ eval
    def evaluate(self) -> dict[str, dict[str, float]]:
        """Every eval set once on the current weights, and on their EMA too with optimizer.ema (splits
        `<split>_ema`); logged, written (chief) and kept in `metrics`. Every worker calls it."""
        step = self.step
        with self.goodput.timing("eval"):
            results = self.evaluation.run(step)
        self.metrics.update(results)
        self.last_eval_step = step
        return results

    def recall_evaluation(self) -> bool:
        """Whether metrics.jsonl already holds every eval split at the current step (a finished run, rerun:
        `Evaluation.recall`); if so their figures go into `metrics`. Every worker calls it."""
        found = self.evaluation.recall(self.step, self.broadcast_from_chief)
        if found is None:
            return False
        self.metrics.update(found)
        self.last_eval_step = self.step
        return True

    def ema_weights(self) -> contextlib.AbstractContextManager[None]:
        """A context in which the model holds the optimizer's moving averages (swapped in, then back out)."""
        return self.evaluation.ema_weights()

    def finalize_ema(self) -> None:
        """With optimizer.ema, the model's weights become their moving average (for the export)."""
        if self.config.optimizer.ema:
            self.state.optimizer.finalize_variable_values(self.state.model.trainable_variables)

    # ------------------------------------------------------------------ export
    def export(self, directory: str | None = None) -> str | None:
        """A SavedModel of the current weights (the task's serving endpoints) as version `<step>` of `directory`
        (default workdir/export: TF Serving's layout, the last config.export_keep versions kept), written by
        the chief; returns the version's directory, None on other workers or with config.export=False."""
        if not (self.config.export and self.chief):
            return None
        workdir_lock.stop_if_lost(self.workdir, self._lock, "exporting")
        directory = export.export(self.state.model, self.task, directory or os.path.join(self.workdir, "export"),
                                  self.step, keep=self.config.export_keep)
        logging.info("exported a SavedModel of step %d to %s", self.step, directory)
        self.writer.write_export(directory, self.step)
        return directory

    def export_best(self) -> str | None:
        """With config.best_checkpoint.export, the best checkpoint's weights exported to
        workdir/export_best/<its step> (the chief; the model keeps them afterwards: call it last)."""
        if not (self.config.best_checkpoint.export and self.chief and self.config.best_checkpoint.metric):
            return None
        workdir_lock.stop_if_lost(self.workdir, self._lock, "exporting")
        directory = export.export_best(self.state.model, self.task, self.workdir, keep=self.config.export_keep)
        if directory:
            self.writer.write_export(directory, int(os.path.basename(directory)))
        return directory

