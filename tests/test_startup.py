"""Joining a cluster never hangs silently: the startup watchdog, its deadline, and the port check.

The end-to-end tests start real workers (`python -m mwloop.main`) with a
TF_CONFIG on localhost ports; each costs a TensorFlow start-up, so there are
few. The watchdog's own behaviour is also checked in-process, without a cluster.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time

import portpicker
import pytest
import tensorflow as tf

from mwloop import errors
from mwloop.cluster import startup
from tests import warm_main
from tests.helpers import ROOT

MLP = os.path.join(ROOT, "configs", "mlp.py")
# TensorFlow's C++ start-up lines, absl log records and tf_logging's echo: everything that is not ours.
TF_CHATTER = re.compile(r"^(WARNING: All log messages before absl|[IWEF]\d{4} |INFO:tensorflow:|WARNING:tensorflow:)")
WAITING = "waiting for the cluster: "
KNOB = "config.distribution.startup_timeout_s"


def ports(n: int) -> list[int]:
    return [portpicker.pick_unused_port() for _ in range(n)]


def start_worker(ports_: list[int], index: int, workdir, **overrides) -> subprocess.Popen:
    """Worker `index` of a worker-only TF_CONFIG on localhost `ports_`, as a user would start it by hand."""
    tf_config = {"cluster": {"worker": [f"localhost:{p}" for p in ports_]}, "task": {"type": "worker", "index": index}}
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3", GCE_METADATA_IP="127.0.0.1:9",
               TF_CONFIG=json.dumps(tf_config))
    args = [f"--config={MLP}", f"--workdir={workdir}", *(f"--config.{k}={v}" for k, v in overrides.items())]
    return warm_main.popen(args, env=env)


def finish(proc: subprocess.Popen, timeout_s: float) -> tuple[int, str, float]:
    """(exit code, stderr, seconds since `proc.started`); kills the worker if it runs past `timeout_s`."""
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()  # SIGKILL: TensorFlow takes SIGTERM over while it starts
        _, stderr = proc.communicate()
        raise AssertionError(f"still running after {timeout_s}s:\n{stderr[-5000:]}") from None
    return proc.returncode, stderr, time.monotonic() - proc.started


def ours(stderr: str) -> list[str]:
    """The lines of stderr that are not TensorFlow's or absl's."""
    return [line for line in stderr.splitlines() if line.strip() and not TF_CHATTER.match(line)]


@pytest.fixture
def workers():
    """Starts workers through `start_worker`, timed; kills whatever is left after the test."""
    started: list[subprocess.Popen] = []

    def start(*args, **kwargs) -> subprocess.Popen:
        proc = start_worker(*args, **kwargs)
        proc.started = time.monotonic()
        started.append(proc)
        return proc
    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_missing_worker_is_named_while_waiting_and_at_the_deadline(workers, tmp_path):
    """Only worker 0 of 2 runs: it says whom it waits for, then exits 2 with one line at the deadline."""
    p = ports(2)
    code, stderr, seconds = finish(workers(p, 0, tmp_path / "run", **{"distribution.startup_timeout_s": 8}), 120)
    lines = ours(stderr)
    print(f"worker 0 alone: exit {code} after {seconds:.1f}s (TensorFlow start-up included); {lines}")
    assert code == errors.USER_ERROR, stderr[-5000:]
    assert "Traceback" not in stderr
    missing = f"worker 1 (localhost:{p[1]})"
    assert lines[0] == f"{WAITING}{missing} not reachable yet (5 s of 8 s)"
    error = (f"error: the cluster did not come up in 8 s: {missing} never became reachable; start it, fix TF_CONFIG, "
             f"or raise {KNOB}")
    assert lines[1:] == [error]
    assert 8 < seconds < 8 + 90  # the deadline counts from the strategy's creation, after TensorFlow's import
    assert not (tmp_path / "run").exists()  # nothing written


@pytest.mark.slow
def test_port_in_use_is_one_line_and_the_peer_stops_at_the_deadline(workers, tmp_path):
    """Worker 0's port is taken (by a socket this test holds): worker 0 exits 2 naming it, before TensorFlow
    starts its server; worker 1 finds that port answering but worker 0 never joining, and exits 2 too."""
    p = ports(2)
    with socket.create_server(("127.0.0.1", p[0])):
        w0 = workers(p, 0, tmp_path / "run", **{"distribution.startup_timeout_s": 8})
        w1 = workers(p, 1, tmp_path / "run", **{"distribution.startup_timeout_s": 8})
        code0, stderr0, seconds0 = finish(w0, 120)
        code1, stderr1, seconds1 = finish(w1, 120)
    print(f"port taken: worker 0 exit {code0} after {seconds0:.1f}s {ours(stderr0)}; "
          f"worker 1 exit {code1} after {seconds1:.1f}s {ours(stderr1)}")
    port_taken = (f"error: worker 0 cannot listen on localhost:{p[0]} (address already in use); free the port or "
                  f"pick another in TF_CONFIG")
    assert (code0, ours(stderr0)) == (errors.USER_ERROR, [port_taken]), stderr0[-5000:]
    never_joined = ("error: the cluster did not come up in 8 s: every task's address accepts connections, but not "
                    "every task joined (another program on one of those ports, or a task stuck starting); check "
                    f"TF_CONFIG and the tasks' logs, or raise {KNOB}")
    assert (code1, ours(stderr1)) == (errors.USER_ERROR, [never_joined]), stderr1[-5000:]


# The normal run (both workers started together train to the end, no watchdog line after the start-up, no error)
# is checked by tests/test_multiworker.py's chief-and-worker test: one pair of TensorFlow processes for both.


def resolver_for(addresses: list[str], index: int = 0) -> tf.distribute.cluster_resolver.ClusterResolver:
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": addresses}), task_type="worker", task_id=index)


def test_watchdog_is_quiet_once_the_peer_answers_and_puts_sigint_back(capfd):
    """In-process: a reachable peer logs nothing, and Python's SIGINT handler is back afterwards."""
    # Python's own handler to start from, whatever an earlier test of this process left; theirs is put back.
    left = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with socket.create_server(("127.0.0.1", 0)) as peer:
            addresses = ["localhost:1", f"localhost:{peer.getsockname()[1]}"]
            with startup.watchdog(resolver_for(addresses), timeout_s=300):
                time.sleep(0.2)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert capfd.readouterr().err == ""
        with pytest.raises(KeyboardInterrupt):  # Ctrl-C is Python's again (not _exit)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    finally:
        signal.signal(signal.SIGINT, left)


def test_watchdog_names_a_missing_peer_and_never_fires_without_a_deadline(capfd, monkeypatch):
    monkeypatch.setattr(startup, "STARTUP_PROBE_EVERY_S", 0.3)
    missing = portpicker.pick_unused_port()
    with startup.watchdog(resolver_for(["localhost:1", f"localhost:{missing}"]), timeout_s=0):
        time.sleep(1.5)
    err = capfd.readouterr().err
    assert re.match(rf"{WAITING}worker 1 \(localhost:{missing}\) not reachable yet \(0 s, no deadline\)\n", err), err
    assert "error" not in err


def test_single_task_cluster_needs_no_watchdog(capfd):
    with startup.watchdog(resolver_for(["localhost:1"]), timeout_s=0.01):
        time.sleep(0.3)
    assert capfd.readouterr().err == ""
