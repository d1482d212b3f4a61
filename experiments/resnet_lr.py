"""Learning rate x weight decay for the small ResNet on the digits: 9 points, a few minutes on 2 CPU cores.

  python -m mwloop.sweep --sweep=experiments/resnet_lr.py --workdir=runs/sweep_lr
"""

from mwloop.sweep import product

CONFIG = "configs/resnet.py:digits"
METRIC = "eval/accuracy"
MODE = "max"


def get_sweep() -> list[dict]:
    # Peak learning rates a decade apart around the config's 0.1 (SGD + momentum, cosine, 50 warmup steps);
    # weight decay is the L2 penalty in the loss: none, the config's 5e-4, and ten times more.
    return product({"optimizer.learning_rate": [0.03, 0.1, 0.3], "optimizer.weight_decay": [0.0, 5e-4, 5e-3]})
