"""Population-based training against random search and TPE on the same total training steps (issue 46's must-show).

  python -m benchmarks.pbt --out=runs/bench_pbt                                  # population 8, 3 seeds (~30 min)
  python -m benchmarks.pbt --out=runs/bench_pbt --seeds=0 --steps=60 --interval=20  # a small run (~5 min loaded)
  python -m benchmarks.pbt --out=runs/bench_pbt_resnet --config=configs/resnet.py   # the digits ResNet

Task: the digits MLP (configs/mlp.py; `--config` another, e.g. the digits ResNet) with a learning rate and a weight
decay to find (log-uniform ranges, the cosine schedule of the config). PBT: POPULATION members of `--steps` steps
cut into `--interval`-step segments, the bottom quarter copying the top quarter (learning rate x 0.8 or 1.25, weight
decay resampled). Random search and TPE: POPULATION trials of `--steps` steps each, no pruning: the same total
steps. The figure is the best held-out eval/accuracy each sweep ends with (PBT: its winner at the last interval; a
search: its best trial), mean and spread over the seeds of the sweep itself (`--seed` of the study), and the lowest
eval/loss of the same trials. Writes OUT/runs.jsonl (a line per sweep) and OUT/pbt.json; `--collect` summarizes
OUT/runs.jsonl again.
"""

from __future__ import annotations

import argparse
import csv
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
    return (head.format(config=args.config, population=args.population, interval=args.interval, sampler=method)
            + SPACE.format(constants=constants))


def _counted(workdir: str, method: str) -> list[optuna.trial.FrozenTrial]:
    """The trials whose scores the sweep in `workdir` ends with: PBT's last interval, a search's complete trials."""
    storage = studies.default_storage(workdir)
    (name,) = optuna.get_all_study_names(storage)
    trials = optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
    if method == "pbt":
        return pbt_report.final_segments(trials)
    return [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]


def best(workdir: str, method: str) -> dict[str, float | None]:
    """The best held-out eval/accuracy the sweep in `workdir` ends with (PBT: its winner), and the lowest eval/loss
    of the same trials (results.csv): on a task where most runs reach the last few examples, the loss still ranks.

    Returns:
      {"best": accuracy, "best_loss": loss}; None where no trial counts.
    """
    counted = _counted(workdir, method)
    with open(os.path.join(workdir, "results.csv")) as f:
        losses = {int(row["trial"]): float(row["eval/loss"]) for row in csv.DictReader(f) if row["eval/loss"]}
    return {"best": max((t.value for t in counted), default=None),
            "best_loss": min((losses[t.number] for t in counted if t.number in losses), default=None)}


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
    result = {"method": method, "seed": seed, **best(workdir, method), "wall_s": time.monotonic() - started}
    print(json.dumps(result), flush=True)
    return result


def summarize(results: list[dict]) -> dict[str, dict]:
    """Per method: mean, spread (sample standard deviation; 0 for one seed), min, max of the best values, the mean
    of the lowest eval/loss, and the mean wall time."""
    summary = {}
    for method in dict.fromkeys(r["method"] for r in results):
        mine = [r for r in results if r["method"] == method]
        values = [r["best"] for r in mine if r["best"] is not None]
        losses = [r["best_loss"] for r in mine if r.get("best_loss") is not None]
        summary[method] = {"mean": statistics.mean(values), "stdev": statistics.stdev(values) if len(values) > 1
                           else 0.0, "min": min(values), "max": max(values), "seeds": len(values),
                           "loss_mean": statistics.mean(losses) if losses else None,
                           "wall_s": statistics.mean(r["wall_s"] for r in mine)}
    return summary


def collect(out: str) -> list[dict]:
    """The finished sweeps of OUT/runs.jsonl, their figures read again from each sweep's study (a run stopped
    between seeds, or one from before a figure was added, still summarizes)."""
    with open(os.path.join(out, "runs.jsonl")) as f:
        runs = [json.loads(line) for line in f if line.strip()]
    return [{**r, **best(os.path.join(out, f"{r['method']}-s{r['seed']}"), r["method"])} for r in runs]


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
    parser.add_argument("--collect", action="store_true", help="run nothing: summarize OUT/runs.jsonl's sweeps")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.collect:
        results = collect(args.out)
    else:
        results = []
        for seed in args.seeds.split(","):
            for method in args.methods.split(","):
                results.append(run(method, int(seed), args))
                with open(os.path.join(args.out, "runs.jsonl"), "a") as f:
                    f.write(json.dumps(results[-1]) + "\n")
    summary = summarize(results)
    with open(os.path.join(args.out, "pbt.json"), "w") as f:
        json.dump({"args": vars(args), "runs": results, "summary": summary}, f, indent=1)
    print(f"{'method':8} {'mean':>7} {'spread':>7} {'min':>7} {'max':>7} {'loss':>7} {'wall':>7}   "
          f"(best eval/accuracy, lowest eval/loss; {args.population} x {args.steps} steps each)")
    for method, s in summary.items():
        loss = f"{s['loss_mean']:7.4f}" if s["loss_mean"] is not None else f"{'-':>7}"
        print(f"{method:8} {s['mean']:7.4f} {s['stdev']:7.4f} {s['min']:7.4f} {s['max']:7.4f} {loss} "
              f"{s['wall_s']:6.0f}s")


if __name__ == "__main__":
    main()
