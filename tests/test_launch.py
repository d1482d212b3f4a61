"""mwloop.launch with stand-in workers (tests/fake_worker.py): fast, no TensorFlow.

What it pins down: per-worker TF_CONFIG, prefixed output, fail-fast, SIGTERM
then SIGKILL, restarts on crash or preemption up to --max_restarts, Ctrl-C.
"""

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from mwloop.cluster import distribute
from tests.helpers import ROOT

pytestmark = pytest.mark.slow  # every test starts the launcher (with stand-in workers)

ENV = dict(os.environ, PYTHONPATH=ROOT)


def launcher(state_dir, *plans: str, max_restarts: int = 0, grace_s: float = 10.0) -> list[str]:
    return [sys.executable, "-m", "mwloop.launch", f"--num_workers={len(plans)}", f"--max_restarts={max_restarts}",
            f"--grace_s={grace_s}", "--module=tests.fake_worker", "--", str(state_dir), *plans]


def run(state_dir, *plans: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(launcher(state_dir, *plans, **kwargs), env=ENV, cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def starts(state_dir) -> dict[str, dict]:
    """{'<index>-<attempt>': {'pid': ..., 'tf_config': ...}} of every worker start."""
    return {os.path.basename(p)[:-5]: json.load(open(p)) for p in glob.glob(os.path.join(state_dir, "*.json"))}


def test_workers_get_their_own_tf_config_and_prefixed_output(tmp_path):
    result = run(tmp_path, "ok", "ok", "ok")
    assert result.returncode == 0, result.stderr
    configs = {k: v["tf_config"] for k, v in starts(tmp_path).items()}
    assert sorted(configs) == ["0-0", "1-0", "2-0"]
    clusters = {json.dumps(c["cluster"]) for c in configs.values()}
    assert len(clusters) == 1 and len(configs["0-0"]["cluster"]["worker"]) == 3  # one cluster, 3 ports
    for key, config in configs.items():
        assert distribute.parse_tf_config(json.dumps(config))["task"] == {"type": "worker", "index": int(key[0])}
    for i in range(3):
        assert f"[worker {i}] hello from {i} attempt 0: ok\n" in result.stdout
        assert f"[worker {i}] to stderr from {i}\n" in result.stderr
    assert "all 3 workers finished" in result.stderr


def test_a_failing_worker_stops_the_others(tmp_path):
    t0 = time.monotonic()
    result = run(tmp_path, "sleep", "exit3")
    assert result.returncode == 3
    assert time.monotonic() - t0 < 8  # SIGTERM at once, not after the 10 s grace
    assert "worker 1 exited with 3; stopped all workers" in result.stderr
    assert "worker exits: 0 exited with -15 (SIGTERM), 1 exited with 3" in result.stderr


def test_a_worker_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path):
    result = run(tmp_path, "hang", "kill9", grace_s=0.5)
    assert result.returncode == 128 + 9
    assert "worker 1 exited with -9 (SIGKILL); stopped all workers" in result.stderr
    assert "0 exited with -9 (SIGKILL)" in result.stderr  # escalated after SIGTERM was ignored


def test_restarts_all_workers_on_fresh_ports_after_a_crash(tmp_path):
    result = run(tmp_path, "sleep,ok", "kill9,ok", max_restarts=2)
    assert result.returncode == 0, result.stderr
    assert "restart 1/2: worker 1 exited with -9 (SIGKILL); restarting all workers" in result.stderr
    runs = starts(tmp_path)
    assert sorted(runs) == ["0-0", "0-1", "1-0", "1-1"]  # everyone restarted once, no second restart
    assert runs["0-0"]["tf_config"]["cluster"] != runs["0-1"]["tf_config"]["cluster"]  # fresh ports


def test_gives_up_after_max_restarts(tmp_path):
    result = run(tmp_path, "exit42", "exit42", max_restarts=1)  # preempted on every attempt
    assert result.returncode == 42
    # Both workers exit 42 at once: whichever the launcher sees first is named.
    assert re.search(r"restart 1/1: worker [01] exited with 42; restarting all workers", result.stderr), result.stderr
    assert re.search(r"worker [01] exited with 42; stopped all workers \(1 of 1 restarts done\)", result.stderr)
    assert len(starts(tmp_path)) == 4


def test_ctrl_c_and_sigterm_stop_all_workers(tmp_path):
    for signum, code in ((signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)):  # HUP: like TERM
        state_dir = tmp_path / signum.name
        state_dir.mkdir()
        proc = subprocess.Popen(launcher(state_dir, "sleep", "sleep"), env=ENV, cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        while len(starts(state_dir)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=30)
        assert proc.returncode == code, stderr
        for worker in starts(state_dir).values():
            assert not _alive(worker["pid"])


def test_sigterm_says_which_workers_could_not_save_when_they_had_to_be_killed(tmp_path):
    """A worker that ignores SIGTERM (a chief stuck on a frozen ps) is killed after --grace_s: the launcher must
    not claim the workers saved."""
    proc = subprocess.Popen(launcher(tmp_path, "sleep", "hang", grace_s=0.5), env=ENV, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while len(starts(tmp_path)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 143, stderr
    hung = starts(tmp_path)["1-0"]["pid"]
    assert f"SIGTERM: 1 process(es) did not stop within --grace_s=0.5 and were killed (pid {hung}); a rerun " \
           "resumes from the last checkpoint saved before" in stderr
    assert "the workers saved a checkpoint" not in stderr


def test_restarts_three_times_by_default_and_ends_with_one_error_line(tmp_path):
    command = [sys.executable, "-m", "mwloop.launch", "--num_workers=2", "--grace_s=1", "--module=tests.fake_worker",
               "--", str(tmp_path), "exit1", "sleep"]
    result = subprocess.run(command, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "restart 3/3: worker 0 exited with 1; restarting all workers" in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "error: worker 0 exited with 1; stopped all workers (3 of 3 restarts done); rerun to resume from the last "
        "checkpoint")
    assert len(starts(tmp_path)) == 8


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
