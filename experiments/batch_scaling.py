"""Global batch size with the linear learning-rate scaling rule, at a fixed number of epochs.

With `optimizer.base_batch_size` = 128 the peak learning rate is
learning_rate * global_batch_size / 128 (mwloop/step/optim.py), so every batch size
gets the step size the rule (Goyal et al., 2017) prescribes. Steps and warmup
shrink as the batch grows so that every point sees the same examples.

  python -m mwloop.sweep --sweep=experiments/batch_scaling.py --workdir=runs/sweep_batch
  python -m mwloop.sweep --sweep=experiments/batch_scaling.py:compare ...  # also without the rule
"""

from mwloop.sweep import product, zip_

CONFIG = "configs/resnet.py:digits"
METRIC = "eval/accuracy"
MODE = "max"

BASE_BATCH_SIZE = 128  # the digits config: batch 128, 600 steps, 50 warmup steps, peak lr 0.1
BASE_STEPS, BASE_WARMUP = 600, 50
GLOBAL_BATCH_SIZES = [32, 64, 128, 256, 512]


def _at_fixed_epochs() -> list[dict]:
    """Each batch size with steps, warmup and eval/checkpoint intervals scaled to the same epochs."""
    steps = [BASE_STEPS * BASE_BATCH_SIZE // b for b in GLOBAL_BATCH_SIZES]
    return zip_({
        "train.global_batch_size": GLOBAL_BATCH_SIZES,
        "train.steps": steps,
        "optimizer.warmup_steps": [BASE_WARMUP * BASE_BATCH_SIZE // b for b in GLOBAL_BATCH_SIZES],
        "train.eval_every_steps": [s // 3 for s in steps],  # three evals per run: comparable curves
        "train.checkpoint_every_steps": [s // 3 for s in steps],
    })


def get_sweep(arg: str | None = None) -> list[dict]:
    if arg not in (None, "compare"):
        raise ValueError(f"unknown batch_scaling variant {arg!r}; use compare or nothing")
    # base_batch_size 0 turns the rule off: the same peak lr 0.1 at every batch size.
    rule = [BASE_BATCH_SIZE, 0] if arg == "compare" else [BASE_BATCH_SIZE]
    return product({"optimizer.base_batch_size": rule, "optimizer.learning_rate": [0.1]}, _at_fixed_epochs())
