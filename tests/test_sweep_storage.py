"""The study's database going away for a while (issue 31): agents retry their storage calls with backoff and
a deadline (mwloop/sweep/outage.py), and a real PostgreSQL stopped for 10 s mid-study costs no trial and runs
none twice. Trials are tests/fake_trainer.py (sleeps and prints), not TensorFlow: the test is about the agent."""

from __future__ import annotations

import os
import sys
import threading
import time

import optuna
import pytest
import sqlalchemy.exc
from optuna.trial import TrialState

from helpers import ROOT
from mwloop.sweep import local, outage, runner
from mwloop.sweep import study as studies


def _refused() -> Exception:
    error = sqlalchemy.exc.OperationalError("SELECT 1", {}, Exception("connection refused"))
    wrapped = optuna.exceptions.StorageInternalError("An exception is raised during the commit.")
    wrapped.__cause__ = error
    return wrapped


class _Flaky:
    """A storage call that fails `failures` times for want of a connection, then answers."""

    def __init__(self, failures: int, then: object = "ok"):
        self.failures, self.then, self.calls = failures, then, 0

    def __call__(self):
        self.calls += 1
        if self.calls <= self.failures:
            raise _refused()
        if isinstance(self.then, BaseException):
            raise self.then
        return self.then


def test_a_call_is_retried_with_backoff_until_the_storage_answers_and_it_says_so_once(caplog):
    waits: list[float] = []
    riding = outage.Outage("postgresql://me:secret@db/x", deadline_s=60, sleep=waits.append)
    call = _Flaky(7)
    with caplog.at_level("WARNING"):
        assert riding.call("tell", call) == "ok"
    assert call.calls == 8
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]  # doubling, capped
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said  # once when it starts waiting, once when it is back
    assert "does not answer" in said[0] and "secret" not in said[0] and "me:***@db" in said[0]
    assert "--storage_outage_s=60" in said[0] and "is back" in said[1]
    assert riding.since is None and riding.recovered_within(5)


def test_past_the_deadline_it_is_one_line_and_other_errors_are_not_retried():
    riding = outage.Outage("postgresql://db/x", deadline_s=0.01, sleep=lambda s: time.sleep(0.01))
    with pytest.raises(outage.StorageOutageError, match=r"did not answer for \d+s \(--storage_outage_s=0.01\)"):
        riding.call("ask", _Flaky(10 ** 6))
    fresh = outage.Outage("postgresql://db/x", sleep=lambda s: None)
    wrong = _Flaky(0, then=optuna.exceptions.StorageInternalError("invalid data"))  # no connection error inside
    with pytest.raises(optuna.exceptions.StorageInternalError):
        fresh.call("tell", wrong)
    assert wrong.calls == 1


def test_a_tell_whose_answer_was_lost_is_not_an_error():
    # The commit went through, the connection dropped before the answer: the retry finds the trial finished.
    riding = outage.Outage("postgresql://db/x", sleep=lambda s: None)
    assert riding.call("set_trial_state_values", _Flaky(1, then=optuna.exceptions.UpdateFinishedTrialError())) is True
    with pytest.raises(optuna.exceptions.UpdateFinishedTrialError):  # not a retry: a real double tell
        riding.call("set_trial_state_values", _Flaky(0, then=optuna.exceptions.UpdateFinishedTrialError()))


def test_the_storage_is_wrapped_and_keeps_its_heartbeat(tmp_path):
    storage = studies.open_storage(f"sqlite:///{tmp_path}/s.db", heartbeat_s=5, outage_s=30)
    assert isinstance(storage, outage.RidingStorage) and storage.outage.deadline_s == 30
    assert optuna.storages._heartbeat.is_heartbeat_enabled(storage)
    study = optuna.create_study(storage=storage, study_name="s")
    trial = study.ask()
    storage.record_heartbeat(trial._trial_id)
    study.tell(trial, 1.0)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE]
    assert not isinstance(studies.open_storage(f"sqlite:///{tmp_path}/s.db", outage_s=0), outage.RidingStorage)


def _open_and_report(url: str, results) -> None:
    try:
        studies.open_storage(url, heartbeat_s=None, outage_s=0)
        results.put("ok")
    except Exception as e:  # noqa: BLE001 -- the test names what failed
        results.put(repr(e))


@pytest.mark.slow
def test_processes_opening_one_new_database_at_once_all_open_it(tmp_path):
    """Three processes (agents; a dashboard beside the sweep) open one new SQLite file at the same moment: each
    creates the tables and the schema version, and the losers of that race used to fail ("does not answer:
    UNIQUE constraint failed: alembic_version.version_num", or "table studies already exists"): 8 to 22 of 90
    opens here before; they open again now."""
    import multiprocessing
    context = multiprocessing.get_context("fork")
    outcomes = []
    for i in range(8):
        results = context.Queue()
        url = f"sqlite:///{tmp_path}/{i}.db"
        processes = [context.Process(target=_open_and_report, args=(url, results)) for _ in range(3)]
        for process in processes:
            process.start()
        for process in processes:
            process.join(timeout=60)
        outcomes += [results.get(timeout=10) for _ in processes]
    assert outcomes == ["ok"] * 24, [o for o in outcomes if o != "ok"]


# ---------------------------------------------------------------------------- a real outage

GRID = """
CONFIG = "configs/mlp.py"
def get_sweep():
    return [{"train.steps": 60, "optimizer.learning_rate": rate} for rate in (0.1, 0.2, 0.3, 0.4)]
"""
# Longer than the stale-trial grace period (2 x heartbeat_s = 4 s) with room to spare, and than a trial (60 fake
# steps: 6 s), so trials end and heartbeats are missed while the server is down.
OUTAGE_S = 10.0


def _fake_command(config_spec, workdir, override_flags, num_workers=1):
    return [sys.executable, os.path.join(ROOT, "tests", "fake_trainer.py"), f"--workdir={workdir}", *override_flags]


@pytest.mark.slow  # a PostgreSQL server of its own, stopped for 10 s
def test_postgres_stopped_10s_mid_study_the_study_completes_with_its_budget_and_nothing_twice(
        tmp_path, monkeypatch, caplog):
    from tests.services import postgres

    monkeypatch.setattr(runner, "command", _fake_command)
    sweep_file = tmp_path / "grid.py"
    sweep_file.write_text(GRID)
    workdir = str(tmp_path / "sweep")
    server = postgres.start()
    outage_at: list[float] = []

    def outage_mid_trial() -> None:
        started = [os.path.join(workdir, d, "started.txt") for d in ("learning_rate=0.1", "learning_rate=0.2")]
        deadline = time.monotonic() + 60
        while not all(os.path.exists(p) for p in started) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # both trials running, some evals reported
        outage_at.append(time.monotonic())
        server.halt()
        time.sleep(OUTAGE_S)
        server.resume()
        outage_at.append(time.monotonic())

    try:
        chaos = threading.Thread(target=outage_mid_trial, daemon=True)
        began = time.monotonic()
        chaos.start()
        with caplog.at_level("INFO"):
            failed = local.run_sweep(sweep_spec=str(sweep_file), sweep_dir=workdir, parallel=2,
                                     storage_url=server.url, heartbeat_s=2, storage_outage_s=120,
                                     study_name="outage")
        took = time.monotonic() - began
        chaos.join(timeout=60)
        study = optuna.load_study(study_name="outage", storage=server.url)
        trials = study.trials
    finally:
        server.stop()
    assert failed == 0
    assert len(outage_at) == 2 and outage_at[1] - outage_at[0] >= OUTAGE_S
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 4, [(t.number, t.state) for t in trials]
    names = sorted(t.user_attrs["mwloop:name"] for t in trials)
    starts = {name: len(open(os.path.join(workdir, name, "started.txt")).read().split()) for name in names}
    print(f"outage test: {len(trials)} trials, started {starts}, {took:.1f}s "
          f"(postgres down {outage_at[1] - outage_at[0]:.1f}s)")
    assert set(starts.values()) == {1}  # nothing run twice: no trial failed as stale and retried
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert "does not answer" in said and "is back after" in said and "StorageInternalError" not in said


# ---------------------------------------------------------------------------- the sweep's reports

def test_a_second_runner_on_a_busy_sweep_directory_is_one_line(tmp_path):
    import subprocess

    from mwloop.artifacts import workdir_lock

    sweep_file = tmp_path / "grid.py"
    sweep_file.write_text(GRID)
    workdir = str(tmp_path / "sweep")
    held = workdir_lock.acquire(workdir)  # the first runner (a lock is per process)
    try:
        done = subprocess.run([sys.executable, "-m", "mwloop.sweep", "run", f"--sweep={sweep_file}",
                               f"--workdir={workdir}"], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                              capture_output=True, text=True, timeout=300)
    finally:
        held.close()
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(f"error: workdir {workdir} is in use by a live run")


def _trial(state: TrialState, **attrs) -> optuna.trial.FrozenTrial:
    trial = optuna.trial.create_trial(state=state, value=0.5 if state == TrialState.COMPLETE else None,
                                      user_attrs={studies.ATTR + k: v for k, v in attrs.items()})
    trial.number = 0
    return trial


def test_an_interrupted_trial_is_reported_interrupted_not_running_or_waiting(tmp_path):
    from mwloop.sweep import results

    assert results.trial_result(_trial(TrialState.WAITING, interrupted=True, name="a"), str(tmp_path)).status \
        == "interrupted"
    assert results.trial_result(_trial(TrialState.WAITING, name="a"), str(tmp_path)).status == "waiting"
    assert results.trial_result(_trial(TrialState.RUNNING, interrupted=True, name="a"), str(tmp_path)).status \
        == "running"  # its retry runs now


def test_a_pruned_trial_run_on_by_its_reproduce_command_is_reported_complete(tmp_path):
    from mwloop.sweep import report, results

    trial = _trial(TrialState.PRUNED, name="a", steps=100, pruned_at=20)
    result = results.trial_result(trial, str(tmp_path))
    result.events = [{"step": s, "split": "eval", "accuracy": s / 100} for s in (10, 20, 30)]
    assert not results.became_complete(result, trial, "eval/accuracy")  # only the evals written while it stopped
    result.events.append({"step": 100, "split": "eval", "accuracy": 0.9})  # resumed by hand to its end
    assert results.became_complete(result, trial, "eval/accuracy")
    untold = _trial(TrialState.PRUNED, name="a")  # a trial pruned before mwloop recorded its steps: as it was
    assert not results.became_complete(report.PointResult("a", "", {}, "pruned", events=result.events), untold,
                                       "eval/accuracy")


def test_a_value_with_a_bar_or_a_newline_keeps_results_md_a_table():
    from mwloop.sweep import report

    rows = [report.PointResult("a", "", {"data.path": "x|y\nz"}, "complete",
                               events=[{"step": 1, "split": "eval", "accuracy": 0.5}])]
    table = report.markdown_table(rows, ["data.path"], {"data.path": "path|name"}, "eval/accuracy")
    lines = table.splitlines()
    assert len(lines) == 3  # header, rule, one row
    assert all(line.replace("\\|", "").count("|") == lines[1].count("|") for line in lines)
    assert "x\\|y<br>z" in lines[2] and "path\\|name" in lines[0]  # the newline as a line break in the cell
