"""A seconds-long sweep of configs/mlp.py for tests and trying the runner.

  python -m mwloop.sweep --sweep=experiments/mlp_smoke.py --workdir=/tmp/mlp_smoke
  python -m mwloop.sweep --sweep=experiments/mlp_smoke.py:fail ...   # plus a point that fails
"""

from mwloop.sweep import product

CONFIG = "configs/mlp.py"
METRIC = "eval/accuracy"
MODE = "max"

# Constants of every point: short runs with an eval curve of two points. Keys
# that never vary stay out of the point names.
SHORT = {"train.steps": [40], "train.log_every_steps": [20], "train.eval_every_steps": [20],
         "train.checkpoint_every_steps": [40]}


def get_sweep(arg: str | None = None) -> list[dict]:
    points = product(SHORT, {"optimizer.learning_rate": [0.03, 0.3]})
    if arg == "fail":
        # All examples held out for eval passes every check before the run, but the run has no data to
        # train on: a point that fails in mwloop.main.
        points += product(SHORT, {"optimizer.learning_rate": [0.3], "dataset.eval_fraction": [1.0]})
    elif arg:
        raise ValueError(f"unknown mlp_smoke variant {arg!r}; use fail or nothing")
    return points
