"""A sweep stopped before its trials end (split from tests/test_sweep_search.py): Ctrl-C, then the same command
resumes the interrupted trials and skips the finished ones; a trial that shows no progress is named, stopped and
failed while the sweep goes on. Real studies on SQLite; trials are MLP runs."""

from __future__ import annotations

import csv
import glob
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from optuna.trial import TrialState

from helpers import ROOT
from mwloop.artifacts import files
from mwloop.sweep import study as studies
from tests.stress import fault_cases
from tests.test_sweep_search import ENV, load_study, sweep_cli, write

# ---------------------------------------------------------------------------- Ctrl-C and rerun

# One short trial that finishes, two long ones (one step per loop call: slow enough to be caught) that are
# interrupted after their first checkpoints.
# The long trials run well past the short one's end (one step per call), and save early and often enough to be
# interrupted between checkpoints; their second run trains what is left.
LONG_STEPS = 4000
LONG_GRID = f"""
from mwloop.sweep import product
def get_sweep():
    common = {{"train.log_every_steps": [100], "train.eval_every_steps": [1000], "train.steps_per_loop": [1],
              "train.checkpoint_every_steps": [100]}}
    return (product(common, {{"train.steps": [40], "optimizer.learning_rate": [0.3]}})
            + product(common, {{"train.steps": [{LONG_STEPS}], "optimizer.learning_rate": [0.1, 0.2]}}))
"""


@pytest.mark.slow
def test_ctrl_c_then_the_same_command_resumes_interrupted_trials_and_skips_finished_ones(tmp_path):
    workdir = str(tmp_path / "sweep")
    args = [sys.executable, "-m", "mwloop.sweep", f"--sweep={write(tmp_path, LONG_GRID)}", f"--workdir={workdir}",
            "--parallel=3"]
    first = subprocess.Popen(args, cwd=ROOT, env=ENV, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    long_dirs = [os.path.join(workdir, f"steps={LONG_STEPS},learning_rate={lr}") for lr in ("0.1", "0.2")]

    def short_trial_complete() -> bool:
        if not os.path.exists(os.path.join(workdir, studies.DB_FILE)):
            return False
        return any(t.state == TrialState.COMPLETE for t in load_study(workdir).trials)

    while not (all(glob.glob(os.path.join(d, "checkpoints", "ckpt-*.index")) for d in long_dirs)
               and short_trial_complete()):
        assert time.time() < deadline and first.poll() is None, "the long trials never saved a checkpoint"
        time.sleep(0.5)
    first.send_signal(signal.SIGINT)
    _, stderr = first.communicate(timeout=300)
    assert first.returncode == 130, stderr
    assert "interrupted: run the same command again to resume the sweep" in stderr
    saved = {d: files.newest_checkpoint_step(d) for d in long_dirs}
    assert all(step and step < LONG_STEPS for step in saved.values()), saved
    with open(os.path.join(workdir, "results.csv")) as f:  # issue 31: it said "running" after Ctrl-C
        statuses = {row["name"]: row["status"] for row in csv.DictReader(f)}
    assert statuses == {"steps=40,learning_rate=0.3": "complete", **{os.path.basename(d): "interrupted"
                                                                    for d in long_dirs}}, statuses

    second = subprocess.run(args, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr
    assert "started: steps=40" not in second.stderr  # finished before: not rerun
    for d in long_dirs:
        name = os.path.basename(d)
        assert f"from step {saved[d]}: {name}" in second.stderr  # "resuming trial N (retry of trial M) from step S"
        with open(os.path.join(d, "log.txt")) as f:
            assert "resumed from step" in f.read()
    with open(os.path.join(workdir, "steps=40,learning_rate=0.3", "log.txt")) as f:
        assert sum(line.startswith("=== ") for line in f) == 1
    trials = load_study(workdir).trials
    shown = studies.shown(trials)
    assert len(shown) == 3 and all(t.state == TrialState.COMPLETE for t in shown)  # exactly the 3 points
    # The study's count is exact: the 3 points, and the 2 interrupted attempts their retries resumed. (Agents of
    # one process ask one at a time: before, a third agent asking beside two retries got a fresh trial, failed as
    # surplus without running, seen in CI.)
    failed = [t for t in trials if t.state != TrialState.COMPLETE]
    assert len(trials) == 5 and [t.state for t in failed] == [TrialState.FAIL] * 2
    assert all(t.user_attrs[studies.INTERRUPTED] for t in failed) and studies.retried(trials) == {
        t.number for t in failed}
    with open(os.path.join(workdir, "results.csv")) as f:
        assert [r["status"] for r in csv.DictReader(f)] == ["complete"] * 3


# ---------------------------------------------------------------------------- a trial that never progresses

@pytest.mark.slow
def test_a_trial_that_shows_no_progress_is_named_stopped_and_failed_while_the_sweep_goes_on(tmp_path):
    """A user task whose data loading never returns for one of two grid points (the fault suite's case)."""
    (tmp_path / "stuck.py").write_text(fault_cases.STUCK_CONFIG)
    sweep_file = tmp_path / "stuck_grid.py"
    sweep_file.write_text(fault_cases.STUCK_SWEEP)
    workdir = str(tmp_path / "sweep")
    started = time.time()
    # 15 s: three times the healthy trial's longest silence here (its start-up, ~5 s), and the stuck one's wait.
    result = sweep_cli(f"--sweep={sweep_file}", f"--workdir={workdir}", "--parallel=2", "--trial_stall_s=15")
    wall = time.time() - started
    assert result.returncode == 1, result.stderr  # a failed trial: exit 1, after the other one finished
    stuck = os.path.join(workdir, "stuck=true")
    assert re.search(r"trial 1: no progress for \d+s \(its last line: .*\); it is stopped at 15s "
                     r"\(--trial_stall_s\)", result.stderr), result.stderr
    assert re.search(rf"trial 1 failed: no progress for (1[5-9]|2\d)s \(log.txt and metrics.jsonl unchanged; stopped, "
                     rf"exit -?\d+\); find what it waits for in its log, or raise --trial_stall_s \(log: "
                     rf"{re.escape(stuck)}",
                     result.stderr), result.stderr
    assert "trial 0 complete" in result.stderr and wall < 200, wall
    trials = load_study(workdir).trials
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.FAIL]  # failed once, not retried
    with open(os.path.join(workdir, "results.csv")) as f:
        assert [r["status"] for r in csv.DictReader(f)] == ["complete", "failed"]
