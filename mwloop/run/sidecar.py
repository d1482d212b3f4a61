"""Side-car evaluation: evaluate each new checkpoint of the chief's directory once.

It stops after the checkpoint of `train.steps`, or when the trainer is gone by
any route (early stop, an error, a kill, done): the trainer's chief holds the
workdir's lock while it runs, so a lock that stays free for
`eval.trainer_gone_s` once a checkpoint was seen means no more checkpoints are
coming (a launcher's restart takes the lock again within that time). A remote
workdir has no lock: there only `train.steps` and `eval.continuous_timeout_s`
end it.
"""

from __future__ import annotations

import os
import time

import ml_collections
import tensorflow as tf
from absl import logging

from mwloop.artifacts import checkpoint, disk, workdir_lock
from mwloop.artifacts.checkpoint import CheckpointError
from mwloop.artifacts.writers import MetricWriter, format_metrics
from mwloop.cluster import agreement
from mwloop.config import check as config_check
from mwloop.errors import UserError
from mwloop.run import state
from mwloop.step import graph_checks
from mwloop.task import Task

# How often the trainer's lock and the timeout are looked at while no checkpoint comes.
POLL_S = 2.0


def continuous_eval(config: ml_collections.ConfigDict, workdir: str, strategy: tf.distribute.Strategy,
                    task: Task) -> dict[str, float]:
    """Watches `workdir/checkpoints`, evaluates every checkpoint it sees once, writes eval
    summaries and metrics lines, and returns after the final step's checkpoint, once the trainer is gone
    (see above), or after `config.eval.continuous_timeout_s` without a new checkpoint. `config` is checked
    already (`train.train_and_evaluate`); the rules that need the strategy and the task are checked here."""
    config_check.check_run(config, num_replicas=strategy.num_replicas_in_sync,
                           custom_train_step=task.overrides("train_step"))
    if workdir_lock.is_remote(workdir):
        # An unknown scheme or an unreachable bucket: one line.
        workdir_lock.check_remote(workdir)
    elif os.path.isdir(workdir):
        # The side-car appends to metrics.jsonl too.
        workdir_lock.check_trusted(workdir)
    with disk.one_line_errors(workdir), graph_checks.one_line_errors():
        return _continuous_eval(config, workdir, strategy, task)


def _continuous_eval(config: ml_collections.ConfigDict, workdir: str, strategy: tf.distribute.Strategy,
                     task: Task) -> dict[str, float]:
    run = state.create(config, strategy, task)
    evaluators = state.make_evaluators(config, strategy, task, run.model)
    if not evaluators:
        raise UserError(f"--mode=continuous_eval: task {type(task).__name__} has no eval data; give it "
                         f"eval_arrays or eval_dataset")
    writer = MetricWriter(workdir, enabled=True)
    directory = os.path.join(workdir, "checkpoints")
    results: dict[str, float] = {}
    evaluated = 0
    logging.info("continuous eval: watching %s", directory)
    watch = _TrainerWatch(workdir, config)
    # The chief's record: now if the chief wrote it already, else at the first checkpoint (written after it).
    agreed = agreement.check_recorded(config, workdir, task)
    try:
        for path in tf.train.checkpoints_iterator(directory, min_interval_secs=1, timeout=POLL_S,
                                                  timeout_fn=watch.done):
            watch.new_checkpoint()
            agreed = agreed or agreement.check_recorded(config, workdir, task)
            try:
                # Every weight of this config's model must come from the checkpoint, or eval is of noise; each
                # read into a checkpoint of its own: one that vanished mid-read must not poison the next.
                checkpoint.read_into(path, what="does not hold this config's model",
                                     fix="evaluate with the config that trained it", model=run.model, step=run.step)
            except checkpoint.UNREADABLE as e:
                logging.warning("skipping unreadable checkpoint %s (%s)", path, str(e).splitlines()[0][:200])
                continue
            evaluated += 1
            at_step = int(run.step.numpy())
            for split, evaluator in evaluators.items():
                metrics = evaluator()
                logging.info("%s of %s at step %d: %s on %d examples", split, os.path.basename(path), at_step,
                             format_metrics(metrics, skip=("examples",)), metrics["examples"])
                writer.write(at_step, split, metrics)
                results = metrics if split == "eval" else results
            writer.flush()
            if at_step >= config.train.steps:
                break
    finally:
        writer.close()
    if not evaluated:
        raise CheckpointError(f"continuous eval saw no checkpoint in {directory} in "
                              f"{config.eval.continuous_timeout_s:.0f} s (config.eval.continuous_timeout_s); "
                              f"check --workdir, or start the trainer")
    return results



class _TrainerWatch:
    """`done()` (checkpoints_iterator's timeout_fn, called when no checkpoint came for POLL_S): whether to stop."""

    def __init__(self, workdir: str, config: ml_collections.ConfigDict):
        self.workdir, self.config = workdir, config
        self.last_new = time.monotonic()
        # A checkpoint was seen: a trainer ran here.
        self.seen = False
        self.free_since: float | None = None

    def new_checkpoint(self) -> None:
        self.seen, self.last_new = True, time.monotonic()

    def done(self) -> bool:
        now = time.monotonic()
        timeout = self.config.eval.continuous_timeout_s
        if timeout and now - self.last_new >= timeout:
            logging.info("continuous eval: no new checkpoint for %.0f s (eval.continuous_timeout_s); stopping",
                         timeout)
            return True
        if not self.seen or workdir_lock.is_remote(self.workdir):
            return False
        if workdir_lock.is_held(self.workdir):
            self.free_since = None
            return False
        self.free_since = self.free_since or now
        gone_s = self.config.eval.trainer_gone_s
        if now - self.free_since < gone_s:
            return False
        logging.info("continuous eval: the trainer is gone (the workdir's lock free for %.0f s: it stopped early, "
                     "failed or finished) and every checkpoint it left is evaluated; stopping", gone_s)
        return True
