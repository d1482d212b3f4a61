"""A tiny, seconds-long config for tests and quick trials: an MLP on the digits."""

from mwloop import base_config


def get_config(arg: str | None = None):
    del arg
    c = base_config()
    c.name = "mlp"
    c.dataset.flatten = True
    c.model = {"name": "mlp", "hidden": (32,)}
    c.train.global_batch_size = 64
    c.train.steps = 200
    c.train.steps_per_loop = 20
    c.train.log_every_steps = 50
    c.train.eval_every_steps = 100
    c.train.checkpoint_every_steps = 100
    c.eval.global_batch_size = 100  # 360 eval examples: the last batch is partial
    c.optimizer.learning_rate = 0.1
    c.optimizer.weight_decay = 1e-4
    return c
