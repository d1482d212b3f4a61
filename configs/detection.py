"""The detection-style example (examples/detection.py): class + box + count losses on padded object sets."""

import ml_collections

from mwloop import base_config


def get_config(arg: str | None = None):
    del arg
    c = base_config(task="examples.detection:Detection")
    c.name = "detection"
    c.dataset = ml_collections.ConfigDict({"num_train_examples": 2048, "num_eval_examples": 300, "seed": 0})
    c.model = ml_collections.ConfigDict({"hidden": 32})
    # Weights of the loss parts in the total loss (a part not named here weighs 1); sweepable like any key.
    c.loss_weights = ml_collections.ConfigDict({"cls": 1.0, "box": 0.5, "count": 0.1})
    c.train.global_batch_size = 64
    c.train.steps = 300
    c.train.steps_per_loop = 50
    c.train.log_every_steps = 100
    c.train.eval_every_steps = 150
    c.train.checkpoint_every_steps = 150
    c.eval.global_batch_size = 64  # 300 eval examples: the last batch is partial (padded and masked)
    c.optimizer.name = "adam"
    c.optimizer.learning_rate = 1e-2
    c.optimizer.schedule = "cosine"
    return c
