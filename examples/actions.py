"""User actions, defined outside mwloop: what docs/actions.md shows.

    python -m mwloop.main --config=configs/mlp.py --workdir=/tmp/act \
        --config.actions='("examples.actions:LogWeightNorm", "examples.actions:RecordSteps")'
"""

from __future__ import annotations

import json
import os

import tensorflow as tf
from absl import logging

import mwloop


class LogWeightNorm(mwloop.Action):
    """Every 30 seconds (chief only): the global norm of the weights, logged and written as its own figure."""

    def __init__(self, config):
        super().__init__(every_secs=config.get("weight_norm_every_secs", 30.0))

    def __call__(self, run: mwloop.ActionContext, step: int) -> None:
        norm = float(tf.linalg.global_norm(run.model.trainable_variables))
        logging.info("step %d: weight norm %.3f (train loss %.4f)", step, norm,
                     run.metrics.get("train", {}).get("loss", float("nan")))
        run.writer.write(step, "weights", {"global_norm": norm})


class RecordSteps(mwloop.Action):
    """Every 20 steps on every worker: appends "worker step" to workdir/steps-<worker>.txt (a trace a test reads)."""
    all_workers = True

    def __init__(self):
        super().__init__(every_steps=20)

    def __call__(self, run: mwloop.ActionContext, step: int) -> None:
        with open(os.path.join(run.workdir, f"steps-{run.worker}.txt"), "a") as f:
            f.write(json.dumps({"worker": run.worker, "step": step, "chief": run.is_chief}) + "\n")
