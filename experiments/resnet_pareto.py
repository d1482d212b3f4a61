"""Several objectives on the digits ResNet (configs/resnet.py): held-out accuracy against the weight count and the
training rate, over the network's width and depth, with a constraint on the weight count that removes the widest
models. The answer is the Pareto front (results.md, results.png), not one best trial.

  python -m mwloop.sweep --sweep=experiments/resnet_pareto.py --workdir=/tmp/resnet_pareto --parallel=2

The space is small enough to run whole: a grid of 4 widths x 3 depths, 12 trials of 200 steps (13m50s one at a
time on the loaded 2-core machine; BENCHMARKS.md).
"""

CONFIG = "configs/resnet.py:digits"
# Every objective is a metric of the trial's metrics.jsonl; the cost/ ones are recorded by every sweep trial
# (mwloop.run.cost). cost/examples_per_sec is measured beside whatever else runs on the machine.
OBJECTIVES = {"eval/accuracy": "max", "cost/params": "min", "cost/examples_per_sec": "max"}
# Optuna's Trial.set_constraint: an infeasible trial is never on the front. 250,000 weights removes the widest
# stage widths (32, 64, 128: 308,650 weights at one block per stage) and width 16 at three blocks (273,370).
CONSTRAINTS = ["cost/params <= 250000"]
SAMPLER = "grid"
# Several objectives cannot be pruned: Optuna's pruners judge one (PRUNER must stay "none", the default).


def search_space(trial):
    # Helpers ("_": not config keys): the first stage's width (each later stage doubles it) and blocks per stage.
    width = trial.suggest_categorical("_width", [4, 8, 16, 32])
    blocks = trial.suggest_categorical("_blocks", [1, 2, 3])
    return {"model.widths": (width, 2 * width, 4 * width), "model.blocks_per_stage": blocks, "train.steps": 200,
            "train.log_every_steps": 50, "train.eval_every_steps": 100, "train.checkpoint_every_steps": 200}
