"""ResNet configs. `--config=configs/resnet.py[:variant]`:

  digits (default): a small ResNet on scikit-learn's real 8x8 handwritten digits.
  synthetic: ResNet-50 on ImageNet-shaped random data, for speed measurements.
"""

from mwloop.config_base import base_config


def get_config(arg: str | None = None):
    variant = arg or "digits"
    c = base_config()
    c.name = f"resnet-{variant}"
    if variant == "digits":
        c.model.widths = (16, 32, 64)
        c.model.blocks_per_stage = 1
        c.train.global_batch_size = 128
        c.train.steps = 600
        c.train.steps_per_loop = 50
        c.train.log_every_steps = 100
        c.train.eval_every_steps = 200
        c.train.checkpoint_every_steps = 200
        c.optimizer.learning_rate = 0.1
        c.optimizer.warmup_steps = 50
    elif variant == "synthetic":
        c.dataset.name = "synthetic"
        c.dataset.image_shape = (224, 224, 3)
        c.dataset.num_classes = 1000
        c.dataset.num_train_examples = 64
        c.dataset.num_eval_examples = 64
        c.model = {"name": "resnet50"}
        c.train.global_batch_size = 32
        c.train.steps = 20
        c.train.steps_per_loop = 10
        c.train.log_every_steps = 10
        c.train.eval_every_steps = 0
        c.train.checkpoint_every_steps = 0
        c.eval.global_batch_size = 32
        c.optimizer.weight_decay = 1e-4
    else:
        raise ValueError(f"unknown resnet variant {variant!r}; use digits or synthetic")
    return c
