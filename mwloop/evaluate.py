"""Side-car evaluation: evaluate each new checkpoint of the chief's directory once."""

from __future__ import annotations

import os

import ml_collections
import tensorflow as tf
from absl import logging

from mwloop import data, state
from mwloop.writers import MetricWriter


def continuous_eval(config: ml_collections.ConfigDict, workdir: str,
                    strategy: tf.distribute.Strategy) -> dict[str, float]:
    """Watches `workdir/checkpoints`, evaluates every checkpoint it sees once, writes eval
    summaries and metrics lines, and returns after the final step's checkpoint (or after
    `config.eval.continuous_timeout_s` without a new one)."""
    source = data.get_source(config.dataset)
    run = state.create(config, strategy, source)
    evaluate = state.make_evaluator(config, strategy, source, run.model)
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
            logging.info("eval of %s at step %d: loss %.4f accuracy %.4f on %d examples", os.path.basename(path),
                         at_step, results["loss"], results["accuracy"], results["examples"])
            writer.write(at_step, "eval", results)
            writer.flush()
            if at_step >= config.train.steps:
                break
    finally:
        writer.close()
    return results
