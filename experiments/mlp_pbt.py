"""Population-based training of the MLP (docs/pbt.md): 4 members, 3 intervals of 10 steps; the worst quarter copies
the best one's checkpoint at each interval and trains on with a perturbed learning rate and a fresh weight decay.
About a minute on a quiet 2-core machine:

    python -m mwloop.sweep --sweep=experiments/mlp_pbt.py --workdir=runs/mlp_pbt
"""

CONFIG = "configs/mlp.py"
METRIC = "eval/accuracy"
ALGORITHM = "pbt"
POPULATION = 4
INTERVAL_STEPS = 10             # a segment; every member trains train.steps = 3 intervals
QUANTILE = 0.25                 # the bottom quarter copies the top quarter
PERTURB = {"optimizer.learning_rate": (0.8, 1.25),      # a factor, drawn from these
           "optimizer.weight_decay": "resample"}         # a fresh draw from search_space


def search_space(trial):
    """The population's first values, and what "resample" draws from."""
    trial.suggest_float("optimizer.learning_rate", 0.01, 0.5, log=True)
    trial.suggest_float("optimizer.weight_decay", 1e-6, 1e-3, log=True)
    return {"train.steps": 30, "train.steps_per_loop": 10, "train.log_every_steps": 10,
            "train.eval_every_steps": 10, "train.checkpoint_every_steps": 10}
