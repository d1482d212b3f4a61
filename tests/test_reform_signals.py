"""A signal to a local elastic launcher at each phase of a re-form (issue 45, item 2): it ends the job as it does
between re-forms. In-process: `ElasticJob.run` in the test's main thread with the launcher's own SIGTERM handler,
stand-in workers (tests/fake_worker.py, milliseconds each), and the signal sent by the test process to itself at
the phase: the worker's loss is seen (detect), the survivors stop, the job waits below MIN, the next round's
workers start, and the new round runs (its restore and first step, for a real worker).

Each must raise (mwloop.launch turns Terminated into 143, KeyboardInterrupt into 130) with every worker stopped,
no round started after the signal, and the pending `membership` change in metrics.jsonl (never trained), not lost.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

import pytest

from mwloop.artifacts import files
from mwloop.launcher import agent, elastic, leader, rendezvous
from mwloop.launcher.attempt import Attempt, Terminated
from tests.helpers import ROOT
from tests.test_elastic import _rounds
from tests.test_launcher_signals import launcher_handlers

pytestmark = pytest.mark.slow  # each case starts stand-in worker processes (and, for agents, etcd)


def _signal_self(signum: int) -> None:
    os.kill(os.getpid(), signum)


def _at(monkeypatch, cls, name: str, signum: int, calls: int = 1) -> None:
    """Sends `signum` to this process when `cls.name` is called for the `calls`-th time (after the call itself)."""
    original, seen = getattr(cls, name), []

    def wrapper(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        seen.append(1)
        if len(seen) == calls:
            _signal_self(signum)
        return result
    monkeypatch.setattr(cls, name, wrapper)


def _before(monkeypatch, cls, name: str, signum: int) -> None:
    """Sends `signum` to this process as `cls.name` is first called: the signal lands inside it."""
    original, seen = getattr(cls, name), []

    def wrapper(self, *args, **kwargs):
        if not seen:
            seen.append(1)
            threading.Timer(0.05, _signal_self, (signum,)).start()
        return original(self, *args, **kwargs)
    monkeypatch.setattr(cls, name, wrapper)


PHASES = {
    # The lost worker is seen; the launcher waits TOGETHER_S for others lost with it (no change decided yet).
    "detect": lambda mp, s: _before(mp, elastic.ElasticJob, "_lost_together", s),
    # The survivors' stop (the round's end): a save where the round is whole, a kill after grace_s otherwise.
    "stop": lambda mp, s: _before(mp, Attempt, "stop", s),
    # The first worker of the next round started, the others not yet.
    "start": lambda mp, s: _at(mp, Attempt, "start", s, calls=4),
    # Every worker of the next round started (a real one restores and traces now).
    "first_step": lambda mp, s: _at(mp, elastic.ElasticJob, "_checkpoint_step", s, calls=2),
}


# SIGTERM at every phase; a Ctrl-C (the same path, its workers interrupted instead) where the workers run.
@pytest.mark.parametrize("phase,signum", [(phase, signal.SIGTERM) for phase in PHASES] + [
    ("stop", signal.SIGINT), ("first_step", signal.SIGINT)])
def test_a_signal_at_each_phase_of_a_local_re_form_ends_the_job_with_nothing_lost(tmp_path, monkeypatch, phase,
                                                                                signum):
    state, workdir = tmp_path / "state", tmp_path / "run"
    state.mkdir()
    workdir.mkdir()
    # Round 0: worker 2 dies, the others wait to be stopped (SIGTERM: they exit as a save would); round 1: 2 workers.
    command = [sys.executable, "-m", "tests.fake_worker", str(state), "sleep", "sleep", "kill9"]
    job = elastic.ElasticJob(command, dict(os.environ, PYTHONPATH=ROOT), elastic.Bounds(2, 3), workdir=str(workdir),
                             grace_s=5, rejoin_s=float("inf"), wait_for_min_s=30, max_restarts=3)
    # The launcher's own handlers (an earlier test in this process may have left others).
    with launcher_handlers():
        PHASES[phase](monkeypatch, signum)
        with pytest.raises(Terminated if signum == signal.SIGTERM else KeyboardInterrupt):
            job.run()
    assert job.attempt is not None and all(p.poll() is not None for p in job.attempt.procs.values())
    # Round 0's 3 starts, and at most the round that was starting: none after the signal.
    assert _rounds(state)[:3] == [3, 3, 3] and len(_rounds(state)) <= 5, _rounds(state)
    events = [e for e in files.read_metrics(str(workdir)) if e["split"] == "membership"]
    assert [(e["workers_before"], e["workers_after"], e["seconds_lost"]) for e in events] == (
        [] if phase == "detect" else [(3, 2, None)])
    assert all(e["why"].startswith("worker 2 exited with -9") for e in events)


# --- the multi-machine agent: one agent in-process against a real etcd; its worker fails, the next round forms ---

def _before_nth(monkeypatch, cls, name: str, signum: int, calls: int, delay_s: float = 0.0) -> None:
    """Sends `signum` to this process as `cls.name` is called for the `calls`-th time: it lands as the call begins,
    or `delay_s` into it."""
    original, seen = getattr(cls, name), []

    def wrapper(self, *args, **kwargs):
        seen.append(1)
        if len(seen) == calls:
            if delay_s:
                threading.Timer(delay_s, _signal_self, (signum,)).start()
            else:
                _signal_self(signum)
        return original(self, *args, **kwargs)
    monkeypatch.setattr(cls, name, wrapper)


AGENT_PHASES = {
    # Round 0's failed worker: the others' stop (a save where the round is whole).
    "stop": (lambda mp, s: _before_nth(mp, Attempt, "stop", s, calls=1, delay_s=0.05), 0),
    # The leader proposes round 1.
    "proposal": (lambda mp, s: _before_nth(mp, leader.Leader, "_propose", s, calls=2), 0),
    # Round 1's members gather each other's addresses.
    "gather": (lambda mp, s: _before_nth(mp, rendezvous.EtcdRendezvous, "gather", s, calls=2), 1),
    # Round 1's worker started.
    "start": (lambda mp, s: _at(mp, Attempt, "start", s, calls=2), 1),
    # Round 1 runs: its `started` posted (a real worker restores and traces now).
    "first_step": (lambda mp, s: _at(mp, rendezvous.EtcdRendezvous, "post", s, calls=3), 1),
}


@pytest.mark.parametrize("phase,signum", [(phase, signal.SIGTERM) for phase in AGENT_PHASES] + [
    ("gather", signal.SIGINT), ("first_step", signal.SIGINT)])
def test_a_signal_at_each_phase_of_an_agents_re_form_leaves_the_job_with_nothing_lost(tmp_path, monkeypatch, phase,
                                                                                    signum, etcd_server):
    state, workdir = tmp_path / "state", tmp_path / "run"
    state.mkdir()
    workdir.mkdir()
    url = etcd_server.rendezvous_url(f"signal-{phase}-{signum}")
    command = [sys.executable, "-m", "tests.fake_worker", str(state), "kill9,sleep"]
    job = agent.Agent(url, command, dict(os.environ, PYTHONPATH=ROOT), elastic.Bounds(1, 1), workers_per_host=1,
                      host_id="a", address="127.0.0.1", workdir=str(workdir), grace_s=5, wait_for_min_s=30,
                      max_restarts=3, ttl_s=2)
    inject, last_round = AGENT_PHASES[phase]
    with launcher_handlers():
        inject(monkeypatch, signum)
        assert job.run() == 128 + signum
    assert not job.workers.running
    # Round 0's worker, and round 1's if it started: each stopped.
    records = [json.load(open(state / name)) for name in os.listdir(state) if name.endswith(".json")]
    assert 1 <= len(records) <= last_round + 1
    assert all(not os.path.exists(f"/proc/{r['pid']}") for r in records)
    observer = rendezvous.EtcdRendezvous(url)
    observer.generation = job.rdzv.generation
    assert observer.hosts() == {}  # left at once (its lease revoked), not after the TTL
    assert observer.latest_round()[0] == last_round
    assert ("a", {"kind": "leaving"}) in observer.events(job.number if job.number is not None else last_round)
    events = [e for e in files.read_metrics(str(workdir)) if e["split"] == "membership"]
    assert [(e["workers_before"], e["workers_after"], e["seconds_lost"]) for e in events] == (
        [(1, 1, None)] if last_round else [])
