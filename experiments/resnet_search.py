"""A search over the ranges of resnet_lr.py: learning rate and weight decay for the digits ResNet, with TPE and
median pruning. Same 9-trial budget as the grid; the learning rate and decay are continuous (log scale), a decay
of 0 one choice.

  python -m mwloop.sweep --sweep=experiments/resnet_search.py --workdir=runs/search_lr
  python -m mwloop.sweep --sweep=experiments/resnet_search.py:short ...   # 200-step trials (benchmarks)
"""

CONFIG = "configs/resnet.py:digits"
METRIC = "eval/accuracy"
MODE = "max"
N_TRIALS = 9
SAMPLER = "tpe"  # tpe | random | cmaes | grid
PRUNER = "median"  # median | asha | successive_halving | hyperband | none
PRUNER_OPTIONS = {"n_startup_trials": 3}  # three trials run to the end before any is pruned


def search_space(trial, arg=None):
    # The grid's ranges (resnet_lr.py: lr 0.03 ... 0.3, weight decay 0 ... 5e-3), searched continuously.
    trial.suggest_float("optimizer.learning_rate", 0.03, 0.3, log=True)
    # A decay of 0 is a choice of its own (a log-uniform range cannot hold 0): a helper parameter (its name
    # starts with "_": not a config key) picks it, and the override is returned rather than suggested.
    fixed = {}
    if trial.suggest_categorical("_decay", ["none", "l2"]) == "l2":
        trial.suggest_float("optimizer.weight_decay", 5e-5, 5e-3, log=True)
    else:
        fixed["optimizer.weight_decay"] = 0.0
    if arg == "short":  # 200 steps, an eval every 50: the pruner gets four looks per trial
        return {**fixed, "train.steps": 200, "train.eval_every_steps": 50, "train.checkpoint_every_steps": 50,
                "optimizer.warmup_steps": 20}
    if arg:
        raise ValueError(f"unknown resnet_search variant {arg!r}; use short or nothing")
    return {**fixed, "train.eval_every_steps": 100}  # six evals over 600 steps: six chances to prune
