"""Standby workers (mwloop.launcher.standby): a restart takes processes started ahead of it, TensorFlow already
imported, and they run the worker as a fresh start would; their goodput clock counts from when they were given
their task."""

import glob
import io
import json
import os
import subprocess
import sys
import time

import pytest

from mwloop.launcher import attempt, standby
from mwloop.run import goodput_clock
from tests.helpers import ROOT


def test_a_standby_worker_counts_its_start_up_from_when_it_was_given_its_task(monkeypatch):
    monkeypatch.setattr(goodput_clock, "_process_start_taken", False)
    monkeypatch.setattr(goodput_clock, "_work_started", None)
    created = goodput_clock.process_start_time()
    goodput_clock.count_from(created + 30.0)  # imported, then waited 30 s for its task
    assert goodput_clock._start_of_this_clock() == pytest.approx(created + 30.0)
    monkeypatch.setattr(goodput_clock, "_process_start_taken", False)
    # Asked for before it existed (forked by a warm server that was still importing): its start-up counts from
    # the asking, the wait for the server's imports included, as a fresh start's would.
    goodput_clock.count_from(created - 30.0)
    assert goodput_clock._start_of_this_clock() == pytest.approx(created - 30.0)


def test_a_spare_that_died_is_not_taken(tmp_path):
    spares = standby.Spares("tests.standby_worker", [str(tmp_path)], dict(os.environ))
    spares.command = [sys.executable, "-c", "pass"]  # dies at once
    spares.fill(2)
    for proc in spares.waiting:
        proc.wait(timeout=30)
    assert spares.take({"cluster": {}, "task": {}}) is None and spares.waiting == []  # a fresh start instead
    spares.close()


def test_spares_start_once_the_attempt_trains_and_only_once():
    """Not before a worker logs a train step (the attempt's own start-up would compete with their imports for
    the CPU), then once: the next attempt takes them."""
    class Counting:
        filled: list[int] = []

        def fill(self, count: int) -> None:
            self.filled.append(count)

    spares = Counting()
    run = attempt.Attempt(["unused"], {}, grace_s=1, spares=spares)
    run.prepare_spares(2)
    assert spares.filled == []  # starting up
    run._pump(io.BytesIO(b"I1202 18:00:00.265577 1 actions.py:134] step 50/200 loss 0.72\n"), "worker 0",
              io.BytesIO())
    run.prepare_spares(2)
    run.prepare_spares(2)
    assert spares.filled == [2] and run.spares is None


def _standby_processes(state_dir) -> list[int]:
    """Pids of live spares started for `state_dir`'s job."""
    found = []
    for cmdline in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            args = open(cmdline, "rb").read().split(b"\0")
        except OSError:
            continue
        if standby.__name__.encode() in args and str(state_dir).encode() in args:
            found.append(int(cmdline.split("/")[2]))
    return found


def _launch(state_dir, max_restarts: int, use_standby: bool = True, count_fills: bool = False) -> tuple[int, str]:
    """`mwloop.launch.launch` of 2 tests.standby_worker workers in a process of its own (mwloop.launch defines
    absl flags, which other test modules define too), with spares due at once (stand-in workers log no train
    steps); its exit code and output."""
    script = f"""
import sys
from mwloop import launch
from mwloop.launcher import attempt, standby
attempt.SPARES_AFTER_S = 0.0
if {count_fills}:
    standby.Spares.fill = lambda self, count: print("filled", count, flush=True)
sys.exit(launch.launch([{str(state_dir)!r}], 2, max_restarts={max_restarts}, grace_s=5,
                       module="tests.standby_worker", use_standby={use_standby}))
"""
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    return run.returncode, run.stdout + run.stderr


@pytest.mark.slow
def test_a_restart_takes_the_standby_workers_which_run_as_a_fresh_start_would(tmp_path):
    started = time.time()
    # Two restarts allowed, one used: the second attempt fills spares again, which the end must stop.
    code, output = _launch(tmp_path, max_restarts=2)
    assert code == 0, output[-3000:]
    records = {os.path.basename(p)[:-5]: json.load(open(p)) for p in glob.glob(str(tmp_path / "*.json"))}
    assert sorted(records) == ["0-0", "0-1", "1-0", "1-1"]
    for index in (0, 1):
        fresh, spare = records[f"{index}-0"], records[f"{index}-1"]
        assert not fresh["preloaded"] and spare["preloaded"]  # the restart took a process with TensorFlow imported
        assert fresh["work_started"] is None and spare["work_started"] >= started
        for run in (fresh, spare):  # as `python -m tests.standby_worker STATE_DIR` would run
            assert run["name"] == "__main__" and run["argv"][1:] == [str(tmp_path)]
            assert run["argv"][0].endswith(os.path.join("tests", "standby_worker.py"))
            assert run["stdin_is_devnull"] and run["unbuffered"] == "1"
            assert run["tf_config"]["task"] == {"type": "worker", "index": index}
    assert records["0-0"]["tf_config"]["cluster"] != records["0-1"]["tf_config"]["cluster"]  # fresh ports
    assert records["0-1"]["tf_config"]["cluster"] == records["1-1"]["tf_config"]["cluster"]  # one cluster
    assert _standby_processes(tmp_path) == []  # the spares filled for a third attempt were ended


@pytest.mark.slow
@pytest.mark.parametrize("max_restarts, use_standby", [(0, True), (1, False)])
def test_no_spares_without_restarts_left_or_with_nostandby(tmp_path, max_restarts, use_standby):
    """--max_restarts=0 and --nostandby start no spare: no memory held for a restart that cannot come."""
    code, output = _launch(tmp_path, max_restarts, use_standby, count_fills=True)
    assert code == (128 + 9 if max_restarts == 0 else 0), output[-3000:]
    assert "filled" not in output
