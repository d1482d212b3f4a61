"""Sweeps on Optuna, measured: search vs grid, pruning's savings, the agent's overhead, a 1,000-trial study.

  python -m benchmarks.sweep_search all --out=runs/bench_sweep      # ~430 short MLP runs (~1 h, 2 cores) + the rest
  python -m benchmarks.sweep_search search --out=... --seeds=0,1,2  # TPE vs grid (9 trials each)
  python -m benchmarks.sweep_search prune --out=... --seeds=0,1,2   # TPE alone, + 2 ASHAs, + median (30 trials)
  python -m benchmarks.sweep_search overhead --out=...              # asked -> started, exited -> told (ms)
  python -m benchmarks.sweep_search scale --out=...                 # plan + report 1,000 trials, no training
  python -m benchmarks.sweep_search summarize --out=...             # the figures and the plot again

Task: the digits MLP (configs/mlp.py); learning rate x weight decay over the same log-uniform ranges.
- search: 200 steps, an eval every 50; a 3 x 3 grid over the ranges against TPE with the same 9-trial budget.
- prune: the study a practitioner would prune: 30 trials of 500 steps, an eval every 25 (20 intermediate
  values), TPE with the same seed with no pruner, ASHA (min_resource 25 steps, reduction factor 3: rungs at
  steps 25, 75, 225), ASHA with later rungs (100, 300) and the median pruner (5 start-up trials, no pruning
  before step 100). Steps trained are read from each trial's metrics.jsonl and checkpoints (a pruned trial's
  steps are those it really ran); each study's best config is then retrained with 3 other seeds.
Studies run one agent each, `--concurrent` at a time (default 2). Writes OUT/sweep_search_<what>.json and
OUT/sweep_search.png (best so far vs trials and vs steps trained; intermediate values with the pruned trials
marked). Figures: docs/sweeps.md, BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time

from benchmarks.sweep_search_plot import best_so_far, plot

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
PRUNER = "none"
def search_space(trial):
    trial.suggest_float("optimizer.learning_rate", 0.001, 1.0, log=True)
    trial.suggest_float("optimizer.weight_decay", 1e-5, 1e-2, log=True)
    return {CONSTANTS!r}
'''
PRUNE_TRIALS = 30
PRUNE_CONSTANTS = {"train.steps": 500, "train.log_every_steps": 25, "train.eval_every_steps": 25,
                   "train.checkpoint_every_steps": 100, "train.steps_per_loop": 25}
PRUNERS = {  # variant: (PRUNER, PRUNER_OPTIONS) as a practitioner would set them for 20 evals of 25 steps
    "none": ("none", {}),
    "asha": ("asha", {"min_resource": 25, "reduction_factor": 3}),  # rungs at steps 25, 75, 225: top third on
    "asha100": ("asha", {"min_resource": 100, "reduction_factor": 3}),  # rungs at steps 100, 300
    "median": ("median", {"n_startup_trials": 5, "n_warmup_steps": 100}),  # below the median at its step, from 100
}
PRUNE = '''CONFIG = "configs/mlp.py"
N_TRIALS = {n_trials}
PRUNER = {pruner!r}
PRUNER_OPTIONS = {options!r}
def search_space(trial):
    trial.suggest_float("optimizer.learning_rate", 0.001, 1.0, log=True)
    trial.suggest_float("optimizer.weight_decay", 1e-5, 1e-2, log=True)
    return {constants!r}
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


def _run_studies(out: str, studies: list[tuple[str, str, list[str]]], concurrent: int) -> dict[str, float]:
    """Runs the studies (name, sweep file body, flags) in order, `concurrent` at a time; returns each one's
    wall time (s). A study that fails stops the benchmark with its log's name."""
    pending, running, wall_s = list(studies), {}, {}
    while pending or running:
        while pending and len(running) < concurrent:
            name, body, args = pending.pop(0)
            running[name] = (_sweep(out, name, body, *args), time.perf_counter())
            print(f"{time.strftime('%H:%M:%S')} study {name} started", flush=True)
        time.sleep(1)
        for name, (process, start) in list(running.items()):
            if process.poll() is None:
                continue
            del running[name]
            if process.returncode:
                raise SystemExit(f"study {name} failed: see {os.path.join(out, name + '.log')}")
            wall_s[name] = round(time.perf_counter() - start, 1)
            print(f"{time.strftime('%H:%M:%S')} study {name} done in {wall_s[name]:.0f}s", flush=True)
    return wall_s


def _trials(workdir: str) -> list[dict]:
    """Each shown trial in the order it started: value, state, steps trained, intermediate values, wall time.

    Steps trained: the last train step in its metrics.jsonl or its newest checkpoint, whichever is later (a
    pruned trial trains on until its SIGTERM lands, and saves there): what it really ran, not train.steps."""
    import optuna

    from mwloop.artifacts import files
    from mwloop.sweep import study as studies
    storage = studies.default_storage(workdir)
    (name,) = optuna.get_all_study_names(storage)
    finished = [t for t in studies.shown(optuna.load_study(study_name=name, storage=storage).trials)
                if t.state.is_finished()]
    trials = sorted(finished, key=lambda t: t.datetime_start)
    log = os.path.join(os.path.dirname(workdir), os.path.basename(workdir) + ".log")  # the sweep's console
    decided = {}  # trial number -> the step at which the pruner said stop (the agent's console line)
    if os.path.exists(log):
        with open(log) as f:
            decided = {int(m[1]): int(m[2]) for m in re.finditer(r"trial (\d+) pruned at step (\d+)", f.read())}
    rows = []
    for t in trials:
        trial_dir = os.path.join(workdir, t.user_attrs["mwloop:name"])
        events = files.read_metrics(trial_dir)
        steps = max([e["step"] for e in events if e["split"] == "train"]
                    + [files.newest_checkpoint_step(trial_dir) or 0])
        rows.append({"number": t.number, "state": t.state.name, "value": t.value, "steps": steps,
                     "decided": decided.get(t.number) if t.state.name == "PRUNED" else None,
                     "wall_s": t.user_attrs.get("mwloop:wall_s"), "params": t.params,
                     "command": t.user_attrs.get("mwloop:command"),
                     "intermediate": sorted(t.intermediate_values.items())})
    return rows


def _finished(out: str, names: list[str]) -> dict[str, list[dict]]:
    """The complete and pruned trials of each study in OUT that exists, cut to the first K of each (K = the
    fewest any of them finished: all of them after a full run)."""
    results = {name: [r for r in _trials(os.path.join(out, name)) if r["state"] in ("COMPLETE", "PRUNED")]
               for name in names if os.path.exists(os.path.join(out, name, "study.db"))}
    if not results:
        return {}
    k = min(len(rows) for rows in results.values())
    return {name: rows[:k] for name, rows in results.items()}


def search(out: str, seeds: list[int], concurrent: int) -> dict:
    """Grid vs TPE, 9 trials each, one agent per study."""
    studies = [("grid", GRID, [])] + [(f"tpe_none_{seed}", SEARCH, [f"--seed={seed}"]) for seed in seeds]
    wall_s = _run_studies(out, studies, concurrent)
    return {**summarize_search(out, seeds), "wall_s": wall_s}


def summarize_search(out: str, seeds: list[int]) -> dict:
    results = _finished(out, ["grid"] + [f"tpe_none_{s}" for s in seeds])
    if not results:
        return {}
    summary = {"trials_per_study": len(results["grid"])}
    for kind in ("grid", "tpe_none"):
        runs = [rows for key, rows in results.items() if key == kind or key.startswith(kind + "_")]
        curves = [best_so_far(rows) for rows in runs]
        summary[kind] = {
            "best": [c[-1] for c in curves], "best_mean": statistics.mean(c[-1] for c in curves),
            "curve_mean": [statistics.mean(c[i] for c in curves) for i in range(len(curves[0]))],
            "steps": [sum(r["steps"] for r in rows) for rows in runs]}
    grid_best = summary["grid"]["best_mean"]
    summary["tpe_none"]["trials_to_grid_best"] = [  # None: not reached within the budget
        next((i + 1 for i, v in enumerate(best_so_far(results[f"tpe_none_{s}"])) if v >= grid_best), None)
        for s in seeds]
    return {"runs": results, "summary": summary}


def prune(out: str, seeds: list[int], concurrent: int, pruners: list[str]) -> dict:
    """TPE with the same seed and budget, with no pruner and with each of `pruners`: seed by seed, so a run cut
    short still has whole seeds."""
    studies = []
    for seed in seeds:
        for pruner in ["none", *pruners]:
            body = PRUNE.format(n_trials=PRUNE_TRIALS, pruner=PRUNERS[pruner][0], options=PRUNERS[pruner][1],
                                constants=PRUNE_CONSTANTS)
            studies.append((f"prune_{pruner}_{seed}", body, [f"--seed={seed}"]))
    wall_s = _run_studies(out, studies, concurrent)
    return {**summarize_prune(out, seeds, pruners), "wall_s": wall_s}


def summarize_prune(out: str, seeds: list[int], pruners: list[str]) -> dict:
    """Per pruner and seed: best, steps trained, trials pruned, the best config retrained with 3 other seeds
    (`rerun_best`, run here when not run yet); steps saved against no pruner, over the seeds every study of
    which finished."""
    names = [f"prune_{p}_{s}" for s in seeds for p in ["none", *pruners]]
    results = _finished(out, names)
    seeds = [s for s in seeds if all(f"prune_{p}_{s}" in results for p in ["none", *pruners])]
    if not seeds:
        return {}
    summary = {"trials_per_study": len(results[f"prune_none_{seeds[0]}"]), "seeds": seeds,
               "planned_steps_per_study": len(results[f"prune_none_{seeds[0]}"]) * PRUNE_CONSTANTS["train.steps"]}
    for pruner in ["none", *pruners]:
        runs = [results[f"prune_{pruner}_{s}"] for s in seeds]
        steps = [sum(r["steps"] for r in rows) for rows in runs]
        summary[pruner] = {
            "pruner": PRUNERS[pruner][0], "options": PRUNERS[pruner][1],
            "best": [best_so_far(rows)[-1] for rows in runs],
            "steps": steps, "steps_mean": statistics.mean(steps),
            # what the trials would have trained had each stopped at the eval the pruner judged (a trial whose
            # eval interval is long against the agent's 0.1 s poll); the MLP trains 25 steps in ~10-30 ms
            "steps_at_decisions": [sum(r["decided"] or r["steps"] for r in rows) for rows in runs],
            "pruned": [sum(r["state"] == "PRUNED" for r in rows) for rows in runs],
            "trial_wall_s": [round(sum(r["wall_s"] or 0 for r in rows), 1) for rows in runs]}
        summary[pruner]["best_mean"] = statistics.mean(summary[pruner]["best"])
    reruns = rerun_best(out, [f"prune_{p}_{s}" for s in seeds for p in ["none", *pruners]])
    for pruner in ["none", *pruners]:
        per_seed = [statistics.mean(reruns[f"prune_{pruner}_{s}"]) for s in seeds]
        summary[pruner]["best_rerun_mean"] = [round(v, 4) for v in per_seed]  # the best config, seeds 1-3
        summary[pruner]["best_rerun_mean_over_seeds"] = statistics.mean(per_seed)
    for pruner in pruners:
        summary[pruner]["saved_steps_fraction"] = 1 - summary[pruner]["steps_mean"] / summary["none"]["steps_mean"]
        summary[pruner]["saved_steps_fraction_per_seed"] = [
            round(1 - p / n, 3) for p, n in zip(summary[pruner]["steps"], summary["none"]["steps"])]
        summary[pruner]["best_minus_unpruned"] = [
            round(p - n, 4) for p, n in zip(summary[pruner]["best"], summary["none"]["best"])]
    return {"runs": results, "summary": summary}


def rerun_best(out: str, names: list[str], train_seeds: tuple[int, ...] = (1, 2, 3), concurrent: int = 2) -> dict:
    """The best complete trial of each study trained again with other training seeds (`config.seed`: weights and
    data order; the study's trials used seed 0): its mean eval/accuracy is the chosen config's quality without
    the luck that made it the best of many noisy evals. Runs in OUT/rerun/<study>/seed=<k>; a rerun of this
    benchmark reuses finished ones."""
    from mwloop.artifacts import files
    jobs = []
    for name in names:
        best = max((r for r in _trials(os.path.join(out, name)) if r["state"] == "COMPLETE"), key=lambda r: r["value"])
        for seed in train_seeds:
            workdir = os.path.join(out, "rerun", name, f"seed={seed}")
            args = shlex.split(best["command"])
            args = [sys.executable] + [f"--workdir={workdir}" if a.startswith("--workdir=") else a for a in args[1:]]
            jobs.append((name, workdir, args + [f"--config.seed={seed}"]))
    running: list[subprocess.Popen] = []
    for name, workdir, args in jobs:
        if os.path.exists(os.path.join(workdir, "done")):
            continue
        while len(running) >= concurrent:
            running = [p for p in running if p.poll() is None]
            time.sleep(0.5)
        shutil.rmtree(workdir, ignore_errors=True)
        os.makedirs(workdir)
        running.append(subprocess.Popen(f"{shlex.join(args)} > {workdir}/log.txt 2>&1 && touch {workdir}/done",
                                        shell=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT)))
    for process in running:
        process.wait()
    reruns: dict[str, list[float]] = {}
    for name, workdir, _ in jobs:
        if not os.path.exists(os.path.join(workdir, "done")):
            raise SystemExit(f"rerun of {name}'s best trial failed: see {workdir}/log.txt")
        evals = [e["accuracy"] for e in files.read_metrics(workdir) if e["split"] == "eval"]
        reruns.setdefault(name, []).append(evals[-1])
    return reruns


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
    parser.add_argument("what", choices=["all", "search", "prune", "summarize", "overhead", "scale"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--pruners", default="asha,asha100,median", help="compared with no pruner in `prune`")
    parser.add_argument("--concurrent", type=int, default=2, help="studies run at once (one agent each)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    seeds, pruners = [int(s) for s in args.seeds.split(",")], args.pruners.split(",")
    figures = {}
    if args.what in ("all", "overhead"):
        figures["overhead_ms"] = overhead(args.out)
        print(json.dumps(figures["overhead_ms"]), flush=True)
    if args.what in ("all", "scale"):
        figures["scale"] = scale(args.out)
        print(json.dumps(figures["scale"]), flush=True)
    if args.what in ("all", "prune"):
        figures["prune"] = prune(args.out, seeds, args.concurrent, pruners)
    if args.what in ("all", "search"):
        figures["search"] = search(args.out, seeds, args.concurrent)
    if args.what == "summarize":
        figures["search"] = summarize_search(args.out, seeds)
        figures["prune"] = summarize_prune(args.out, seeds, pruners)
    for kind in ("search", "prune"):
        if figures.get(kind):
            print(json.dumps({kind: figures[kind]["summary"]}, indent=1), flush=True)
    if args.what in ("all", "search", "prune", "summarize"):
        plot(args.out, figures.get("search") or summarize_search(args.out, seeds),
             figures.get("prune") or summarize_prune(args.out, seeds, pruners), pruners)
    with open(os.path.join(args.out, f"sweep_search_{args.what}.json"), "w") as f:
        json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
