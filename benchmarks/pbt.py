"""Population-based training against random search and TPE on the same total training steps (issue 46's must-show).

  python -m benchmarks.pbt --out=runs/bench_pbt                                  # population 8, 3 seeds (~30 min)
  python -m benchmarks.pbt --out=runs/bench_pbt --seeds=0 --steps=60 --interval=20  # a small run (~5 min loaded)
  python -m benchmarks.pbt --out=runs/bench_pbt_resnet --config=configs/resnet.py   # the digits ResNet

Task: the digits MLP (configs/mlp.py; `--config` another, e.g. the digits ResNet) with a learning rate and a weight
decay to find (log-uniform ranges, the cosine schedule of the config). PBT: POPULATION members of `--steps` steps
cut into `--interval`-step segments, the bottom quarter copying the top quarter (learning rate x 0.8 or 1.25, weight
decay resampled). Random search and TPE: POPULATION trials of `--steps` steps each, no pruning: the same total
steps. The figure is the best held-out eval/accuracy each sweep ends with (PBT: its winner at the last interval; a
search: its best trial), mean and spread over the seeds of the sweep itself (`--seed` of the study). Writes
OUT/pbt.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import optuna

from mwloop.sweep import pbt_report
from mwloop.sweep import study as studies

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPACE = '''
def search_space(trial):
    trial.suggest_float("optimizer.learning_rate", 0.001, 1.0, log=True)
    trial.suggest_float("optimizer.weight_decay", 1e-6, 1e-2, log=True)
    return {constants!r}
'''
PBT = '''CONFIG = "{config}"
ALGORITHM = "pbt"
POPULATION = {population}
INTERVAL_STEPS = {interval}
QUANTILE = 0.25
PERTURB = {{"optimizer.learning_rate": (0.8, 1.25), "optimizer.weight_decay": "resample"}}
'''
SEARCH = '''CONFIG = "{config}"
N_TRIALS = {population}
SAMPLER = "{sampler}"
PRUNER = "none"
'''


def sweep_file(method: str, args: argparse.Namespace) -> str:
    """The sweep file of one method."""
    constants = {"train.steps": args.steps, "train.steps_per_loop": args.interval, "train.log_every_steps": 0,
                 "train.eval_every_steps": args.interval, "train.checkpoint_every_steps": args.interval,
                 "export": False}
    head = PBT if method == "pbt" else SEARCH
    return head.format(config=args.config, population=args.population, interval=args.interval,
                       sampler=method) + SPACE.format(
        constants=constants)


def best(workdir: str, method: str) -> float | None:
    """The best held-out eval/accuracy the sweep in `workdir` ends with."""
    storage = studies.default_storage(workdir)
    (name,) = optuna.get_all_study_names(storage)
    trials = optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
    if method == "pbt":
        winner = pbt_report.winner(trials, "max")
        return None if winner is None else winner.value
    values = [t.value for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    return max(values) if values else None


def run(method: str, seed: int, args: argparse.Namespace) -> dict:
    """One sweep of `method` with the study seed `seed`; its best value and wall time."""
    workdir = os.path.join(args.out, f"{method}-s{seed}")
    spec = os.path.join(args.out, f"{method}.py")
    with open(spec, "w") as f:
        f.write(sweep_file(method, args))
    started = time.monotonic()
    with open(os.path.join(args.out, f"{method}-s{seed}.log"), "w") as log:
        subprocess.run([sys.executable, "-m", "mwloop.sweep", f"--sweep={spec}", f"--workdir={workdir}",
                        f"--seed={seed}", f"--parallel={args.parallel}"], cwd=ROOT, stdout=log,
                       stderr=subprocess.STDOUT, check=True)
    result = {"method": method, "seed": seed, "best": best(workdir, method), "wall_s": time.monotonic() - started}
    print(json.dumps(result), flush=True)
    return result


def summarize(results: list[dict]) -> dict[str, dict]:
    """Per method: mean, spread (sample standard deviation; 0 for one seed), min, max of the best values."""
    summary = {}
    for method in dict.fromkeys(r["method"] for r in results):
        values = [r["best"] for r in results if r["method"] == method and r["best"] is not None]
        summary[method] = {"mean": statistics.mean(values), "stdev": statistics.stdev(values) if len(values) > 1
                           else 0.0, "min": min(values), "max": max(values), "seeds": len(values),
                           "wall_s": statistics.mean(r["wall_s"] for r in results if r["method"] == method)}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--config", default="configs/mlp.py", help="the task, e.g. configs/resnet.py (digits)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--population", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--interval", type=int, default=50)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--methods", default="pbt,random,tpe")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = [run(method, int(seed), args) for seed in args.seeds.split(",") for method in args.methods.split(",")]
    summary = summarize(results)
    with open(os.path.join(args.out, "pbt.json"), "w") as f:
        json.dump({"args": vars(args), "runs": results, "summary": summary}, f, indent=1)
    print(f"{'method':8} {'mean':>7} {'spread':>7} {'min':>7} {'max':>7} {'wall':>7}   "
          f"(best eval/accuracy; {args.population} x {args.steps} steps each)")
    for method, s in summary.items():
        print(f"{method:8} {s['mean']:7.4f} {s['stdev']:7.4f} {s['min']:7.4f} {s['max']:7.4f} {s['wall_s']:6.0f}s")


if __name__ == "__main__":
    main()
