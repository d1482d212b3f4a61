"""Many agents, one study: two `python -m mwloop.sweep agent` processes share a study on a real PostgreSQL
server (tests/services), one is SIGKILLed mid-trial, and its trial is retried by the other from its checkpoint."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time

import optuna
import pytest
from optuna.trial import TrialState

from helpers import ROOT
from mwloop.sweep import study as studies
from tests import warm_main

pytestmark = pytest.mark.slow  # PostgreSQL and sweep agent processes

ENV = dict(os.environ, PYTHONPATH=ROOT)

# The long point comes first, so one agent takes it at once; two short ones follow. (The survivor retries the
# killed agent's trial after its short ones, or waits for its heartbeat to go stale first: "budget met; waiting".)
GRID = """
from mwloop.sweep import product
CONFIG = "configs/mlp.py"
def get_sweep():
    common = {"train.log_every_steps": [100], "train.eval_every_steps": [500], "train.steps_per_loop": [1],
              "train.checkpoint_every_steps": [50]}
    return (product(common, {"train.steps": [1000], "optimizer.learning_rate": [0.1]})
            + product(common, {"train.steps": [40], "optimizer.learning_rate": [0.2, 0.3]}))
"""
LONG = "steps=1000,learning_rate=0.1"


def _log_runs(workdir: str) -> int:
    with open(os.path.join(workdir, "log.txt")) as f:
        return sum(line.startswith("=== ") for line in f)


def test_two_agents_on_postgres_run_each_trial_once_and_retry_a_killed_agents_trial(tmp_path, postgres_url):
    sweep_file = tmp_path / "grid.py"
    sweep_file.write_text(GRID)
    workdir, name = str(tmp_path / "sweep"), f"agents-{os.getpid()}"
    common = [f"--sweep={sweep_file}", f"--workdir={workdir}", f"--study={name}", f"--storage={postgres_url}"]
    created = subprocess.run([sys.executable, "-m", "mwloop.sweep", "create", *common], cwd=ROOT, env=ENV,
                             capture_output=True, text=True, timeout=120)
    assert created.returncode == 0, created.stderr

    logs = [tmp_path / f"agent{i}.log" for i in range(2)]
    agents = [subprocess.Popen([sys.executable, "-m", "mwloop.sweep", "agent", *common, "--heartbeat_s=2"], cwd=ROOT,
                               env=warm_main.serving(ENV), stderr=open(log, "w")) for log in logs]
    try:
        deadline = time.time() + 300
        long_dir = os.path.join(workdir, LONG)
        while not glob.glob(os.path.join(long_dir, "checkpoints", "ckpt-*.index")):
            assert time.time() < deadline, "the long trial never saved a checkpoint"
            time.sleep(0.3)
        (victim,) = [i for i, log in enumerate(logs) if f"started: {LONG}" in log.read_text()]
        agents[victim].send_signal(signal.SIGKILL)  # no goodbye: its trial stays RUNNING, its training dies with it
        agents[victim].wait()
        survivor = agents[1 - victim]
        assert survivor.wait(timeout=600) == 0, logs[1 - victim].read_text()
    finally:
        for process in agents:
            if process.poll() is None:
                process.kill()
    output = logs[1 - victim].read_text()
    assert "(retry of trial 0) from step " in output and f": {LONG}" in output  # resuming ... from step S: <name>
    with open(os.path.join(long_dir, "log.txt")) as f:
        assert "resumed from step" in f.read()

    study = optuna.load_study(study_name=name, storage=postgres_url)
    shown = studies.shown(study.trials)
    assert sorted(t.user_attrs["mwloop:name"] for t in shown) == sorted(
        [LONG] + [f"steps=40,learning_rate={lr}" for lr in ("0.2", "0.3")])
    assert all(t.state == TrialState.COMPLETE for t in shown)  # the budget met exactly, not overshot
    (dead,) = [t for t in study.trials if t.state == TrialState.FAIL]  # the killed agent's, failed by heartbeat
    assert dead.number == 0
    assert [_log_runs(os.path.join(workdir, t.user_attrs["mwloop:name"])) for t in shown] == [
        2 if t.user_attrs["mwloop:name"] == LONG else 1 for t in shown]  # no trial run twice, the long one resumed
