"""A search over the ranges of resnet_lr.py: learning rate and weight decay for the digits ResNet, with TPE and
median pruning. Same 9-trial budget as the grid; the learning rate and decay are continuous (log scale), and
momentum is searched too.

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
    # A decay of 0 is a choice of its own: log-uniform ranges cannot hold 0.
    if trial.suggest_categorical("_decay", ["none", "l2"]) == "l2":
        trial.suggest_float("optimizer.weight_decay", 5e-5, 5e-3, log=True)
    else:
        trial.suggest_categorical("optimizer.weight_decay", [0.0])
    trial.suggest_float("optimizer.momentum", 0.8, 0.95)
    if arg == "short":  # evals every 50 steps: the pruner gets four looks per trial
        return {"train.steps": 200, "train.eval_every_steps": 50, "train.checkpoint_every_steps": 50,
                "optimizer.warmup_steps": 20}
    if arg:
        raise ValueError(f"unknown resnet_search variant {arg!r}; use short or nothing")
    return {"train.eval_every_steps": 100}  # six evals over 600 steps: six chances to prune
