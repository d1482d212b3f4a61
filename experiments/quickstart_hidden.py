"""A sweep of a user task's own config key: examples/quickstart.py's `hidden` width.

  python -m mwloop.sweep --sweep=experiments/quickstart_hidden.py --workdir=/tmp/quickstart_hidden
"""

from mwloop.sweep import product

CONFIG = "examples/quickstart.py"
METRIC = "eval/accuracy"
MODE = "max"


def get_sweep(arg: str | None = None) -> list[dict]:
    del arg
    return product({"train.steps": [100], "train.eval_every_steps": [50]}, {"hidden": [4, 32]})
