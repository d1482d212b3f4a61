"""Sweeps on Optuna, measured: search vs grid, pruning's savings, the agent's overhead, a 1,000-trial study.

  python -m benchmarks.sweep_search all --out=runs/bench_sweep      # ~63 short MLP trials + the rest
  python -m benchmarks.sweep_search search --out=... --seeds=0,1,2  # TPE vs grid, TPE + median pruning
  python -m benchmarks.sweep_search overhead --out=...              # asked -> started, exited -> told (ms)
  python -m benchmarks.sweep_search scale --out=...                 # plan + report 1,000 trials, no training

Task: the digits MLP (configs/mlp.py), 200 steps, an eval every 50; learning rate x weight decay. The grid
is 3 x 3 over the ranges; TPE (and TPE + the median pruner) get the same 9-trial budget, over 3 seeds.
Writes OUT/sweep_search.json and OUT/sweep_search.png (best so far vs trials; intermediate values with the
pruned trials marked). Figures: docs/sweeps.md, BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONSTANTS = {"train.steps": 200, "train.log_every_steps": 50, "train.eval_every_steps": 50,
             "train.checkpoint_every_steps": 50, "train.steps_per_loop": 25}
GRID = f'''from mwloop.sweep import product
CONFIG = "configs/mlp.py"
def get_sweep():
    return product({{k: [v] for k, v in {CONSTANTS!r}.items()}},
                   {{"optimizer.learning_rate": [0.001, 0.03, 1.0], "optimizer.weight_decay": [1e-5, 3e-4, 1e-2]}})
'''
SEARCH = f'''CONFIG = "configs/mlp.py"
N_TRIALS = 9
PRUNER_OPTIONS = {{"n_startup_trials": 3}}
def search_space(trial):
    trial.suggest_float("optimizer.learning_rate", 0.001, 1.0, log=True)
    trial.suggest_float("optimizer.weight_decay", 1e-5, 1e-2, log=True)
    return {CONSTANTS!r}
'''


def _sweep(out: str, name: str, body: str, *args: str) -> subprocess.Popen:
    """Starts one study's sweep (rerun: it resumes); its console goes to OUT/<name>.log."""
    path = os.path.join(out, f"{name}.py")
    with open(path, "w") as f:
        f.write(body)
    workdir = os.path.join(out, name)
    return subprocess.Popen([sys.executable, "-m", "mwloop.sweep", f"--sweep={path}", f"--workdir={workdir}", *args],
                            cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                            stderr=open(os.path.join(out, f"{name}.log"), "a"))


def _trials(workdir: str) -> list[dict]:
    """Each shown trial in the order it started: value, state, steps trained, intermediate values."""
    import optuna

    from mwloop.sweep import study as studies
    from mwloop.sweep.report import read_events
    storage = studies.default_storage(workdir)
    (name,) = optuna.get_all_study_names(storage)
    trials = sorted(studies.shown(optuna.load_study(study_name=name, storage=storage).trials),
                    key=lambda t: t.datetime_start)
    rows = []
    for t in trials:
        events = read_events(os.path.join(workdir, t.user_attrs["mwloop:name"]))
        steps = max((e["step"] for e in events if e["split"] == "train"), default=0)
        rows.append({"number": t.number, "state": t.state.name, "value": t.value, "steps": steps,
                     "intermediate": sorted(t.intermediate_values.items())})
    return rows


def _best_so_far(rows: list[dict]) -> list[float]:
    best, curve = float("-inf"), []
    for row in rows:
        if row["state"] == "COMPLETE" and row["value"] is not None:
            best = max(best, row["value"])
        curve.append(best)
    return curve


def search(out: str, seeds: list[int], parallel: int) -> dict:
    """Grid vs TPE vs TPE + median pruning, 9 trials each; the studies run side by side (one agent each, unless
    `parallel`), so the startup of one trial's TensorFlow overlaps another's training."""
    studies = {"grid": _sweep(out, "grid", GRID, f"--parallel={parallel}")}
    for seed in seeds:
        for pruner in ("none", "median"):
            studies[f"tpe_{pruner}_{seed}"] = _sweep(out, f"tpe_{pruner}_{seed}", SEARCH, f"--seed={seed}",
                                                     f"--pruner={pruner}", f"--parallel={parallel}")
    for name, process in studies.items():
        if process.wait():
            raise SystemExit(f"study {name} failed: see {os.path.join(out, name + '.log')}")
    results = {name: _trials(os.path.join(out, name)) for name in studies}
    summary = {}
    for kind in ("grid", "tpe_none", "tpe_median"):
        runs = [rows for key, rows in results.items() if key == kind or key.startswith(kind + "_")]
        curves = [_best_so_far(rows) for rows in runs]
        summary[kind] = {
            "best": [c[-1] for c in curves], "best_mean": statistics.mean(c[-1] for c in curves),
            "curve_mean": [statistics.mean(c[i] for c in curves) for i in range(len(curves[0]))],
            "steps": [sum(r["steps"] for r in rows) for rows in runs],
            "pruned": [sum(r["state"] == "PRUNED" for r in rows) for rows in runs]}
    grid_best = summary["grid"]["best_mean"]
    summary["tpe_none"]["trials_to_grid_best"] = [
        next((i + 1 for i, v in enumerate(_best_so_far(results[f"tpe_none_{s}"])) if v >= grid_best), None)
        for s in seeds]
    saved = 1 - statistics.mean(summary["tpe_median"]["steps"]) / statistics.mean(summary["tpe_none"]["steps"])
    summary["pruning_saved_steps_fraction"] = saved
    _plot(out, results, summary, seeds)
    return {"runs": results, "summary": summary}


def _plot(out: str, results: dict, summary: dict, seeds: list[int]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for kind, label in (("grid", "grid 3x3"), ("tpe_none", f"TPE (mean of {len(seeds)} seeds)"),
                        ("tpe_median", "TPE + median pruner")):
        curve = summary[kind]["curve_mean"]
        left.plot(range(1, len(curve) + 1), curve, "o-", label=label)
    left.set_xlabel("trials")
    left.set_ylabel("best eval/accuracy so far")
    left.set_title("Search vs grid, same budget")
    left.grid(alpha=0.3)
    left.legend()
    rows = results[f"tpe_median_{seeds[0]}"]
    for row in rows:
        steps, values = zip(*row["intermediate"]) if row["intermediate"] else ((), ())
        line, = right.plot(steps, values, "-" if row["state"] == "COMPLETE" else "--")
        if row["state"] == "PRUNED" and steps:
            right.plot(steps[-1], values[-1], "x", color=line.get_color(), markersize=10)
    right.set_xlabel("step")
    right.set_ylabel("eval/accuracy (intermediate values)")
    right.set_title(f"TPE + median pruner, seed {seeds[0]} (x: pruned)")
    right.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "sweep_search.png"), dpi=100)


def overhead(out: str) -> dict:
    """The agent's own time per trial, in this process: asked -> training process started, exited -> told."""
    from mwloop.sweep import agent as agents
    from mwloop.sweep import local
    workdir = os.path.join(out, "overhead")
    created = local.create_sweep(sweep_spec=os.path.join(ROOT, "experiments", "mlp_smoke.py"), sweep_dir=workdir,
                                 config_spec=os.path.join(ROOT, "configs", "mlp.py"))
    agent, study = local._agent(created, os.path.join(ROOT, "configs", "mlp.py"), 1,
                                lambda study, line: None, threading.Event(), 0)
    agents.run(agent, study)
    return {key: [round(t[key], 1) for t in agent.timings] for key in agent.timings[0]}


def scale(out: str, n: int = 1000) -> dict:
    """Planning (create: probe + checks + study) and reporting (results.csv/md/png + HParams) a study of `n`
    finished trials with fake metrics.jsonl files: no training."""
    import optuna
    from optuna.distributions import FloatDistribution

    from mwloop.sweep import local, results
    from mwloop.sweep import study as studies
    sweep_file = os.path.join(out, "scale_search.py")
    with open(sweep_file, "w") as f:
        f.write(SEARCH.replace("N_TRIALS = 9", f"N_TRIALS = {n}"))
    workdir = os.path.join(out, "scale")
    start = time.perf_counter()
    created = local.create_sweep(sweep_spec=sweep_file, sweep_dir=workdir)
    plan_s = time.perf_counter() - start
    study = optuna.load_study(study_name=created.name, storage=created.storage)
    distributions = {"optimizer.learning_rate": FloatDistribution(0.001, 1.0, log=True),
                     "optimizer.weight_decay": FloatDistribution(1e-5, 1e-2, log=True)}
    start = time.perf_counter()
    trials = []
    for i in range(n):
        params = {"optimizer.learning_rate": 0.001 * 1000 ** (i / n), "optimizer.weight_decay": 1e-5 * 1000 ** (
            ((i * 7) % n) / n)}
        name = f"trial-{i:04d}"
        os.makedirs(os.path.join(workdir, name), exist_ok=True)
        value = 0.5 + 0.4 * (i % 97) / 97
        with open(os.path.join(workdir, name, "metrics.jsonl"), "w") as f:
            for step in (50, 100, 150, 200):
                f.write(json.dumps({"step": step, "split": "train", "loss": 1.0 / step}) + "\n")
                f.write(json.dumps({"step": step, "split": "eval", "accuracy": value * step / 200}) + "\n")
        trials.append(optuna.trial.create_trial(
            params=params, distributions=distributions, value=value,
            intermediate_values={s: value * s / 200 for s in (50, 100, 150, 200)},
            user_attrs={"mwloop:name": name, "mwloop:overrides": json.dumps({**params, **CONSTANTS}),
                        "mwloop:wall_s": 10.0}))
    study.add_trials(trials)
    store_s = time.perf_counter() - start
    writer = results.Results(workdir, created.settings, "scale")
    start = time.perf_counter()
    writer.write(studies.all_trials(study), final=False)
    report_s = time.perf_counter() - start
    start = time.perf_counter()
    writer.write(studies.all_trials(study), final=False)  # the write after each trial event: events cached
    rewrite_s = time.perf_counter() - start
    start = time.perf_counter()
    writer.write(studies.all_trials(study), final=True)
    final_s = time.perf_counter() - start
    return {"trials": n, "plan_s": round(plan_s, 2), "store_fake_trials_s": round(store_s, 2),
            "report_tables_s": round(report_s, 2), "rewrite_tables_s": round(rewrite_s, 2),
            "report_final_with_png_hparams_s": round(final_s, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["all", "search", "overhead", "scale"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--parallel", type=int, default=1)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    figures = {}
    if args.what in ("all", "overhead"):
        figures["overhead_ms"] = overhead(args.out)
        print(json.dumps(figures["overhead_ms"]), flush=True)
    if args.what in ("all", "scale"):
        figures["scale"] = scale(args.out)
        print(json.dumps(figures["scale"]), flush=True)
    if args.what in ("all", "search"):
        figures["search"] = search(args.out, [int(s) for s in args.seeds.split(",")], args.parallel)
        print(json.dumps(figures["search"]["summary"], indent=1), flush=True)
    with open(os.path.join(args.out, f"sweep_search_{args.what}.json"), "w") as f:
        json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
