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
from typing import Iterator, Sequence

import keras
import ml_collections
import tensorflow as tf
from absl import logging

from mwloop import actions as actions_lib
from mwloop import checkpoint, distribute, export, inputs, loop, optim, ps, state, steps, warm_start, workdir_lock
from mwloop import task as task_lib
from mwloop.errors import UserError
from mwloop.resume_check import check as check_resume
from mwloop.writers import MetricWriter, format_metrics

SUM = tf.distribute.ReduceOp.SUM


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
        self.strategy = strategy or distribute.create_strategy(config.distribution)  # first: before any other op
        self.task = task or task_lib.resolve(config.task, config)
        if config.deterministic:
            tf.config.experimental.enable_op_determinism()
        keras.utils.set_random_seed(config.seed)  # the initial weights
        self.chief = distribute.is_chief(self.strategy)
        self.state = state.create(config, self.strategy, self.task)
        # Under parameter servers the chief evaluates by itself: the model called on the chief (reading the
        # ps variables) over an undistributed eval set.
        eval_strategy = tf.distribute.get_strategy() if distribute.is_parameter_server(self.strategy) \
            else self.strategy
        self.evaluators = state.make_evaluators(config, eval_strategy, self.task, self.state.model) if evaluate \
            else {}
        self.actions = [*actions_lib.built_in(config, evaluate=bool(self.evaluators)),
                        *actions_lib.from_config(config), *actions, *([actions_lib.Preempted()] if preemption else [])]
        for action in self.actions:
            action.check(self)
        self.num_workers = distribute.num_workers(self.strategy)
        # Time-based actions whose running (or stopping) every worker must agree on: at each call's end, one
        # small all-reduce broadcasts the chief's clock for them (multi-worker runs that have any).
        self._shared_timed = [a for a in self.actions if a.every_secs > 0 and (a.all_workers or a.may_stop)] \
            if self.num_workers > 1 else []
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
        self.checkpointer = checkpoint.Checkpointer(self.strategy, workdir, max_to_keep=config.train.max_to_keep,
                                                    **trackables)
        self.best_directory = os.path.join(workdir, "best_checkpoint")
        self._best = checkpoint.Checkpointer(self.strategy, workdir, max_to_keep=1, subdir="best_checkpoint",
                                             **trackables)
        if self.chief:
            workdir_lock.make(workdir)  # a file in the way is a one-line error, before the writer needs it
        self.writer = MetricWriter(workdir, enabled=self.chief)
        self.metrics: dict[str, dict[str, float]] = {}
        self.last_eval_step: int | None = None
        self.stop_reason: str | None = None
        self._lock = None
        self.restored: str | None = None  # the checkpoint restored, if any
        self._train_loop = self._train_input = None
        self._workdir_prepared = False
        self._window: dict[str, float] = {}  # summed sums of the steps since the last log
        self._skipped = 0  # non-finite updates skipped in this train() call
        self._window_start = self._started_at = 0
        self._window_time = self._started_time = 0.0
        self._ema_swap = None
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

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.writer.close()
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
            check_resume(self.config, self.workdir, start, self.writer)
        if not nothing_to_do:
            self._build_train_loop()  # its checks (data, writable checkpoints) come before anything is written
        if not self._workdir_prepared:
            # Events past the checkpoint (or of a run that died before its first one) describe weights that
            # were never saved: the rerun writes them again.
            self.writer.truncate_after(start)
            self.writer.write_config(self.config)
            self._workdir_prepared = True
        if nothing_to_do:
            logging.info("at step %d of %d: nothing to train", start, until)
            return start
        for action in self.actions:
            action.start(self, start)
        try:
            return self._run(start, until, total)
        finally:
            for action in self.actions:
                action.end(self)

    def _build_train_loop(self) -> None:
        if self._train_loop is not None:
            return
        inputs.check_train_arrays(self.task)
        if self.chief:
            checkpoint.check_writable(self.checkpointer.directory)
        if distribute.is_parameter_server(self.strategy):
            self._train_input = ps.train_input(self.config, self.strategy, self.task)
            self._train_loop = ps.make_train_loop(
                self.strategy, self.task, self.state.model, self.state.optimizer,
                global_batch_size=self.config.train.global_batch_size, jit_compile=self.config.jit_compile)
            return
        self._train_input = inputs.train_input(self.config, self.strategy, self.task, self.state.step)
        self._train_loop = loop.make_train_loop(
            self.strategy, self.task, self.state.model, self.state.optimizer,
            global_batch_size=self.config.train.global_batch_size,
            skip_nonfinite=self.config.on_nonfinite == "skip", jit_compile=self.config.jit_compile)

    def _run(self, step: int, until: int, total: int) -> int:
        steps_per_loop, skip_nonfinite = self.config.train.steps_per_loop, self.config.on_nonfinite == "skip"
        stepped = [a for a in self.actions if a.every_steps or a.at_steps]
        self._started_at = self._window_start = step
        self._started_time = self._window_time = time.perf_counter()
        self._window, self._skipped = {}, 0
        while step < until:
            stop = min([step + steps_per_loop, until] + [s for a in stepped if (s := a.next_step(step))])
            sums, status = self._train_loop(self._train_input, tf.constant(stop - step))
            bad_step = loop.first_nonfinite_step(status, step)
            if bad_step is not None and not skip_nonfinite:
                skip = "" if distribute.is_parameter_server(self.strategy) else (
                    ", or set config.on_nonfinite='skip' to skip such updates")  # not with parameter servers
                raise FloatingPointError(f"non-finite loss at step {bad_step}; lower the learning rate{skip}")
            if bad_step is not None:
                self._skipped += round(status["skipped"])
                logging.warning("skipped %d non-finite update(s) from step %d (%d so far)",
                                round(status["skipped"]), bad_step, self._skipped)
            for k, v in sums.items():
                self._window[k] = self._window.get(k, 0.0) + v
            step = stop
            self.state.step.assign(step, read_value=False)  # no read back: ~10 us a call
            self._run_actions(step, final=step == total)
            if self.stop_reason:
                break
            if not self._window:  # a new log window: its speed excludes the periodic work above
                self._window_time = time.perf_counter()
        logging.info("training %s at step %d", "stopped" if self.stop_reason else "done", step)
        return step

    def _run_actions(self, step: int, final: bool) -> None:
        """The actions due at `step`, in order; then, if one asked to stop, the `at_end` ones (every worker)."""
        now = time.monotonic()
        timed = [a for a in self.actions if a.due_by_time(now)]
        if self._shared_timed:  # the chief's clock decides for every worker, at every call (a common point)
            agreed = self._broadcast([float(a in timed) for a in self._shared_timed])
            timed = [a for a in timed if a not in self._shared_timed] + [
                a for a, yes in zip(self._shared_timed, agreed) if yes]
        ran, may_stop = [], False
        for action in self.actions:
            due = (action.every_call or action.due_by_steps(step) or (final and action.at_end) or action in timed
                   or (action.after_eval and self.last_eval_step == step))
            may_stop |= due and action.may_stop  # known alike on every worker: so is the agreement below
            if due and (action.all_workers or self.chief):
                self._call(action, step, ran, now)
        if may_stop and self.num_workers > 1:
            self._agree_on_stop()
        if self.stop_reason and not final:
            for action in self.actions:  # the end of the run, as at its last step: log, final save
                if action.at_end and action not in ran and (action.all_workers or self.chief):
                    self._call(action, step, ran, now)
            self.writer.write_event(step, "stop", {"reason": self.stop_reason})
            logging.info("stopping at step %d: %s", step, self.stop_reason)

    def _call(self, action: actions_lib.Action, step: int, ran: list, now: float) -> None:
        self._running = action
        try:
            action(self, step)
        finally:
            self._running = None
        action.last_time = now
        ran.append(action)

    def request_stop(self, reason: str) -> None:
        """Ends training after the current step's actions, on every worker (the chief's request decides).
        An action that calls it declares `may_stop = True`, so that every worker knows when to agree."""
        if self._running is not None and not self._running.may_stop and self.num_workers > 1:
            raise UserError(f"{type(self._running).__name__} asked to stop training but does not declare "
                            f"may_stop = True; add it, so that every worker agrees on the stop")
        self.stop_reason = self.stop_reason or reason

    def _agree_on_stop(self) -> None:
        if self.broadcast_from_chief(self.stop_reason is not None):
            self.stop_reason = self.stop_reason or "the chief stopped training"
        else:
            self.stop_reason = None

    def broadcast_from_chief(self, flag: bool) -> bool:
        """The chief's `flag` on every worker (one small all-reduce across workers; free on one worker)."""
        if self.num_workers == 1:
            return flag
        return bool(self._broadcast([float(flag)])[0])

    def _broadcast(self, values: list[float]) -> list[bool]:
        def replica_fn(x):  # global replica 0 lives on the chief: only its copy counts
            first = tf.distribute.get_replica_context().replica_id_in_sync_group == 0
            return tf.where(first, x, tf.zeros_like(x))
        vector = tf.constant(values, tf.float32)
        summed = self.strategy.reduce(SUM, self.strategy.run(replica_fn, args=(vector,)), axis=None)
        return [v > 0.5 for v in summed.numpy().tolist()]

    def take_train_metrics(self, step: int) -> dict[str, float]:
        """The train metrics of the steps since the last call (a log window), with speed, ETA, learning rate."""
        elapsed = time.perf_counter() - self._window_time
        metrics = steps.finalize(self.task, self._window)
        metrics["examples_per_sec"] = ((step - self._window_start) * self.config.train.global_batch_size
                                       / max(elapsed, 1e-9))
        done = max(step - self._started_at, 1)
        metrics["eta_s"] = (self.config.train.steps - step) * (time.perf_counter() - self._started_time) / done
        metrics["learning_rate"] = optim.current_learning_rate(self.state.optimizer)
        if self.config.on_nonfinite == "skip":
            metrics["skipped_nonfinite"] = float(self._skipped)
        self.metrics["train"] = dict(metrics)
        self._window, self._window_start = {}, step
        return metrics

    # ------------------------------------------------------------------ saving
    def save(self, step: int) -> None:
        """The rotating checkpoint of `step` (every worker); refused if a weight is NaN or Inf."""
        self._check_finite(step)
        self.checkpointer.save(step)

    def save_best(self, step: int) -> None:
        """The best checkpoint, replacing the previous best (every worker)."""
        self._check_finite(step)
        self._best.save(step)

    def _check_finite(self, step: int) -> None:
        # Such a checkpoint would poison every resume.
        if not all(bool(tf.reduce_all(tf.math.is_finite(v))) for v in self.state.model.weights):
            raise FloatingPointError(f"weights are not finite at step {step}; not saving a checkpoint. "
                                     f"Lower the learning rate and resume from the last checkpoint")

    # ------------------------------------------------------------------ eval
    def evaluate(self) -> dict[str, dict[str, float]]:
        """Every eval set once on the current weights, and on their EMA too with optimizer.ema (splits
        `<split>_ema`); logged, written (chief) and kept in `metrics`. Every worker calls it."""
        step = self.step
        results = self._evaluate_all(step, "")
        if self.config.optimizer.ema and self.evaluators:
            with self.ema_weights():
                results.update(self._evaluate_all(step, "_ema"))
        self.metrics.update(results)
        self.last_eval_step = step
        return results

    def _evaluate_all(self, step: int, suffix: str) -> dict[str, dict[str, float]]:
        results = {}
        for split, evaluator in self.evaluators.items():
            started = time.perf_counter()
            metrics = results[split + suffix] = evaluator()
            if self.writer.enabled:
                logging.info("%s at step %d: %s on %d examples (%.1fs)", split + suffix, step,
                             format_metrics(metrics, skip=("examples",)), metrics["examples"],
                             time.perf_counter() - started)
            self.writer.write(step, split + suffix, metrics)
        return results

    @contextlib.contextmanager
    def ema_weights(self) -> Iterator[None]:
        """A context in which the model holds the optimizer's moving averages (swapped in, then back out)."""
        self._swap_ema()
        try:
            yield
        finally:
            self._swap_ema()

    def _swap_ema(self) -> None:
        if self._ema_swap is None:
            optimizer = getattr(self.state.optimizer, "inner_optimizer", self.state.optimizer)
            pairs = list(zip(optimizer._trainable_variables, optimizer._model_variables_moving_average))

            @tf.function(autograph=False)
            def swap():  # exact (a copy, not Keras' add-and-subtract swap, which rounds the weights)
                for variable, average in pairs:
                    held = tf.identity(variable.value)
                    variable.assign(average.value)
                    average.assign(held)
            self._ema_swap = swap
        self._ema_swap()

    def finalize_ema(self) -> None:
        """With optimizer.ema, the model's weights become their moving average (for the export)."""
        if self.config.optimizer.ema:
            self.state.optimizer.finalize_variable_values(self.state.model.trainable_variables)

    # ------------------------------------------------------------------ export
    def export(self, directory: str | None = None) -> str | None:
        """A SavedModel of the current weights (the task's serving endpoints) in `directory` (default
        workdir/export), written by the chief; None on other workers or with config.export=False."""
        if not (self.config.export and self.chief):
            return None
        directory = export.export(self.state.model, self.task, directory or os.path.join(self.workdir, "export"))
        logging.info("exported a SavedModel of step %d to %s", self.step, directory)
        return directory

    def export_best(self) -> str | None:
        """With config.best_checkpoint.export, the best checkpoint's weights exported to workdir/export_best
        (the chief; the model keeps them afterwards: call it last)."""
        if not (self.config.best_checkpoint.export and self.chief and self.config.best_checkpoint.metric):
            return None
        best = checkpoint.saved_checkpoints(self.best_directory)
        if not best:
            logging.warning("no best checkpoint to export in %s", self.best_directory)
            return None
        tf.train.Checkpoint(model=self.state.model).read(best[0]).expect_partial()
        directory = export.export(self.state.model, self.task, os.path.join(self.workdir, "export_best"))
        logging.info("exported the best checkpoint (%s) to %s", os.path.basename(best[0]), directory)
        return directory

