"""Tasks whose own code raises while mwloop traces a step, for tests/test_traced_errors.py.

tests/tiny_task.py's data and model (they trace in a fraction of a second), with one mistake each. Two kinds:
- raised in the task's own frames, in the replica's thread: `LossRaises`, `TrainRaises`, `EvalStepRaises`;
- raised by TensorFlow on the strategy's main thread, in the merge_call of a collective the task called
  (Mirrored and MultiWorkerMirrored run each replica in a thread of its own): `ScalarGather` (all_gather of
  a scalar, on any number of replicas), `InputGather` (all_gather of a tensor straight from the input:
  `ValueError: destinations can not be empty` under MultiWorkerMirrored only), `TrainGathers` (mwloop's
  gather inside the XLA-compiled step of config.jit_compile).

`python -m mwloop.main --config=tests/raising_task.py:NAME` runs one (NAME a key of TASKS) on a tiny config.
"""

from __future__ import annotations

import tensorflow as tf

import mwloop
from tests import tiny_task


class LossRaises(tiny_task.TinyTask):
    """The loss rejects its batch while the step is traced (the eval step, traced at start, sees it first)."""

    def loss(self, batch, outputs):
        raise ValueError(f"labels {batch['label'].shape} do not match logits {outputs.shape}")


class TrainRaises(tiny_task.TinyTask):
    """Only the train step's forward pass raises (the eval step traces fine)."""

    def forward(self, model, batch, training):
        if training:
            raise ValueError("dropout rate must be in [0, 1)")
        return super().forward(model, batch, training)


class EvalStepRaises(tiny_task.TinyTask):
    """A custom eval step that raises."""

    def eval_step(self, model, batch):
        raise ValueError("no eval for this model")


class ScalarGather(tiny_task.TinyTask):
    """The loss all-gathers a scalar: TensorFlow's merge_call cannot concatenate it (on the main thread)."""

    def loss(self, batch, outputs):
        total = tf.distribute.get_replica_context().all_gather(tf.reduce_sum(outputs), axis=0)
        return super().loss(batch, outputs) + 0.0 * tf.reduce_sum(total)


class InputGather(tiny_task.TinyTask):
    """The loss all-gathers the labels straight from the input, as a contrastive loss's user did."""

    def loss(self, batch, outputs):
        labels = tf.distribute.get_replica_context().all_gather(batch["label"], axis=0)
        return super().loss(batch, outputs) + 0.0 * tf.cast(tf.reduce_sum(labels), tf.float32)


class TrainGathers(tiny_task.TinyTask):
    """The train step gathers the global batch (not supported inside config.jit_compile's compiled step)."""

    def forward(self, model, batch, training):
        outputs = super().forward(model, batch, training)
        if training:
            rows, _ = mwloop.gather_global_batch(outputs)
            outputs = outputs + 0.0 * tf.reduce_sum(rows)
        return outputs


TASKS = {"loss": LossRaises, "train": TrainRaises, "eval_step": EvalStepRaises, "scalar_gather": ScalarGather,
         "input_gather": InputGather, "train_gathers": TrainGathers}


def get_config(arg: str | None = None):
    """A tiny run of TASKS[arg] (default "loss"), strategy auto: it fails at its first trace."""
    config = tiny_task.tiny_config(TASKS[arg or "loss"])
    config.distribution.strategy = "auto"
    return config
