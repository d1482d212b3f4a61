"""User code that misbehaves outside the step, for tests/test_user_code_outside_step.py and the fault cases of
tests/stress/fault_cases_usercode.py (issue 31 item 6).

`python -m mwloop.main --config=tests/misbehaving_task.py:NAME` runs one tiny run (NAME a key of TASKS):
- "exit_in_dataset": the task's train_arrays calls sys.exit(0) (nothing trained, so nothing may look done);
- "exit_in_build": build_model calls sys.exit(0);
- "graph_loss": the task's own cross-entropy gets labels out of range: it fails inside the graph, at run time;
- "nan_part": one loss part (`aux`) is NaN at every step.
"""

from __future__ import annotations

import sys

import tensorflow as tf

from tests import tiny_task


class ExitInDataset(tiny_task.TinyTask):
    """The data reader decides to stop the program."""

    def train_arrays(self):
        sys.exit(0)


class ExitInBuild(tiny_task.TinyTask):
    """build_model stops the program."""

    def build_model(self):
        sys.exit(0)


class GraphLoss(tiny_task.TinyTask):
    """The task's own cross-entropy over 2 classes where the labels go up to 2: fails when the graph runs."""

    def loss(self, batch, outputs):
        return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=batch["label"], logits=outputs[:, :2])


class NanPart(tiny_task.TinyTask):
    """Two loss parts; `aux` is NaN (a log of a negative number)."""

    def loss(self, batch, outputs):
        main = super().loss(batch, outputs)
        ones = tf.ones_like(main)
        return {"main": (main, ones), "aux": (tf.math.log(-ones), ones)}

    def metric_sums(self, batch, outputs, weights):  # weights: one per loss part
        return super().metric_sums(batch, outputs, weights["main"])


TASKS = {"exit_in_dataset": ExitInDataset, "exit_in_build": ExitInBuild, "graph_loss": GraphLoss,
         "nan_part": NanPart}


def get_config(arg: str | None = None):
    """A tiny run of TASKS[arg], strategy auto."""
    config = tiny_task.tiny_config(TASKS[arg or "graph_loss"])
    config.distribution.strategy = "auto"
    return config
