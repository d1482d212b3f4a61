"""The Trainer: a run driven from Python (`train(until_step)`, `evaluate()`, `export()`), over what
`build_run` built and the `Controller` runs.

`mwloop.main` uses it through `train.train_and_evaluate`; a user script can drive it the same way:

    with mwloop.Trainer(config, workdir, actions=[MyAction(every_secs=30)]) as trainer:
        trainer.train()
        trainer.export()
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Sequence

import ml_collections
import tensorflow as tf
from absl import logging

from mwloop import task as task_lib
from mwloop.artifacts import checkpoint, export, files, resume_check, warm_start
from mwloop.loop import inputs
from mwloop.run import actions as actions_lib
from mwloop.run import state
from mwloop.run.build import Run, build_run
from mwloop.run.context import ActionContext
from mwloop.run.controller import Controller


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
      parts: everything `build_run` built (`mwloop.run.build.Run`).
      restored: the checkpoint restored when entered, if any.

    `evaluate=False` builds no evaluators (--mode=train); `preemption=False` leaves SIGTERM and Ctrl-C alone
    (benchmarks, notebooks): without it they save a checkpoint at one step on every worker and exit.
    """

    def __init__(self, config: ml_collections.ConfigDict, workdir: str, *,
                 strategy: tf.distribute.Strategy | None = None, task: task_lib.Task | None = None,
                 actions: Sequence[actions_lib.Action] = (), evaluate: bool = True, preemption: bool = True):
        self._take(build_run(config, workdir, strategy=strategy, task=task, actions=actions, evaluate=evaluate,
                             preemption_checkpoints=preemption))

    @classmethod
    def of_run(cls, run: Run) -> Trainer:
        """A Trainer over a run `build_run` built (train_and_evaluate builds it from a config checked once)."""
        trainer = cls.__new__(cls)
        trainer._take(run)
        return trainer

    def _take(self, run: Run) -> None:
        self.parts = run
        self.config, self.workdir, self.strategy, self.task = run.config, run.workdir, run.strategy, run.task
        self.state, self.evaluators, self.actions = run.state, run.evaluators, run.actions
        self.checkpointer, self.writer = run.checkpointer, run.writer
        self.metrics: dict[str, dict[str, float]] = {}
        self.restored: str | None = None
        # All an action may touch of this run.
        context = ActionContext(self)
        self.controller = Controller(step=run.state.step, actions=run.actions, schedule=run.schedule,
                                     context=context, hooks=run.hooks, num_workers=run.num_workers)
        for action in run.actions:
            action.check(context)
        self._train_loop = self._train_input = None
        self._workdir_prepared = False
        # metrics.jsonl's events past the restored checkpoint.
        self._dropped_events: list[dict] = []

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Trainer:
        """Locks the workdir (chief), restores the newest checkpoint (or warm-starts)."""
        self.parts.workdir_guard.acquire()
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
        # An asynchronous write that failed.
        except checkpoint.CheckpointError as e:
            failed = e
        if self.parts.chief:
            saved = checkpoint.saved_checkpoints(self.checkpointer.directory)
            # The attempt's `goodput` event, on errors and preemption too.
            self.parts.hooks.closing(self.step)
            self.writer.close("FAILED" if failed and status == "FINISHED" else status,
                              checkpointed_step=files.checkpoint_step(saved[0]) if saved else None)
        self.parts.workdir_guard.release()
        if failed and status == "FINISHED":
            raise failed
        if failed:
            # The run already ends with an error of its own.
            logging.warning("%s", failed)

    @property
    def step(self) -> int:
        return int(self.state.step.numpy())

    @property
    def chief(self) -> bool:
        return self.parts.chief

    @property
    def stop_reason(self) -> str | None:
        """Why training stopped before its last step (an action's request), or None."""
        return self.controller.stop_reason

    @property
    def last_eval_step(self) -> int | None:
        return self.controller.last_eval_step

    @property
    def best_directory(self) -> str:
        return self.parts.best_checkpointer.directory

    @property
    def skipped_updates(self) -> int:
        """Non-finite updates skipped in the current `train` call (config.on_nonfinite="skip")."""
        return self.parts.nonfinite.skipped_updates

    def restore(self, which: str = "latest") -> str | None:
        """Restores the newest checkpoint ("latest") or the best one ("best"); returns its path.

        A fresh run (no checkpoint of its own) with config.init_checkpoint takes the model weights from
        there instead; a run that resumes ignores it.
        """
        source = self.parts.best_checkpointer if which == "best" else self.checkpointer
        # A checkpoint holds a constant learning rate too; a resume that may change it (train.allow_changed)
        # trains with the config's, and otherwise the two are equal.
        own = self._hyperparameters()
        restored = self.restored = source.restore()
        if restored:
            self._assign(own)
            logging.info("%s step %d (%s)", "restored the best checkpoint," if which == "best" else "resumed from",
                         self.step, restored)
            state.check_input_pipelines(self.state, self.task, self.strategy)
        elif which == "best":
            raise checkpoint.CheckpointError(f"no best checkpoint in {self.best_directory}; set "
                                             f"config.best_checkpoint.metric when training")
        elif self.config.init_checkpoint and self.config.init_checkpoint_state == "all":
            self._warm_start_all(self.config.init_checkpoint)
        elif self.config.init_checkpoint:
            warm_start.load(self.state.model, self.checkpointer.checkpoint, self.config.init_checkpoint,
                            self.config.init_checkpoint_include)
        return restored

    def _warm_start_all(self, path: str) -> None:
        """config.init_checkpoint_state="all": every trackable of the state (weights, optimizer slots and
        iterations, EMA, step, the task's own) from another run's checkpoint, so this fresh run continues it. The
        optimizer's hyperparameter variables (a constant learning rate) keep this run's values: a segment of
        population-based training trains on with its perturbed ones."""
        own = self._hyperparameters()
        prefixes = warm_start.candidates(path)
        found = self.checkpointer.restore_from(prefixes)
        if found is None:
            raise checkpoint.CheckpointError(f"config.init_checkpoint: no readable checkpoint in "
                                             f"{', '.join(prefixes)}; give another run's ckpt-N or workdir")
        self._assign(own)
        state.check_input_pipelines(self.state, self.task, self.strategy)
        logging.info("warm start of the whole state from %s: continuing at step %d", found, self.step)

    def _hyperparameters(self) -> list[tuple[tf.Variable, Any]]:
        """The optimizer's variables that hold a configured value, with this run's values."""
        optimizer = getattr(self.state.optimizer, "inner_optimizer", self.state.optimizer)
        return [(v, v.numpy()) for v in _hyperparameter_variables(optimizer)]

    @staticmethod
    def _assign(values: list[tuple[tf.Variable, Any]]) -> None:
        for variable, value in values:
            variable.assign(value)

    # ------------------------------------------------------------------ training
    def train(self, until_step: int | None = None) -> int:
        """Trains from the current step to `until_step` (default: config.train.steps), running the actions
        between loop calls; returns the step reached (earlier if an action stopped training)."""
        # config.train.stop_at_step ends this process early as at the last step; the schedule keeps its length.
        total = min(self.config.train.stop_at_step or self.config.train.steps, self.config.train.steps)
        until = min(until_step or total, total)
        start = self.step
        nothing_to_do = start >= until or self.stop_reason
        # A resume is checked before config.json, the run's record, is rewritten.
        if self.restored and not self._workdir_prepared:
            resume_check.check(self.config, self.workdir, start, self.writer, checkpoint=self.restored)
        if not nothing_to_do:
            # Its checks (data, writable checkpoints) come before anything is written.
            self._build_train_loop()
        if not self._workdir_prepared:
            # Events past the checkpoint (or of a run that died before its first one) describe weights that
            # were never saved: the rerun writes them again.
            self._dropped_events = self.writer.truncate_after(start)
            self.writer.write_config(self.config)
            self._workdir_prepared = True
        if nothing_to_do:
            logging.info("at step %d of %d: nothing to train", start, until)
            return start
        self.parts.hooks.train_started(start, self._dropped_events)
        self._dropped_events = []
        return self.controller.train(self._train_loop, self._train_input, start=start, until=until, total=total,
                                     steps_per_loop=self.config.train.steps_per_loop,
                                     finish=self.wait_for_checkpoints)

    def _build_train_loop(self) -> None:
        if self._train_loop is not None:
            return
        run = self.parts
        inputs.check_train_arrays(self.task)
        if run.chief:
            checkpoint.check_writable(self.checkpointer.directory)
        self._train_input = run.engine.train_input(self.config, self.strategy, self.task, self.state.step)
        self._train_loop = run.engine.make_train_loop(self.config, self.strategy, self.task, self.state.model,
                                                      self.state.optimizer)
        run.hooks.loop_built(self._train_loop)

    def request_stop(self, reason: str) -> None:
        """Ends training after the current step's actions, on every worker (the chief's request decides)."""
        self.controller.request_stop(reason)

    def broadcast_from_chief(self, flag: bool) -> bool:
        """The chief's `flag` on every worker (one small all-reduce across workers; free on one worker)."""
        if self.parts.num_workers == 1:
            return flag
        return bool(self.parts.broadcast([float(flag)])[0])

    # ------------------------------------------------------------------ saving
    def save(self, step: int) -> None:
        """The rotating checkpoint of `step` (every worker); refused if a weight is NaN or Inf. With
        config.train.async_checkpoint it returns while the write goes on (after waiting for the one before)."""
        self.parts.hooks.before_save(step)
        with self.parts.hooks.section("checkpoint"):
            self.checkpointer.save(step)
        self._publish_checkpointed()

    def wait_for_checkpoints(self) -> None:
        """Waits for the checkpoint writes in flight (config.train.async_checkpoint; none otherwise)."""
        with self.parts.hooks.section("checkpoint"):
            self.parts.best_checkpointer.wait()
            self.checkpointer.wait()
        self._publish_checkpointed()

    def _publish_checkpointed(self) -> None:
        # Only a complete checkpoint counts: with asynchronous writes, the previous save's once it ended.
        if (step := self.checkpointer.checkpointed_step) is not None:
            # The sinks may publish the points up to it (mwloop.artifacts.mlflow_sink).
            self.writer.checkpointed(step)

    def save_best(self, step: int) -> None:
        """The best checkpoint, replacing the previous best (every worker)."""
        self.parts.hooks.before_save(step, best=True)
        with self.parts.hooks.section("checkpoint"):
            self.parts.best_checkpointer.save(step)

    # ------------------------------------------------------------------ eval
    def evaluate(self) -> dict[str, dict[str, float]]:
        """Every eval set once on the current weights, and on their EMA too with optimizer.ema (splits
        `<split>_ema`); logged, written (chief) and kept in `metrics`. Every worker calls it."""
        step = self.step
        with self.parts.hooks.section("eval"):
            results = self.parts.evaluation.run(step)
        self.metrics.update(results)
        self.controller.last_eval_step = step
        return results

    def evaluation_on_record(self) -> bool:
        """Whether metrics.jsonl already holds every eval split at the current step (a finished run, rerun:
        `Evaluation.recall`); if so their figures go into `metrics`. Every worker calls it."""
        found = self.parts.evaluation.recall(self.step, self.broadcast_from_chief)
        if found is None:
            return False
        self.metrics.update(found)
        self.controller.last_eval_step = self.step
        return True

    def ema_weights(self) -> contextlib.AbstractContextManager[None]:
        """A context in which the model holds the optimizer's moving averages (swapped in, then back out)."""
        return self.parts.evaluation.ema_weights()

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
        self.parts.workdir_guard.stop_if_lost("exporting")
        timings: dict[str, float] | None = {} if self.config.record_cost else None
        directory = export.export(self.state.model, self.task, directory or os.path.join(self.workdir, "export"),
                                  self.step, keep=self.config.export_keep, timings=timings)
        logging.info("exported a SavedModel of step %d to %s", self.step, directory)
        # What serving it costs: a sweep may trade accuracy against it (export/latency_ms).
        if timings:
            self.writer.write(self.step, "export", timings)
        self.writer.write_export(directory, self.step)
        return directory

    def export_best(self) -> str | None:
        """With config.best_checkpoint.export, the best checkpoint's weights exported to
        workdir/export_best/<its step> (the chief; the model keeps them afterwards: call it last)."""
        if not (self.config.best_checkpoint.export and self.chief and self.config.best_checkpoint.metric):
            return None
        self.parts.workdir_guard.stop_if_lost("exporting")
        directory = export.export_best(self.state.model, self.task, self.workdir, keep=self.config.export_keep)
        if directory:
            self.writer.write_export(directory, int(os.path.basename(directory)))
        return directory


def _hyperparameter_variables(optimizer) -> list[tf.Variable]:
    """The optimizer's variables that hold a configured value rather than training state: a constant learning
    rate (Keras makes it a variable, and a checkpoint holds it)."""
    rate = getattr(optimizer, "_learning_rate", None)
    # A schedule is a function of the iterations, which the checkpoint rightly holds.
    return [rate] if hasattr(rate, "assign") else []
