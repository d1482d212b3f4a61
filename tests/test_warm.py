"""mwloop.launcher.warm: tasks forked from one server that imported TensorFlow once.

One server for the whole story (its import is the one TensorFlow start-up this file pays); the launcher,
elastic, agent and sweep suites run every task through it as well."""

import os
import sys
import time

import psutil
import pytest

from mwloop import errors
from mwloop.launcher import warm, warm_server
from mwloop.run import goodput_clock
from tests.helpers import ROOT


def _main(*args: str) -> list[str]:
    return [sys.executable, "-m", "mwloop.main", *args]


def _gone(pid: int, timeout_s: float = 30) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.05)
    return False


def test_a_forked_task_counts_its_start_up_from_when_it_was_asked_for(monkeypatch):
    """The server imported for it, perhaps while the launcher waited: that wait is start-up, as a fresh
    process's imports are; a task asked for after its creation (never, but a clock may say so) counts from then."""
    monkeypatch.setattr(goodput_clock, "_process_start_taken", False)
    monkeypatch.setattr(goodput_clock, "_work_started", None)
    created = goodput_clock.process_start_time()
    goodput_clock.count_from(created - 30.0)
    assert goodput_clock._start_of_this_clock() == pytest.approx(created - 30.0)
    monkeypatch.setattr(goodput_clock, "_process_start_taken", False)
    goodput_clock.count_from(created + 30.0)
    assert goodput_clock._start_of_this_clock() == pytest.approx(created + 30.0)
    # A second clock in one process starts when it is made.
    assert goodput_clock._start_of_this_clock() == pytest.approx(goodput_clock.time.time(), abs=1.0)


@pytest.mark.slow  # a server process that imports TensorFlow, and tasks forked from it
def test_forked_tasks_are_the_command_they_stand_for_and_die_with_the_server(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=ROOT)
    server = warm.WarmServer()
    try:
        # Its own environment (TF_CONFIG per task) and its own stderr: a user error is one line, exit 2.
        bad = server.start(_main("--config=configs/mlp.py", f"--workdir={tmp_path / 'a'}"),
                           dict(env, TF_CONFIG="{not json"))
        assert isinstance(bad, warm.WarmProcess) and bad.pid != server.server.pid
        assert bad.wait(timeout=120) == errors.USER_ERROR
        assert b"TF_CONFIG" in bad.stderr.read() and bad.stdout.read() == b""

        # What cannot be forked from this server starts cold (None): another module, another environment.
        assert server.start([sys.executable, "-m", "tests.fake_worker"], env) is None
        assert server.start(_main("--help"), dict(env, TF_CPP_MIN_LOG_LEVEL="0")) is None

        # A sweep trial's output: one descriptor for both streams; its MWLOOP_TRIAL may differ per task.
        log = tmp_path / "log.txt"
        with open(log, "ab") as f:
            typo = server.start(_main("--config=configs/mlp.py", f"--workdir={tmp_path / 'b'}",
                                      "--config.train.stepz=1"), dict(env, MWLOOP_TRIAL="7"), output=f.fileno())
        assert typo.stdout is None and typo.wait(timeout=120) == errors.USER_ERROR
        assert "unknown config key 'stepz'" in log.read_text()

        # Signals reach it by pid and its exit code says which; a SIGKILLed task is -9, as with Popen.
        long_run = _main("--config=configs/mlp.py", f"--workdir={tmp_path / 'c'}", "--config.train.steps=1000000")
        killed = server.start(long_run, env)
        with pytest.raises(Exception, match="pid"):
            killed.wait(timeout=0.5)
        killed.kill()
        assert killed.wait(timeout=60) == -9

        # A task still running when the server ends goes with it (PR_SET_PDEATHSIG): no orphan.
        orphan = server.start(long_run[:-1] + [f"--workdir={tmp_path / 'd'}"], env)
        time.sleep(1)
    finally:
        server.close()
    assert _gone(orphan.pid) and orphan.wait(timeout=10) == -9


def test_a_forked_task_takes_the_interpreter_settings_of_its_own_environment(tmp_path, monkeypatch):
    """A server whose callers let PYTHONPATH and PYTHONUNBUFFERED vary per task (the tests' servers): the child
    gets the sys.path and the unbuffered streams a fresh interpreter with its environment would have had."""
    extra, gone = str(tmp_path / "task_modules"), str(tmp_path / "servers_modules")
    monkeypatch.setattr(sys, "path", [ROOT, gone, "/usr/lib/python3.11"])
    monkeypatch.setenv("PYTHONPATH", gone)
    out = open(tmp_path / "out.txt", "w")  # buffered, as a server's stdout is without -u
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "__stdout__", out)
    monkeypatch.setattr(sys, "stderr", open(tmp_path / "err.txt", "w"))
    monkeypatch.setattr(sys, "__stderr__", sys.stderr)
    warm_server._take_interpreter_env({"PYTHONPATH": f"{extra}{os.pathsep}{ROOT}", "PYTHONUNBUFFERED": "1"})
    assert sys.path == [ROOT, extra, ROOT, "/usr/lib/python3.11"]
    sys.stdout.write("seen at once")
    assert (tmp_path / "out.txt").read_text() == "seen at once"  # no flush: unbuffered
    assert sys.__stdout__ is sys.stdout and sys.stderr.write_through

    warm_server._take_interpreter_env({"PYTHONPATH": f"{extra}{os.pathsep}{ROOT}"})  # the same: nothing changes
    assert sys.path == [ROOT, extra, ROOT, "/usr/lib/python3.11"]


@pytest.mark.slow  # a server process that imports TensorFlow
def test_a_launcher_given_a_listening_server_forks_its_own_from_it_and_its_tasks_end_with_it(tmp_path, monkeypatch):
    """warm.PARENT_ENV: a launcher's server is forked from a running one (no import of its own) when their
    environments agree; its tasks end when the launcher's end closes; another environment gets a server of
    its own."""
    monkeypatch.chdir(ROOT)
    env = dict(os.environ, PYTHONPATH=ROOT)
    parent = warm.WarmServer(listen=True)
    launchers: list[warm.WarmServer] = []
    try:
        parent.open(env)
        monkeypatch.setenv(warm.PARENT_ENV, parent.listen_path)
        launchers.append(warm.WarmServer())
        task = launchers[0].start(_main("--config=configs/mlp.py", f"--workdir={tmp_path / 'a'}",
                                        "--config.train.steps=1000000"), dict(env, PYTHONUNBUFFERED="1"))
        assert isinstance(launchers[0].server, warm._ForkedServer) and task is not None
        assert psutil.Process(launchers[0].server.pid).ppid() == parent.server.pid  # forked, not started
        assert not parent.idle()  # a server forked from it runs: closing it would end that one's tasks
        with pytest.raises(Exception, match="pid"):
            task.wait(timeout=1)  # it trains

        # Another environment (read by imports): a server of its own, started as before.
        launchers.append(warm.WarmServer())
        launchers[1].open(dict(env, TF_CPP_MIN_LOG_LEVEL="0"))
        assert isinstance(launchers[1].server, warm.subprocess.Popen)

        launchers[0].close()  # the launcher's end closes (as when it is SIGKILLed): its tasks go with its server
        assert _gone(task.pid)
        deadline = time.monotonic() + 30
        while not parent.idle() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert parent.idle()
    finally:
        for server in (*launchers, parent):
            server.close()


def test_a_parent_server_that_is_not_there_leaves_the_launcher_its_own(tmp_path):
    """A stale MWLOOP_WARM_SERVER (its server gone, or no socket at all): no fork, the caller starts a server of its
    own (`_launch` falls back) instead of waiting or failing."""
    server = warm.WarmServer()
    assert server._fork_from(str(tmp_path / "gone" / "server"), dict(os.environ)) is False
    not_a_server = tmp_path / "file"
    not_a_server.write_text("")
    assert server._fork_from(str(not_a_server), dict(os.environ)) is False
    assert server.server is None and server._socket is None
