"""Grid sweeps: expansion, checks before anything runs, and one real grid of configs/mlp.py (run, fail, resume)
through the Optuna engine (enqueued trials). Searches, pruning and agents: test_sweep_search.py
(Ctrl-C and a stuck trial: test_sweep_stops.py)."""

from __future__ import annotations

import csv
import glob
import os
import subprocess
import sys

import pytest

from helpers import ROOT
from mwloop import sweep
from mwloop.artifacts import files
from mwloop.sweep import plan, report, runner
from tests import warm_main

MLP = os.path.join(ROOT, "configs", "mlp.py")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = warm_main.serving(dict(os.environ, PYTHONPATH=ROOT))
    return subprocess.run([sys.executable, "-m", "mwloop.sweep", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def write_sweep(tmp_path, body: str) -> str:
    path = tmp_path / "my_sweep.py"
    path.write_text(f'CONFIG = "configs/mlp.py"\n\ndef get_sweep():\n    return {body}\n')
    return str(path)


# ---------------------------------------------------------------------------- defining sweeps

def test_product_varies_the_last_key_fastest():
    assert sweep.product({"optimizer.learning_rate": [0.1, 0.2], "optimizer.weight_decay": [0, 5e-4]}) == [
        {"optimizer.learning_rate": 0.1, "optimizer.weight_decay": 0},
        {"optimizer.learning_rate": 0.1, "optimizer.weight_decay": 5e-4},
        {"optimizer.learning_rate": 0.2, "optimizer.weight_decay": 0},
        {"optimizer.learning_rate": 0.2, "optimizer.weight_decay": 5e-4},
    ]


def test_zip_pairs_values_and_composes_with_product():
    scaled = sweep.zip_({"train.global_batch_size": [64, 128], "train.steps": [200, 100]})
    assert scaled == [{"train.global_batch_size": 64, "train.steps": 200},
                      {"train.global_batch_size": 128, "train.steps": 100}]
    points = sweep.product({"seed": [0, 1]}, scaled)
    assert len(points) == 4 and points[1] == {"seed": 0, "train.global_batch_size": 128, "train.steps": 100}


@pytest.mark.parametrize("make, message", [
    (lambda: sweep.zip_({"a": [1, 2], "b": [1]}), "one length"),
    (lambda: sweep.product({"a": 0.1}), "list of values"),
    (lambda: sweep.product({"a": [1]}, {"a": [2]}), "set by two parts"),
])
def test_malformed_sweeps_are_errors(make, message):
    with pytest.raises(sweep.SweepError, match=message):
        make()


def test_point_names_are_readable_safe_and_unique():
    points = sweep.product({"train.steps": [40], "optimizer.learning_rate": [0.1, 5e-05],
                            "model.hidden": [(16, 32)], "optimizer.name": ["sgd", "a/b"]})
    names = plan.point_names(points)
    # train.steps and model.hidden never vary: they stay out of the names
    assert names == ["learning_rate=0.1,name=sgd", "learning_rate=0.1,name=a_b", "learning_rate=5e-05,name=sgd",
                     "learning_rate=5e-05,name=a_b"]
    clash = sweep.product({"train.global_batch_size": [64, 128], "eval.global_batch_size": [100, 200]})
    assert plan.point_names(clash)[0] == "train.global_batch_size=64,eval.global_batch_size=100"
    assert plan.point_names([{"optimizer.name": "a/b"}, {"optimizer.name": "a_b"}]) == ["name=a_b", "name=a_b-2"]


def test_keys_that_follow_another_stay_out_of_names():
    points = sweep.product({"optimizer.base_batch_size": [128, 0]},
                           sweep.zip_({"train.global_batch_size": [64, 256], "train.steps": [400, 100]}))
    assert plan.name_keys(points) == ["optimizer.base_batch_size", "train.global_batch_size"]
    assert plan.point_names(points)[:2] == ["base_batch_size=128,global_batch_size=64",
                                             "base_batch_size=128,global_batch_size=256"]


@pytest.mark.parametrize("spec, num_points", [("resnet_lr.py", 9), ("batch_scaling.py", 5),
                                              ("batch_scaling.py:compare", 10), ("mlp_smoke.py:fail", 3)])
def test_shipped_experiments_check_against_their_configs(spec, num_points):
    loaded = sweep.load_sweep(os.path.join(ROOT, "experiments", spec))
    points = plan.plan(os.path.join(ROOT, loaded.config), loaded.points)
    assert len(points) == num_points and loaded.metric == "eval/accuracy" and loaded.mode == "max"


def test_overrides_reach_main_as_typed_flags():
    """Each value survives `--config.key=value` parsing exactly (tuples, floats, bools, strings, placeholders)."""
    overrides = {"model.hidden": [16, 8], "optimizer.learning_rate": 5e-05, "optimizer.weight_decay": 0,
                 "deterministic": True, "optimizer.name": "adam", "dataset.data_dir": "/tmp/a b"}
    (point,) = plan.plan(MLP, [overrides])
    assert point.flags == ["--config.model.hidden=(16, 8)", "--config.optimizer.learning_rate=5e-05",
                           "--config.optimizer.weight_decay=0", "--config.deterministic=true",
                           "--config.optimizer.name=adam", "--config.dataset.data_dir=/tmp/a b"]
    c = point.config
    assert (c.model.hidden, c.optimizer.learning_rate, c.deterministic, c.dataset.data_dir) == (
        (16, 8), 5e-05, True, "/tmp/a b")
    assert isinstance(c.optimizer.weight_decay, float)


@pytest.mark.slow
@pytest.mark.parametrize("bad, message", [
    ('{"optimizer.learnin_rate": 0.1}',
     "sweep point 2 {'optimizer.learnin_rate': 0.1}: unknown config key 'optimizer.learnin_rate' "
     "(did you mean 'optimizer.learning_rate'?)"),
    ('{"train.steps": 0.5}', "train.steps=0.5 is a float but the config field is int (200)"),
    ('{"train.steps_per_loop": 0}',  # config_check.check, as mwloop.main and mwloop.Trainer run it
     "sweep point 2 {'train.steps_per_loop': 0}: config.train.steps_per_loop=0; use 1 or more steps per loop call"),
])
def test_bad_override_fails_the_whole_sweep_before_anything_runs(tmp_path, bad, message):
    sweep_file = write_sweep(tmp_path, f'[{{"optimizer.learning_rate": 0.1}}, {bad}]')
    workdir = tmp_path / "sweep"
    result = run_cli(f"--sweep={sweep_file}", f"--workdir={workdir}")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: ")
    assert message in result.stderr
    assert not workdir.exists()  # nothing ran, nothing was written


def test_error_line_prefers_mains_error_message():
    tail = ["Traceback (most recent call last):", "  File x", "ValueError: bad", "error: config.x is bad"]
    assert runner.error_line(tail, 1) == "error: config.x is bad"
    assert runner.error_line(tail[:3], 1) == "ValueError: bad"
    assert runner.error_line([], -9) == "killed by signal 9"
    launched = ["[worker 1]     TypeError: bad tensor", "[worker 1] ", "E1130 launch.py:164] worker 0 exited with 1"]
    assert runner.error_line(launched, 1) == "[worker 1] TypeError: bad tensor"


# ---------------------------------------------------------------------------- a real sweep

def _read_csv(path: str) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def _hparams_plugin_events(path: str) -> list:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    return [value for event in EventFileLoader(path).Load() for value in event.summary.value
            if value.metadata.plugin_data.plugin_name == "hparams"]


def _check_results(workdir: str) -> None:
    rows = _read_csv(os.path.join(workdir, "results.csv"))
    assert [(r["name"], r["status"]) for r in rows] == [
        ("learning_rate=0.3", "complete"), ("learning_rate=0.03", "complete"),  # ranked by eval/accuracy
        ("learning_rate=0.3,eval_fraction=1", "failed")]
    best, worst, failed = rows
    assert float(best["eval/accuracy"]) > float(worst["eval/accuracy"]) > 0.1
    assert best["steps"] == "40" and float(best["train/loss"]) > 0 and float(best["wall_s"]) > 0
    assert best["optimizer.learning_rate"] == "0.3" and best["dataset.eval_fraction"] == "0.2"
    assert best["train.steps"] == "40"  # constants of the sweep are in the csv, not in the names
    assert "eval_fraction=1.0 leaves no training examples" in failed["error"] and failed["eval/accuracy"] == ""

    with open(os.path.join(workdir, "results.md")) as f:
        markdown = f.read()
    assert "3 trials: 2 complete, 0 pruned, 1 failed. Ranked by eval/accuracy (max)." in markdown
    assert "| # | learning_rate | eval_fraction | status | steps |" in markdown
    assert "| 1 | 0.3 | 0.2 | complete | 40 |" in markdown
    best_command = markdown.split("```sh\n")[1].split("\n")[0]
    assert best_command.startswith("python -m mwloop.main --config=configs/mlp.py --workdir=")
    assert best_command.endswith("/learning_rate=0.3 --config.optimizer.learning_rate=0.3 "
                                 "--config.train.checkpoint_every_steps=40 --config.train.eval_every_steps=20 "
                                 "--config.train.log_every_steps=20 --config.train.steps=40 "
                                 "--config.record_cost=true")  # every trial records its costs (docs/sweeps.md)
    assert "## Failed" in markdown and "eval_fraction=1/log.txt" in markdown

    with open(os.path.join(workdir, "results.png"), "rb") as f:
        png = f.read()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000

    (experiment,) = glob.glob(os.path.join(workdir, "events.out.tfevents.*"))
    assert _hparams_plugin_events(experiment)
    (session,) = glob.glob(os.path.join(workdir, "learning_rate=0.3", "events.out.tfevents.*"))
    assert _hparams_plugin_events(session)


@pytest.mark.slow
def test_sweep_runs_records_failures_and_resumes(tmp_path):
    """mlp_smoke:fail: two points train, one fails in mwloop.main; a rerun skips the two and retries the one."""
    workdir = str(tmp_path / "sweep")
    args = ("--sweep=experiments/mlp_smoke.py:fail", f"--workdir={workdir}", "--parallel=2")
    first = run_cli(*args)
    assert first.returncode == 1, first.stderr  # one point failed
    assert "[3/3: 2 complete, 0 pruned, 1 failed]" in first.stderr, first.stderr[-3000:]
    assert "TensorFlow" not in first.stderr and "tensorflow" not in first.stderr  # no start-up noise
    _check_results(workdir)
    done_metrics = os.path.join(workdir, "learning_rate=0.03", "metrics.jsonl")
    mtime = os.path.getmtime(done_metrics)

    second = run_cli(*args)
    assert second.returncode == 1, second.stderr
    assert "3 trials, 2 finished before" in second.stderr and "trial 2 failed: retrying it" in second.stderr
    assert "started: learning_rate=0.03" not in second.stderr
    assert "trial 3 (retry of trial 2) started: learning_rate=0.3,eval_fraction=1" in second.stderr
    assert os.path.getmtime(done_metrics) == mtime

    def attempts(point: str) -> int:
        with open(os.path.join(workdir, point, files.LOG)) as f:
            return sum(line.startswith("=== ") for line in f)
    assert (attempts("learning_rate=0.03"), attempts("learning_rate=0.3,eval_fraction=1")) == (1, 2)
    _check_results(workdir)

    before = os.listdir(workdir)
    # The same directory with another base config would resume the wrong runs: refused before anything starts.
    with pytest.raises(sweep.SweepError, match="holds a run of another config"):
        sweep.run_sweep(sweep_spec=os.path.join(ROOT, "experiments", "mlp_smoke.py"), sweep_dir=workdir,
                        config_spec=os.path.join(ROOT, "configs", "resnet.py"))
    assert sorted(os.listdir(workdir)) == sorted(before)  # refused before anything was written


def test_command_uses_the_launcher_for_several_workers():
    assert runner.command("configs/mlp.py", "d/p", ["--config.seed=1"], num_workers=2)[1:] == [
        "-m", "mwloop.launch", "--num_workers=2", "--", "--config=configs/mlp.py", "--workdir=d/p",
        "--config.seed=1"]


def test_points_import_mwloop_from_the_repository_root(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    assert runner.child_env()["PYTHONPATH"] == os.pathsep.join([ROOT, "/elsewhere"])


def test_markdown_ranks_min_metrics_ascending():
    def point(name, loss):
        return report.PointResult(name, name, {"seed": 0}, "complete",
                                  events=[{"step": 1, "split": "eval", "loss": loss}])
    ranked = report.ranked([point("a", 2.0), point("b", 1.0)], "eval/loss", "min")
    assert [r.name for r in ranked] == ["b", "a"]
