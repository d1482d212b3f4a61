"""Searches on Optuna: bad input in one line before any training, pruning through metrics.jsonl (one-worker and
two-worker trials), and the agent's budget. Real studies on SQLite; trials are seconds-long MLP runs. Ctrl-C and
a rerun that resumes, and a stuck trial: tests/test_sweep_stops.py."""

from __future__ import annotations

import csv
import dataclasses
import glob
import os
import re
import socket
import subprocess
import sys

import optuna
import pytest
from optuna.trial import TrialState

from helpers import ROOT
from mwloop import sweep
from mwloop.artifacts import files
from mwloop.sweep import space
from mwloop.sweep import study as studies
from tests import warm_main

ENV = dict(os.environ, PYTHONPATH=ROOT)


def sweep_cli(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mwloop.sweep", *args], cwd=ROOT, env=warm_main.serving(ENV),
                          capture_output=True, text=True, timeout=600, **kwargs)


def write(tmp_path, body: str, name: str = "my_search.py") -> str:
    path = tmp_path / name
    path.write_text('CONFIG = "configs/mlp.py"\n' + body)
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_study(workdir: str) -> optuna.Study:
    (name,) = optuna.get_all_study_names(studies.default_storage(workdir))
    return optuna.load_study(study_name=name, storage=studies.default_storage(workdir))


# ---------------------------------------------------------------------------- bad input, before any training

LR = 'trial.suggest_float("optimizer.learning_rate", 0.01, 1.0, log=True)'
SEARCH = f"def search_space(trial):\n    {LR}\n"


@pytest.mark.parametrize("body, args, message", [
    ('def search_space(trial):\n    trial.suggest_float("optimizer.learnin_rate", 0.01, 1.0)\n', {},
     "unknown config key 'optimizer.learnin_rate' (did you mean 'optimizer.learning_rate'?)"),
    ('def search_space(trial):\n    if trial.suggest_categorical("optimizer.name", ["sgd", "adam"]) == "adam":\n'
     '        trial.suggest_int("optimizer.nesterov", 0, 1)\n', {},  # a conditional branch: found by sampling
     "optimizer.nesterov=1 is a int but the config field is bool (False)"),
    ('def search_space(trial):\n    trial.suggest_float("train.steps", 10, 100)\n', {},
     "is a float but the config field is int (200)"),
    (SEARCH, {"sampler": "tpee"}, "unknown sampler 'tpee'; use one of tpe, random, cmaes, grid"),
    (SEARCH + 'PRUNER = "asa"\n', {}, "unknown pruner 'asa'; use one of median, asha, successive_halving"),
    (SEARCH + "N_TRIALS = 0\n", {}, "n_trials must be an integer >= 1, got 0"),
    (SEARCH + 'def get_sweep():\n    return [{"seed": 1}]\n', {},
     "defines both get_sweep() (a grid) and search_space(trial) (a search); keep one"),
    ('N_TRIALS = 5\ndef get_sweep():\n    return [{"seed": 1}]\n', {},
     "N_TRIALS is for search_space(trial) files; a grid from get_sweep() runs each of its 1 points once"),
    (SEARCH, {"storage_url": "postgresql://mwloop:secret@127.0.0.1:{port}/sweeps"},
     "storage postgresql+psycopg2://mwloop:***@127.0.0.1:{port}/sweeps does not answer: connection to server at "
     '"127.0.0.1", port {port} failed: Connection refused'),
])
def test_bad_input_is_one_line_before_any_training(tmp_path, body, args, message):
    port = free_port()
    args = {k: v.format(port=port) for k, v in args.items()}
    workdir = tmp_path / "sweep"
    with pytest.raises(sweep.SweepError) as raised:
        sweep.create_sweep(sweep_spec=write(tmp_path, body), sweep_dir=str(workdir), **args)
    assert message.format(port=port) in str(raised.value) and "\n" not in str(raised.value)
    assert not workdir.exists()  # nothing written, nothing trained


@pytest.mark.slow
def test_bad_input_exits_2_with_one_line_and_no_traceback(tmp_path):
    result = sweep_cli(f"--sweep={write(tmp_path, SEARCH)}", f"--workdir={tmp_path / 'sweep'}", "--pruner=asa")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: unknown pruner 'asa'; use one of median, asha, successive_halving, hyperband, none"]


@pytest.mark.slow
def test_a_study_that_exists_with_another_metric_or_direction_is_refused(tmp_path):
    spec, workdir = write(tmp_path, SEARCH), str(tmp_path / "sweep")
    sweep.create_sweep(sweep_spec=spec, sweep_dir=workdir)
    with pytest.raises(sweep.SweepError, match=r"study 'my_search' exists and ranks by eval/accuracy \(max\); this "
                                               r"sweep ranks by eval/loss \(min\): use another --study"):
        sweep.create_sweep(sweep_spec=spec, sweep_dir=workdir, metric="eval/loss")
    with pytest.raises(sweep.SweepError, match="ranks by eval/accuracy \\(max\\); this sweep ranks by eval/accuracy "
                                               "\\(min\\)"):
        sweep.create_sweep(sweep_spec=spec, sweep_dir=workdir, mode="min")
    with pytest.raises(sweep.SweepError, match=r"no study 'other' in sqlite:///.* \(it holds 'my_search'\): pass "
                                               r"one with --study, or create it first"):
        sweep.run_agent(sweep_spec=spec, sweep_dir=workdir, study_name="other",
                        storage_url=studies.default_storage(workdir))


def test_no_study_names_the_studies_its_storage_holds(tmp_path):
    """A misspelt --study, or a default name (FILE-ARG) that is not the one created: the message lists what the
    storage holds, so the right name is one copy away."""
    url = f"sqlite:///{tmp_path / 'study.db'}"
    storage = studies.open_storage(url, None)
    with pytest.raises(sweep.SweepError, match=r"^no study 'resnet_search' in sqlite:///.*study.db \(it holds no "
                                               r"study\): pass one with --study, or create it first \(python -m "
                                               r"mwloop.sweep create .* --study=resnet_search --storage=...\)$"):
        studies.load(storage, "resnet_search", storage_url=url)
    for name in ("resnet_search-short", "mlp_search"):
        optuna.create_study(storage=storage, study_name=name)
    with pytest.raises(sweep.SweepError, match=r"^no study 'resnet_search' in sqlite:///.*study.db \(it holds "
                                               r"'mlp_search', 'resnet_search-short'\): pass one with --study"):
        studies.load(storage, "resnet_search", storage_url=url)
    assert studies.default_study_name("experiments/resnet_search.py:short") == "resnet_search-short"  # as documented
    assert studies.default_study_name("experiments/resnet_search.py") == "resnet_search"


def test_shipped_search_files_check_against_their_configs():
    for name, n_trials in (("resnet_search.py", 9), ("resnet_search.py:short", 9), ("mlp_search.py", 6),
                           ("mlp_prune.py", 30)):
        loaded = space.load_sweep(os.path.join(ROOT, "experiments", name))
        samples = space.check(loaded, os.path.join(ROOT, loaded.config))
        assert loaded.kind == "search" and loaded.n_trials == n_trials and len(samples) > 1
        assert all("optimizer.learning_rate" in s and "_decay" not in s for s in samples)  # helpers are no keys


def test_trial_directories_are_a_stable_function_of_the_parameters():
    overrides = {"optimizer.learning_rate": 0.012345678, "optimizer.name": "sgd", "train.steps": 60}
    name = sweep.plan.search_name(overrides, ["optimizer.learning_rate", "optimizer.name"])
    assert name.startswith("learning_rate=0.0123,name=sgd-") and len(name.rsplit("-", 1)[1]) == 8
    assert sweep.plan.search_name(dict(reversed(overrides.items())), ["optimizer.learning_rate", "optimizer.name"]) \
        == name
    assert sweep.plan.search_name({**overrides, "train.steps": 61}, ["optimizer.learning_rate"]) != name


def _pruner_settings(pruner: str, options: dict) -> studies.Settings:
    return studies.Settings(kind="search", sweep="s.py", config="configs/mlp.py", metric="eval/accuracy", mode="max",
                            n_trials=9, sampler="tpe", sampler_options={}, pruner=pruner, pruner_options=options,
                            prune_by="step", seed=0)


def test_asha_starts_its_rungs_at_the_first_eval_and_prunes_before_any_trial_completes():
    """PRUNER = "asha" without min_resource: rungs at the first eval's step x 3^k (25, 75, 225), one per step.
    Optuna's 'auto' would prune nothing until a trial completed, then judge rungs at steps 5 and 20 both on the
    eval at step 25."""
    study = optuna.create_study(direction="maximize",
                                pruner=studies.make_pruner(_pruner_settings("asha", {"reduction_factor": 3})))
    first = study.ask()
    rungs = {}
    for step, value in ((25, 0.8), (50, 0.85), (75, 0.9)):
        first.report(value, step)
        assert not first.should_prune()
        rungs[step] = sorted(k for k in study.trials[0].system_attrs if k.startswith("completed_rung_"))
    assert rungs == {25: ["completed_rung_0"], 50: ["completed_rung_0"], 75: ["completed_rung_0", "completed_rung_1"]}
    second = study.ask()
    second.report(0.7, 25)
    assert second.should_prune()  # behind the other trial at the first rung, though no trial has completed
    third = study.ask()
    third.report(0.95, 25)
    assert not third.should_prune()
    with pytest.raises(TypeError, match="n_startup_trials"):  # the median's options on ASHA: refused when planned
        studies.make_pruner(_pruner_settings("asha", {"n_startup_trials": 3}))
    assert isinstance(studies.make_pruner(_pruner_settings("asha", {"min_resource": "auto"})),
                      optuna.pruners.SuccessiveHalvingPruner)  # asked for by name: Optuna's own


@pytest.mark.slow
def test_the_sweep_never_imports_tensorflow_and_training_never_imports_optuna():
    probe = ("import sys, mwloop.sweep.local, mwloop.sweep.agent, mwloop.sweep.results; "
             "assert 'tensorflow' not in sys.modules, 'tensorflow'")
    subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=ENV, check=True, timeout=120)
    outside = [path for path in glob.glob(os.path.join(ROOT, "mwloop", "**", "*.py"), recursive=True)
               if os.sep + "sweep" + os.sep not in path and "optuna" in open(path).read()]
    assert outside == []


# ---------------------------------------------------------------------------- pruning

# Seed 3 of the grid sampler runs 0.2, then 0.5, then 1e-5: two trials set the median, the third is far below it
# at its first eval and is pruned there.
PRUNED_SEARCH = """
SAMPLER = "grid"
PRUNER = "median"
PRUNER_OPTIONS = {"n_startup_trials": 2}

def search_space(trial):
    trial.suggest_categorical("optimizer.learning_rate", [0.5, 0.2, 1e-5])
    # One step per loop call: the bad trial is still training when the agent's SIGTERM reaches it.
    return {"train.steps": 200, "train.log_every_steps": 20, "train.eval_every_steps": 20,
            "train.checkpoint_every_steps": 20, "train.steps_per_loop": 1}
"""


@pytest.mark.slow
def test_search_prunes_a_bad_trial_through_its_metrics_and_keeps_its_checkpoint(tmp_path):
    workdir = str(tmp_path / "sweep")
    result = sweep_cli(f"--sweep={write(tmp_path, PRUNED_SEARCH)}", f"--workdir={workdir}", "--seed=3")
    assert result.returncode == 0, result.stderr
    assert "tensorflow" not in result.stderr.lower()  # no TensorFlow start-up lines in the sweep's console
    trials = load_study(workdir).trials
    assert [(t.params["optimizer.learning_rate"], t.state) for t in trials] == [
        (0.2, TrialState.COMPLETE), (0.5, TrialState.COMPLETE), (1e-5, TrialState.PRUNED)]
    assert sorted(trials[0].intermediate_values) == list(range(20, 201, 20))  # every eval, at its step
    assert min(trials[2].intermediate_values) == 20  # (an eval or two more may land before SIGTERM does)
    assert "trial 2 pruned at step 20 (eval/accuracy" in result.stderr
    pruned = os.path.join(workdir, trials[2].user_attrs["mwloop:name"])
    saved = files.newest_checkpoint_step(pruned)
    assert saved is not None and 20 <= saved < 200  # saved on SIGTERM, kept

    with open(os.path.join(workdir, "results.csv")) as f:
        rows = list(csv.DictReader(f))
    assert [(r["trial"], r["status"]) for r in rows] == [("1", "complete"), ("0", "complete"), ("2", "pruned")]
    assert int(rows[2]["steps"]) < 200 and float(rows[0]["eval/accuracy"]) > float(rows[1]["eval/accuracy"])
    with open(os.path.join(workdir, "results.md")) as f:
        markdown = f.read()
    assert "3 trials: 2 complete, 1 pruned, 0 failed. Ranked by eval/accuracy (max)." in markdown
    assert "| # | trial | learning_rate | status | steps |" in markdown
    assert "| 3 | 2 | 1e-05 | pruned |" in markdown
    assert f"--workdir={os.path.join(workdir, trials[1].user_attrs['mwloop:name'])} " in markdown  # best's command
    assert os.path.getsize(os.path.join(workdir, "results.png")) > 10_000


class _PruneAtOnce(optuna.pruners.BasePruner):
    def prune(self, study, trial):
        return True


def test_a_pruned_trials_line_gives_the_value_of_the_eval_that_pruned_it(tmp_path):
    """The stop lands after the run's loop call, so a fast trial writes an eval or two more before it exits; the
    line names the step of the eval that pruned it and must give that eval's value, not the last one's (it once
    said `pruned at step 30 (eval/recall_at_1 0.6580)` while step 30's value was 0.484)."""
    from mwloop.sweep import agent as agents
    settings = dataclasses.replace(_pruner_settings("none", {}), metric="eval/recall_at_1")
    sweep_file = space.SweepFile(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(space.Choices)},
                                 spec="s.py", points=None, space=None)
    lines = []
    agent = agents.Agent(sweep_file, settings, str(tmp_path), "configs/mlp.py", None,
                         on_event=lambda study, line: lines.append(line))
    study = optuna.create_study(direction="maximize", pruner=_PruneAtOnce())
    workdir = tmp_path / "trial"
    workdir.mkdir()
    run = agents.TrialRun(study.ask(), str(workdir), [], settings.metric, 1, files.MetricsTail(str(workdir)))
    metrics = workdir / files.METRICS
    metrics.write_text('{"step": 30, "split": "eval", "recall_at_1": 0.484}\n')
    agents.report_new(run)
    assert run.pruned_at == 30
    with open(metrics, "a") as f:  # the run trained on until SIGTERM reached it
        f.write('{"step": 40, "split": "train", "loss": 1.0}\n{"step": 40, "split": "eval", "recall_at_1": 0.658}\n')
    agents.report_new(run)
    assert agents.tell_trial(agent, study, run, 42, 1.0, 0.0) == TrialState.PRUNED
    assert lines == ["trial 0 pruned at step 30 (eval/recall_at_1 0.4840); its checkpoint is kept"]
    assert study.trials[0].intermediate_values == {30: 0.484, 40: 0.658}  # every eval still reported


def test_ranking_metric_is_a_column_even_when_it_is_a_tasks_own():
    from mwloop.sweep import report
    result = report.PointResult("a", "a", {"seed": 0}, "complete",
                                events=[{"step": 1, "split": "eval", "f1": 0.5, "accuracy": 0.7}])
    table = report.markdown_table([result], ["seed"], {"seed": "seed"}, "eval/f1")
    assert "| **eval/f1** |" in table.splitlines()[0].replace(" | eval/accuracy", "") and "0.5000" in table


def test_hparams_skip_a_trial_that_failed_before_it_had_a_directory(tmp_path):
    """A trial failed before it started (no directory, no name: shown as trial-N) must not break the final
    results write (a FileNotFoundError once ended a resumed sweep with a traceback)."""
    from mwloop.sweep import hparams, report
    ran = tmp_path / "lr=0.1"
    ran.mkdir()
    results = [report.PointResult("lr=0.1", str(ran), {"lr": 0.1}, "complete"),
               report.PointResult("trial-1", str(tmp_path / "trial-1"), {"lr": 0.2}, "failed", error="bad")]
    hparams.write_hparams(str(tmp_path), results, ["lr"])
    assert glob.glob(str(ran / "events.out.tfevents.*")) and not (tmp_path / "trial-1").exists()
    assert glob.glob(str(tmp_path / "events.out.tfevents.*"))  # the experiment itself


# ---------------------------------------------------------------------------- multi-worker trials

# Seed 1 of the grid sampler runs 0.5 first: it sets the median; 1e-5 is far below it at its first eval. Only the
# pruned trial needs a long run (still training when the SIGTERM lands); the one that sets the median only has to
# complete with an eval at step 20.
PRUNED_TWO_WORKERS = """
SAMPLER = "grid"
PRUNER = "median"
PRUNER_OPTIONS = {"n_startup_trials": 1}

def search_space(trial):
    rate = trial.suggest_categorical("optimizer.learning_rate", [0.5, 1e-5])
    return {"train.steps": 400 if rate == 1e-5 else 40, "train.log_every_steps": 20, "train.eval_every_steps": 20,
            "train.checkpoint_every_steps": 20, "train.steps_per_loop": 1}
"""


@pytest.mark.slow
def test_a_two_worker_trial_is_pruned_through_the_launcher_and_both_workers_save(tmp_path):
    workdir = str(tmp_path / "sweep")
    result = sweep_cli(f"--sweep={write(tmp_path, PRUNED_TWO_WORKERS)}", f"--workdir={workdir}", "--seed=1",
                       "--num_workers=2")
    assert result.returncode == 0, result.stderr
    trials = load_study(workdir).trials
    assert [(t.params["optimizer.learning_rate"], t.state) for t in trials] == [
        (0.5, TrialState.COMPLETE), (1e-5, TrialState.PRUNED)]
    assert "trial 1 pruned at step 20 (eval/accuracy" in result.stderr
    pruned = os.path.join(workdir, trials[1].user_attrs["mwloop:name"])
    with open(os.path.join(pruned, "log.txt")) as f:
        log = f.read()
    assert "-m mwloop.launch --num_workers=2" in log  # the trial ran through the launcher
    # The launcher passed the agent's SIGTERM on: both workers saved at one step and exited 42 (PRUNED, kept).
    steps = {int(s) for s in re.findall(r"\[worker [01]\] .*preempted: saving a checkpoint at step (\d+)", log)}
    assert len(steps) == 1 and "worker exits: 0 exited with 42, 1 exited with 42" in log, log[-3000:]
    assert files.newest_checkpoint_step(pruned) == steps.pop() < 400


@pytest.mark.slow
def test_no_tensorflow_start_up_lines_when_a_config_file_imports_tensorflow(tmp_path):
    """examples/quickstart.py imports TensorFlow: checking its sweep loads it in the sweep process itself."""
    env = dict(ENV, TF_CPP_MIN_LOG_LEVEL="2")  # a user's own level, which absl's start-up lines ignore
    result = subprocess.run([sys.executable, "-m", "mwloop.sweep", "create", "--sweep=experiments/quickstart_hidden.py",
                             f"--workdir={tmp_path / 'sweep'}"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "study quickstart_hidden in sqlite:///" in lines[0], lines
