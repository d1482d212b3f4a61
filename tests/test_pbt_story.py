"""Population-based training on a real study (SQLite) with real segments (configs/mlp.py): the runner SIGKILLed in
the middle of an interval, then run again, ends with exactly the planned segments, no interval decided twice
and nothing trained twice. One story: it pays its process start-ups once."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time

import optuna
import pytest
import sqlalchemy.exc
from optuna.trial import TrialState

from helpers import ROOT
from mwloop.artifacts import files
from mwloop.sweep import pbt_runner
from mwloop.sweep import study as studies

pytestmark = pytest.mark.slow

ENV = dict(os.environ, PYTHONPATH=ROOT)
SWEEP = """CONFIG = "configs/mlp.py"
ALGORITHM = "pbt"
POPULATION = 3
INTERVAL_STEPS = 10
QUANTILE = 0.34                 # one member of three copies another
PERTURB = {"optimizer.learning_rate": (0.8, 1.25)}

def search_space(trial):
    trial.suggest_float("optimizer.learning_rate", 0.01, 0.5, log=True)
    return {"train.steps": 20, "train.steps_per_loop": 5, "train.log_every_steps": 5, "train.eval_every_steps": 0,
            "train.checkpoint_every_steps": 5, "export": False}
"""


def _segments(workdir: str) -> list:
    storage = studies.default_storage(workdir)
    (name,) = optuna.get_all_study_names(storage)
    return optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)


def _mid_interval(workdir: str, opened: dict) -> bool:
    """A segment of interval 1 finished and another running. The storage is opened once (`opened` keeps it):
    opening it checks its schema, seconds on a loaded machine, longer than a segment runs."""
    try:
        if "storage" not in opened:
            if not os.path.exists(os.path.join(workdir, studies.DB_FILE)):
                return False
            opened["storage"] = optuna.storages.RDBStorage(studies.default_storage(workdir))
        storage = opened["storage"]
        (study,) = storage.get_all_studies()
        trials = storage.get_all_trials(study._study_id, deepcopy=False)
    # The study is being created.
    except (ValueError, KeyError, optuna.exceptions.StorageInternalError, sqlalchemy.exc.DatabaseError):
        return False
    states = [t.state for t in trials if t.user_attrs.get(pbt_runner.LINEAGE, {}).get("interval") == 1]
    return TrialState.COMPLETE in states and TrialState.RUNNING in states


def test_pbt_killed_mid_interval_then_rerun_ends_with_exactly_the_planned_segments(tmp_path):
    started = time.monotonic()
    spec, workdir = tmp_path / "my_pbt.py", str(tmp_path / "sweep")
    spec.write_text(SWEEP)
    command = [sys.executable, "-m", "mwloop.sweep", f"--sweep={spec}", f"--workdir={workdir}", "--seed=1"]
    with open(tmp_path / "first.log", "w") as log:
        runner = subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        try:
            deadline, opened = time.monotonic() + 300, {}
            while not _mid_interval(workdir, opened):
                assert runner.poll() is None, open(tmp_path / "first.log").read()[-3000:]
                assert time.monotonic() < deadline, "interval 1 never got under way"
                time.sleep(0.05)
            # The runner, its warm-start server and the running segment, all at once.
            os.killpg(runner.pid, signal.SIGKILL)
        finally:
            runner.wait()
    killed = [t for t in _segments(workdir) if t.state == TrialState.RUNNING]
    assert len(killed) == 1
    killed_name = pbt_runner.directory(*(killed[0].user_attrs[pbt_runner.LINEAGE][k] for k in ("member", "interval")))
    saved = files.newest_checkpoint_step(os.path.join(workdir, killed_name))

    rerun = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    trials = _segments(workdir)
    shown = studies.shown(trials)
    # Exactly the planned segments, each complete once: 3 members x 2 intervals.
    points = sorted(t.user_attrs[studies.ATTR + "point"] for t in shown)
    assert points == sorted(pbt_runner.point(m, k) for m in range(3) for k in range(2))
    assert all(t.state == TrialState.COMPLETE for t in shown) and len(studies.counted(trials)) == 6
    # No interval decided twice: one trial per segment, besides the killed one's retry; no surplus.
    assert len(trials) == 7 and not any(t.user_attrs.get(studies.SURPLUS) for t in trials)
    # Nothing trained twice: every segment's directory was trained by one process, the killed one's by two, the
    # second resuming where the first left its checkpoint (or warm-starting again before its first).
    attempts = {os.path.relpath(os.path.dirname(p), workdir): open(p).read().count("\n=== ") + 1
                for p in glob.glob(os.path.join(workdir, "m*", "k*", "log.txt"))}
    # (The killed one's first process may never have started: its trial is RUNNING from the ask on, and the kill
    # can land before the agent started it; then its retry is its only process.)
    assert attempts[killed_name] in (1, 2), attempts
    assert {n: a for n, a in attempts.items() if n != killed_name} == {n: 1 for n in attempts if n != killed_name}
    assert len(attempts) == 6
    assert "was running when the last sweep stopped: retrying it" in rerun.stderr + rerun.stdout
    second_attempt = open(os.path.join(workdir, killed_name, "log.txt")).read().rsplit("=== ", 1)[1]
    assert (f"resumed from step {saved}" if saved is not None else "warm start of the whole state from") \
        in second_attempt
    # The lineage: the worst of interval 0 continued the best one's checkpoint at step 10.
    second = {t.user_attrs[pbt_runner.LINEAGE]["member"]: t.user_attrs[pbt_runner.LINEAGE] for t in shown
              if t.user_attrs[pbt_runner.LINEAGE]["interval"] == 1}
    first = {t.user_attrs[pbt_runner.LINEAGE]["member"]: t.value for t in shown
             if t.user_attrs[pbt_runner.LINEAGE]["interval"] == 0}
    worst, best = min(first, key=lambda m: (first[m], -m)), max(first, key=lambda m: (first[m], -m))
    assert second[worst]["exploit"] and second[worst]["parent"] == [best, 0]
    assert sum(lineage["exploit"] for lineage in second.values()) == 1
    results = open(os.path.join(workdir, "results.md")).read()
    assert "## Population-based training: lineage" in results and " && " in results
    assert os.path.exists(os.path.join(workdir, "pbt_schedules.png"))
    print(f"PBT story: {time.monotonic() - started:.1f}s, killed segment {killed_name} (checkpoint: {saved})")
