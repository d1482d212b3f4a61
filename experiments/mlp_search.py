"""A seconds-long search of configs/mlp.py for tests and trying the agent: TPE over the learning rate and the
optimizer (momentum only for SGD: a conditional parameter), median pruning.

  python -m mwloop.sweep --sweep=experiments/mlp_search.py --workdir=/tmp/mlp_search
"""

CONFIG = "configs/mlp.py"
METRIC = "eval/accuracy"
MODE = "max"
N_TRIALS = 6
SAMPLER = "tpe"
PRUNER = "median"
PRUNER_OPTIONS = {"n_startup_trials": 2}


def search_space(trial):
    trial.suggest_float("optimizer.learning_rate", 1e-3, 1.0, log=True)
    if trial.suggest_categorical("optimizer.name", ["sgd", "adam"]) == "sgd":
        trial.suggest_float("optimizer.momentum", 0.0, 0.95)
    # Constants of every trial: 60 steps, an eval every 20 (three intermediate values for the pruner).
    return {"train.steps": 60, "train.log_every_steps": 20, "train.eval_every_steps": 20,
            "train.checkpoint_every_steps": 20}
