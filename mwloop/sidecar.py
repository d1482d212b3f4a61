"""Side-car evaluation: evaluate each new checkpoint of the chief's directory once."""

from __future__ import annotations

import os

import ml_collections
import tensorflow as tf
from absl import logging

from mwloop import checkpoint, config_check, state
from mwloop.checkpoint import CheckpointError
from mwloop.errors import UserError
from mwloop.task import Task
from mwloop.writers import MetricWriter, format_metrics


def continuous_eval(config: ml_collections.ConfigDict, workdir: str, strategy: tf.distribute.Strategy,
                    task: Task) -> dict[str, float]:
    """Watches `workdir/checkpoints`, evaluates every checkpoint it sees once, writes eval
    summaries and metrics lines, and returns after the final step's checkpoint (or after
    `config.eval.continuous_timeout_s` without a new one)."""
    config_check.check(config, "continuous_eval")
    config_check.check_run(config, num_replicas=strategy.num_replicas_in_sync,
                           custom_train_step=task.overrides("train_step"))
    run = state.create(config, strategy, task)
    evaluators = state.make_evaluators(config, strategy, task, run.model)
    if not evaluators:
        raise UserError(f"--mode=continuous_eval: task {type(task).__name__} has no eval data; give it "
                         f"eval_arrays or eval_dataset")
    reader = tf.train.Checkpoint(model=run.model, step=run.step)  # no optimizer: eval never needs it
    writer = MetricWriter(workdir, enabled=True)
    directory = os.path.join(workdir, "checkpoints")
    results: dict[str, float] = {}
    evaluated = 0
    logging.info("continuous eval: watching %s", directory)
    try:
        for path in tf.train.checkpoints_iterator(directory, min_interval_secs=1,
                                                  timeout=config.eval.continuous_timeout_s or None):
            try:
                status = reader.restore(path)
            except (tf.errors.OpError, IndexError, OSError) as e:
                logging.warning("skipping unreadable checkpoint %s (%s)", path, str(e).splitlines()[0][:200])
                continue
            except (ValueError, AssertionError) as e:  # shapes of another model
                raise checkpoint.mismatch(path, e, "does not hold this config's model",
                                          "evaluate with the config that trained it") from None
            try:  # every weight of this config's model must come from the checkpoint, or eval is of noise
                status.assert_existing_objects_matched()
            except AssertionError as e:
                raise checkpoint.mismatch(path, e, "does not hold this config's model",
                                          "evaluate with the config that trained it") from None
            status.expect_partial()  # the optimizer's slots are in the checkpoint, unused here
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

