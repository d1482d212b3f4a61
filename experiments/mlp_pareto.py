"""A minutes-long multi-objective search of configs/mlp.py: accuracy against the weight count, over the width and
depth of the MLP, with a constraint that removes the largest models. The answer is the Pareto front
(results.md, results.png), not one best trial.

  python -m mwloop.sweep --sweep=experiments/mlp_pareto.py --workdir=/tmp/mlp_pareto --parallel=2
"""

CONFIG = "configs/mlp.py"
# Every objective is a metric of the trial's metrics.jsonl; cost/params is recorded by every trial (mwloop.run.cost).
OBJECTIVES = {"eval/accuracy": "max", "cost/params": "min"}
# Optuna's Trial.set_constraint: an infeasible trial is never on the front, and TPE steers away from it.
CONSTRAINTS = ["cost/params <= 6000"]
N_TRIALS = 8
SAMPLER = "tpe"
# Several objectives cannot be pruned: Optuna's pruners judge one (PRUNER must stay "none", the default).


def search_space(trial):
    width = trial.suggest_categorical("_width", [8, 16, 32, 64, 128])
    depth = trial.suggest_int("_depth", 1, 2)
    trial.suggest_float("optimizer.learning_rate", 0.03, 0.5, log=True)
    return {"model.hidden": (width,) * depth, "train.steps": 100, "train.log_every_steps": 20,
            "train.eval_every_steps": 50, "train.checkpoint_every_steps": 100}
