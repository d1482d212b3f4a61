"""The regression example (examples/regression.py): an MLP on scikit-learn's diabetes data, in seconds."""

import ml_collections

from mwloop import base_config


def get_config(arg: str | None = None):
    del arg
    c = base_config(task="examples.regression:Regression")
    c.name = "regression"
    # Only what the task reads; `threads` is mwloop's tf.data knob, read when present.
    c.dataset = ml_collections.ConfigDict({"eval_fraction": 0.2, "split_seed": 0, "threads": 0})
    c.model = ml_collections.ConfigDict({"hidden": (32,)})
    c.train.global_batch_size = 32  # 354 training examples: about 11 steps an epoch
    c.train.steps = 400
    c.train.steps_per_loop = 50
    c.train.log_every_steps = 100
    c.train.eval_every_steps = 200
    c.train.checkpoint_every_steps = 200
    c.eval.global_batch_size = 64  # 88 eval examples: the last batch is partial (padded and masked)
    c.optimizer.name = "adam"
    c.optimizer.learning_rate = 1e-2
    c.optimizer.schedule = "cosine"
    c.optimizer.weight_decay = 1e-2  # 354 examples: an MLP overfits without it (eval R^2 0.49 at 1e-3)
    return c
