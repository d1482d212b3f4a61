"""Side-car evaluation: evaluate each new checkpoint of the chief's directory once."""

from __future__ import annotations

import os

import ml_collections
import tensorflow as tf
from absl import logging

from mwloop import state
from mwloop.task import Task
from mwloop.writers import MetricWriter, format_metrics


def continuous_eval(config: ml_collections.ConfigDict, workdir: str, strategy: tf.distribute.Strategy,
                    task: Task) -> dict[str, float]:
    """Watches `workdir/checkpoints`, evaluates every checkpoint it sees once, writes eval
    summaries and metrics lines, and returns after the final step's checkpoint (or after
    `config.eval.continuous_timeout_s` without a new one)."""
    run = state.create(config, strategy, task)
    evaluate = state.make_evaluator(config, strategy, task, run.model)
    if evaluate is None:
        raise ValueError(f"--mode=continuous_eval: task {type(task).__name__} has no eval data; give it "
                         f"eval_arrays or eval_dataset")
    reader = tf.train.Checkpoint(model=run.model, step=run.step)  # no optimizer: eval never needs it
    writer = MetricWriter(workdir, enabled=True)
    directory = os.path.join(workdir, "checkpoints")
    results: dict[str, float] = {}
    logging.info("continuous eval: watching %s", directory)
    try:
        for path in tf.train.checkpoints_iterator(directory, min_interval_secs=1,
                                                  timeout=config.eval.continuous_timeout_s or None):
            try:
                reader.restore(path).expect_partial()
            except (tf.errors.OpError, IndexError, OSError) as e:
                logging.warning("skipping unreadable checkpoint %s (%s)", path, str(e).splitlines()[0][:200])
                continue
            at_step = int(run.step.numpy())
            results = evaluate()
            logging.info("eval of %s at step %d: %s on %d examples", os.path.basename(path), at_step,
                         format_metrics(results, skip=("examples",)), results["examples"])
            writer.write(at_step, "eval", results)
            writer.flush()
            if at_step >= config.train.steps:
                break
    finally:
        writer.close()
    return results
