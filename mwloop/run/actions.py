"""Periodic work between loop calls: `Action` and the built-in actions.

The Trainer runs its actions, in list order, after every loop call at which
they are due. The built-in work (log, eval, best checkpoint, early stopping,
checkpoint, profile, preemption) is expressed the same way as a user's own
action, and the loop's call boundaries come from every action's step-based
schedule, so an action due at step N runs at step N exactly.

Control flow is common to all workers: an action that runs collectives (eval,
saving) declares `all_workers = True` and runs at the same steps on every
worker; a time-based trigger of such an action is the chief's clock, broadcast;
a stop requested by any action is the chief's decision, broadcast, so no
worker ever trains on alone or waits in a collective.
"""

from __future__ import annotations

import datetime
import inspect
import math
import os
import time
from typing import Callable

import ml_collections
import tensorflow as tf
from absl import logging

from mwloop.artifacts import files
from mwloop.artifacts.writers import format_metrics
from mwloop.errors import UserError
from mwloop.run import preemption, progress, schedule
from mwloop.run.context import ActionContext
from mwloop.step import optim
from mwloop.task import SKIPPED_KEY


class Action(schedule.Triggers):
    """Work the Trainer runs between loop calls; subclass it and define `__call__(run, step)`.

    Schedule (any combination, see `mwloop.run.schedule.Triggers`): every
    `every_steps` optimizer updates, every `every_secs` seconds (checked when a
    loop call ends, so at the granularity of config.train.steps_per_loop), at
    each step of `at_steps`, and at the run's last step if `at_end`. The
    step-based triggers end loop calls, so the action sees exactly those steps.

    Where: the chief only (default), or every worker with `all_workers=True`,
    which anything that runs collectives (an eval, a checkpoint save) needs.

    Every method receives the run's `ActionContext` (`run`): its step, metrics,
    config, model, optimizer, writer and workdir, and what an action may do
    (evaluate, save, save_best, request_stop, broadcast); nothing else.
    """

    def __call__(self, run: ActionContext, step: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define __call__(self, run, step)")

    # ------------------------------------------------------------------ optional hooks
    def start(self, run: ActionContext, step: int) -> None:
        """Called when the Trainer's `train` starts (at `step`), on every worker."""

    def end(self, run: ActionContext) -> None:
        """Called when the Trainer's `train` returns or raises, on every worker."""

    def check(self, run: ActionContext) -> None:
        """Called when the Trainer is built: raise a UserError for a setting that cannot work."""

    def checkpoint_items(self) -> dict[str, tf.Variable]:
        """State the run's checkpoint keeps for this action (e.g. the best value so far), made eagerly."""
        return {}

    def observe(self, run: ActionContext, step: int, sums: dict[str, float], seconds: float) -> None:
        """Called after every loop call on every worker, with the call's sums reduced over all replicas
        (Python floats) and the call's seconds. Define it only if needed: it runs at every call."""


def metric_key(metric: str, setting: str) -> tuple[str, str]:
    """("eval", "accuracy") from "eval/accuracy"; a one-line error otherwise."""
    split, sep, name = metric.partition("/")
    if not sep or not split or not name:
        raise UserError(f"{setting}={metric!r}; name an eval metric as 'SPLIT/NAME', e.g. 'eval/accuracy' "
                        f"(splits: eval, eval_<set> for a task's eval_sets, <split>_ema with optimizer.ema)")
    return split, name


def _metric_value(run: ActionContext, metric: str, setting: str) -> float:
    split, name = metric_key(metric, setting)
    produced = run.metrics.get(split, {})
    if name not in produced:
        raise UserError(f"{setting}={metric!r}: the eval produced {', '.join(sorted(produced)) or 'nothing'} "
                        f"under {split!r}; name one of them")
    return produced[name]


# ---------------------------------------------------------------------- built-in actions
class LogTrain(Action):
    """Logs the train metrics of the steps since the last log (chief: also metrics.jsonl, TensorBoard).

    It owns the log window: the sums and the loop calls' seconds of the steps since the last log, so the
    speed it reports is the training loop's, without the evals and saves between calls.
    """
    # Every worker logs its progress; only the chief writes.
    all_workers, at_end = True, True
    _progress: progress.ProgressLine | None = None

    def start(self, run: ActionContext, step: int) -> None:
        self._sums: dict[str, float] = {}
        self._seconds, self._window_start = 0.0, step
        self._started_at, self._started_time = step, time.perf_counter()
        # The progress line is drawn in a terminal only.
        self._progress = progress.line(step, run.config.train.steps)

    def observe(self, run: ActionContext, step: int, sums: dict[str, float], seconds: float) -> None:
        for key, value in sums.items():
            self._sums[key] = self._sums.get(key, 0.0) + value
        self._seconds += seconds
        if self._progress:
            self._progress.update(step, self._window(run, step))

    def end(self, run: ActionContext) -> None:
        if self._progress:
            self._progress.close()

    def _window(self, run: ActionContext, step: int) -> dict[str, float]:
        """The train metrics of the steps since the last log, with their speed and the run's ETA."""
        metrics = run.finalize(self._sums)
        metrics["examples_per_sec"] = ((step - self._window_start) * run.config.train.global_batch_size
                                       / max(self._seconds, 1e-9))
        done = max(step - self._started_at, 1)
        metrics["eta_s"] = (run.config.train.steps - step) * (time.perf_counter() - self._started_time) / done
        return metrics

    def close_window(self, run: ActionContext, step: int) -> dict[str, float]:
        """The train metrics of the window ending at `step`, with speed, ETA and learning rate; the next window
        starts at `step`."""
        metrics = self._window(run, step)
        metrics["learning_rate"] = optim.current_learning_rate(run.optimizer)
        if run.config.on_nonfinite == "skip":
            metrics["skipped_nonfinite"] = float(run.skipped_updates)
        run.metrics["train"] = dict(metrics)
        _check_skipped_records(run.config, metrics, self._window_start, step)
        self._sums, self._seconds, self._window_start = {}, 0.0, step
        return metrics

    def __call__(self, run: ActionContext, step: int) -> None:
        metrics = self.close_window(run, step)
        total = run.config.train.steps
        if not run.writer.enabled:
            logging.info("step %d/%d", step, total)
            return
        eta = datetime.timedelta(seconds=round(metrics.pop("eta_s")))
        logging.info("step %d/%d %s %.0f examples/s lr %.4g ETA %s", step, total,
                     format_metrics(metrics, skip=("examples", "examples_per_sec", "learning_rate")),
                     metrics["examples_per_sec"], metrics["learning_rate"], eta)
        # The time is goodput's: when the step was logged (files.ENVELOPE).
        run.writer.write(step, "train", metrics, record={"time": time.time()})


def _check_skipped_records(config: ml_collections.ConfigDict, metrics: dict[str, float], start: int, step: int) -> None:
    """config.dataset.skip_bad_records: more bad records replaced in a log window than the fraction allows stops
    the run in one line (the sums are global, so every worker decides alike)."""
    skipped = metrics.get(SKIPPED_KEY, 0.0)
    limit = config.dataset.skip_bad_records if skipped else 0.0
    if skipped > limit * metrics["examples"]:
        raise UserError(f"{skipped:.0f} of the {metrics['examples']:.0f} training examples of steps {start + 1}-{step} "
                        f"were bad records, replaced: more than config.dataset.skip_bad_records={limit:g} of them; "
                        f"repair or rewrite the dataset with python -m mwloop.data.convert, or allow a larger fraction")


class Evaluate(Action):
    """Every eval set once (and on the EMA weights too, with optimizer.ema)."""
    all_workers, at_end = True, True

    def __call__(self, run: ActionContext, step: int) -> None:
        run.evaluate()


class SaveCheckpoint(Action):
    """The run's rotating checkpoint (config.train.max_to_keep of them)."""
    # Saving runs collectives.
    all_workers, at_end = True, True

    def __call__(self, run: ActionContext, step: int) -> None:
        run.save(step)


class _BestSoFar:
    """The best value of an eval metric so far, and the evals since it improved, kept in the checkpoint."""

    def __init__(self, metric: str, mode: str, min_delta: float, setting: str):
        if mode not in ("min", "max"):
            raise UserError(f"{setting}.mode={mode!r}; use 'min' or 'max'")
        metric_key(metric, f"{setting}.metric")
        self.metric, self.mode, self.min_delta, self.setting = metric, mode, min_delta, setting
        self.best = tf.Variable(math.inf if mode == "min" else -math.inf, dtype=tf.float64, trainable=False)
        self.evals_since_best = tf.Variable(0, dtype=tf.int64, trainable=False)

    def check(self, run: ActionContext) -> None:
        """The metric's split must be one the run evaluates (its name is checked at the first eval)."""
        split, _ = metric_key(self.metric, f"{self.setting}.metric")
        splits = run.eval_splits
        if split not in splits:
            raise UserError(f"{self.setting}.metric={self.metric!r}: no eval produces split {split!r}; this run "
                            f"evaluates {', '.join(splits)} (e.g. {splits[0]}/loss)")

    def update(self, run: ActionContext) -> tuple[float, bool]:
        """This eval's value and whether it beats the best by more than min_delta (the chief's decision)."""
        value = _metric_value(run, self.metric, f"{self.setting}.metric")
        best = float(self.best.numpy())
        better = value < best - self.min_delta if self.mode == "min" else value > best + self.min_delta
        better = run.broadcast(better)
        if better:
            self.best.assign(value)
            self.evals_since_best.assign(0)
        else:
            self.evals_since_best.assign_add(1)
        return value, better

    def items(self) -> dict[str, tf.Variable]:
        return {"best": self.best, "evals_since_best": self.evals_since_best}


class KeepBest(Action):
    """Saves the weights of the best eval so far by `metric` into workdir/best_checkpoint (one, kept apart
    from the rotating checkpoints); the chief's decision, every worker saves."""
    all_workers, after_eval = True, True

    def __init__(self, metric: str, mode: str = "max"):
        super().__init__()
        self.tracker = _BestSoFar(metric, mode, 0.0, "config.best_checkpoint")

    def __call__(self, run: ActionContext, step: int) -> None:
        value, better = self.tracker.update(run)
        if better:
            run.save_best(step)
            if run.writer.enabled:
                logging.info("best %s so far: %.4f at step %d (saved in %s)", self.tracker.metric, value, step,
                             os.path.join(run.workdir, files.BEST_CHECKPOINT))

    def check(self, run: ActionContext) -> None:
        self.tracker.check(run)

    def checkpoint_items(self) -> dict[str, tf.Variable]:
        return self.tracker.items()


class EarlyStopping(Action):
    """Stops training when `metric` has not improved by more than `min_delta` for `patience` evals."""
    all_workers, may_stop, after_eval = True, True, True

    def __init__(self, metric: str, mode: str = "min", patience: int = 3, min_delta: float = 0.0):
        super().__init__()
        if patience < 1:
            raise UserError(f"config.early_stopping.patience={patience}; use 1 or more evals")
        self.patience = patience
        self.tracker = _BestSoFar(metric, mode, min_delta, "config.early_stopping")

    def __call__(self, run: ActionContext, step: int) -> None:
        self.tracker.update(run)
        waited = int(self.tracker.evals_since_best.numpy())
        if waited >= self.patience:
            run.request_stop(f"early stopping: {self.tracker.metric} has not improved by more than "
                                 f"{self.tracker.min_delta:g} for {waited} evals (best "
                                 f"{float(self.tracker.best.numpy()):.4f})")

    def check(self, run: ActionContext) -> None:
        self.tracker.check(run)

    def checkpoint_items(self) -> dict[str, tf.Variable]:
        return self.tracker.items()


class Profile(Action):
    """A TensorBoard profile of steps [first, last] in workdir/summaries (chief)."""

    def __init__(self, first: int, last: int):
        super().__init__(at_steps=(first, last) if last > first else ())
        self.first, self.last, self.running = first, last, False

    def start(self, run: ActionContext, step: int) -> None:
        # Also when resumed inside the window.
        if self.first <= step < self.last and run.is_chief:
            self(run, step)

    def __call__(self, run: ActionContext, step: int) -> None:
        if not self.running and self.first <= step < self.last:
            logdir = os.path.join(run.workdir, files.SUMMARIES)
            tf.profiler.experimental.start(logdir)
            self.running = True
            logging.info("profiling from step %d to %s", step, logdir)
        elif self.running and step >= self.last:
            self.end(run)
            logging.info("profile written at step %d", step)

    def end(self, run: ActionContext) -> None:
        if self.running:
            tf.profiler.experimental.stop()
            self.running = False


class Preempted(Action):
    """After every loop call: saves at one step on every worker and exits 42 (SIGTERM) or 130 (Ctrl-C)."""
    all_workers = True

    # No agreement of mwloop's: TensorFlow's handler agrees on the step itself.
    every_call = True

    def __init__(self, watch: Callable[[], preemption.PreemptionWatcher]):
        """`watch` makes the run's watcher (its strategy and checkpointer are the Trainer's, not an action's)."""
        super().__init__()
        self.watch = watch
        self.watcher: preemption.PreemptionWatcher | None = None

    def start(self, run: ActionContext, step: int) -> None:
        self.watcher = self.watch()

    def __call__(self, run: ActionContext, step: int) -> None:
        self.watcher.check(step)

    def end(self, run: ActionContext) -> None:
        if self.watcher:
            self.watcher.close()
            self.watcher = None


def built_in(config: ml_collections.ConfigDict, *, evaluate: bool) -> list[Action]:
    """The run's own actions from its config, in the order they run at a step (preemption comes last)."""
    train = config.train
    actions: list[Action] = [LogTrain(every_steps=train.log_every_steps)]
    if evaluate:
        actions.append(Evaluate(every_steps=train.eval_every_steps, every_secs=train.eval_every_secs))
        if config.best_checkpoint.metric:
            actions.append(KeepBest(config.best_checkpoint.metric, config.best_checkpoint.mode))
        if config.early_stopping.metric:
            es = config.early_stopping
            actions.append(EarlyStopping(es.metric, es.mode, es.patience, es.min_delta))
    elif config.early_stopping.metric or config.best_checkpoint.metric:
        setting = "early_stopping" if config.early_stopping.metric else "best_checkpoint"
        raise UserError(f"config.{setting}.metric={config[setting].metric!r} needs evals during training, and this "
                        f"run has none (--mode=train, an evaluator task, or a task without eval data); use "
                        f"--mode=train_and_eval or unset it")
    actions.append(SaveCheckpoint(every_steps=train.checkpoint_every_steps, every_secs=train.checkpoint_every_secs))
    actions.append(Profile(*config.profile_steps))
    return actions


def from_config(config: ml_collections.ConfigDict) -> list[Action]:
    """The user's actions of config.actions: import strings "package.module:Class" or classes, each called
    with the run's config (or with no argument) to make the action."""
    # Imported here, with the same import-string rules as config.task.
    from mwloop import task as task_lib
    made = []
    for spec in config.actions:
        cls = task_lib.import_object(spec, "config.actions") if isinstance(spec, str) else spec
        if not (isinstance(cls, type) and issubclass(cls, Action)):
            raise UserError(f"config.actions has {spec!r}, which is not a subclass of mwloop.Action; point it at "
                            f"your Action class ('package.module:Class')")
        takes_config = any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                           for p in inspect.signature(cls).parameters.values())
        made.append(cls(config) if takes_config else cls())
    return made
