"""Signals and exit codes: no orphans, Ctrl-C saves, a user error is not restarted.

The launcher's own logic runs with stand-in workers (tests/fake_worker.py,
milliseconds); what TensorFlow workers do runs with real `mwloop.main`
processes on the MLP config (seconds each).
"""

from __future__ import annotations

import glob
import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from mwloop import errors
from tests import warm_main
from tests.helpers import ROOT
from tests.test_launch import launcher as fake_launcher
from tests.test_launch import starts

pytestmark = pytest.mark.slow  # signals to launcher and mwloop.main processes

ENV = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3", GCE_METADATA_IP="127.0.0.1:9")
MLP = ["--config=configs/mlp.py", "--mode=train", "--config.export=False", "--config.train.eval_every_steps=0"]


class Watched:
    """A subprocess whose merged output is collected by a thread, so a test can wait for a line."""

    def __init__(self, command: list[str], **kwargs):
        if command[:3] == main_command("")[:3] and not kwargs:
            self.proc = warm_main.popen(command[3:], env=ENV, stderr=subprocess.STDOUT)
        else:
            # A launcher of mwloop.main workers forks its warm-start server from the test's, unless the test
            # signals its whole process group (kwargs: a session of its own), which forked tasks are not in.
            launcher = command[:3] == [sys.executable, "-m", "mwloop.launch"] and "--module" not in " ".join(command)
            env = warm_main.serving(ENV) if launcher and not kwargs else ENV
            self.proc = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True, **kwargs)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout_s: float = 60) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if match := re.search(pattern, self.output):
                return match
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.02)
        raise AssertionError(f"no {pattern!r} in the output:\n{self.output[-5000:]}")

    def wait(self, timeout_s: float = 60) -> int:
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout_s}s:\n{self.output[-5000:]}") from None
        self._reader.join(timeout=10)
        return code

    def kill_tree(self) -> None:
        """Test cleanup: SIGKILL the process and any children it left."""
        try:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                child.kill()
        except psutil.NoSuchProcess:
            pass
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def watched():
    """Starts Watched processes; kills whatever is left of them after the test."""
    started: list[Watched] = []

    def start(command: list[str], **kwargs) -> Watched:
        started.append(Watched(command, **kwargs))
        return started[-1]
    yield start
    for w in started:
        w.kill_tree()


def main_command(workdir, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "mwloop.main", *MLP, f"--workdir={workdir}", *overrides]


def launch_command(workdir, *overrides: str, num_workers: int = 2, max_restarts: int = 0) -> list[str]:
    return [sys.executable, "-m", "mwloop.launch", f"--num_workers={num_workers}", f"--max_restarts={max_restarts}",
            "--", *MLP, f"--workdir={workdir}", *overrides]


def saved_steps(workdir) -> list[int]:
    return sorted(int(p.rsplit("-", 1)[1][:-len(".index")])
                  for p in glob.glob(os.path.join(workdir, "checkpoints", "ckpt-*.index")))


def worker_pids(output: str) -> list[int]:
    return [int(pid) for pid in re.findall(r"started worker \d+ \(pid (\d+)\)", output)]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# --- The launcher, with stand-in workers ---


def test_launcher_does_not_restart_a_user_error(tmp_path):
    result = subprocess.run(fake_launcher(tmp_path, "sleep", f"exit{errors.USER_ERROR}", max_restarts=2), env=ENV,
                            cwd=ROOT, capture_output=True, text=True, check=False, timeout=60)
    assert result.returncode == errors.USER_ERROR, result.stderr
    assert "(stopped all workers, no restart: it would repeat)" in result.stderr.strip().splitlines()[-1]
    assert sorted(starts(tmp_path)) == ["0-0", "1-0"]  # one attempt


def test_a_worker_interrupted_alone_is_not_restarted(tmp_path):
    result = subprocess.run(fake_launcher(tmp_path, "sleep", f"exit{errors.INTERRUPTED}", max_restarts=2, grace_s=0.5),
                            env=ENV, cwd=ROOT, capture_output=True, text=True, check=False, timeout=60)
    assert result.returncode == errors.INTERRUPTED, result.stderr
    assert "worker 1 was interrupted (exit 130); stopped all workers, no restart" in result.stderr
    assert sorted(starts(tmp_path)) == ["0-0", "1-0"]


@pytest.mark.parametrize("workers_too", [False, True], ids=["launcher_alone", "whole_group"])
def test_ctrl_c_to_the_launcher_lets_every_worker_save_once(tmp_path, watched, workers_too):
    """Ctrl-C to the launcher alone, or to its whole process group as a terminal sends it: each worker is
    interrupted once (the forwarded signal does not count as a second Ctrl-C), saves, exits 130."""
    launched = watched(fake_launcher(tmp_path, "save1", "save1"), start_new_session=True)
    launched.wait_for(r"hello from 0 attempt 0")
    launched.wait_for(r"hello from 1 attempt 0")
    t0 = time.monotonic()
    if workers_too:
        os.killpg(launched.proc.pid, signal.SIGINT)
    else:
        launched.proc.send_signal(signal.SIGINT)
    assert launched.wait() == errors.INTERRUPTED, launched.output
    got = r"(SIGINT\+SIGUSR1|SIGUSR1\+SIGINT)" if workers_too else "SIGUSR1"  # whole group: one Ctrl-C, both
    for i in range(2):
        assert re.search(rf"{i}: saved after {got}\n", launched.output), launched.output
    assert "worker exits: 0 exited with 130, 1 exited with 130" in launched.output  # saved, not killed
    assert "Traceback" not in launched.output
    print(f"launcher exited {time.monotonic() - t0:.1f}s after Ctrl-C (workers 'save' for 1s)")


def test_a_second_ctrl_c_to_the_launcher_kills_the_workers_at_once(tmp_path, watched):
    launched = watched(fake_launcher(tmp_path, "save60", "save60"))
    launched.wait_for(r"hello from 0 attempt 0")
    launched.wait_for(r"hello from 1 attempt 0")
    launched.proc.send_signal(signal.SIGINT)
    launched.wait_for(r"1: interrupted by SIGUSR1; saving")
    t0 = time.monotonic()
    launched.proc.send_signal(signal.SIGINT)
    assert launched.wait(timeout_s=10) == errors.INTERRUPTED, launched.output
    assert time.monotonic() - t0 < 5
    assert "Ctrl-C while it was stopping; sending SIGKILL" in launched.output
    assert "worker exits: 0 exited with -9 (SIGKILL), 1 exited with -9 (SIGKILL)" in launched.output
    assert "Traceback" not in launched.output


# --- Real TensorFlow workers ---


def test_sigkill_of_the_launcher_leaves_no_worker_and_a_relaunch_resumes(tmp_path, watched):
    workdir = tmp_path / "run"
    endless = ["--config.train.steps=1000000", "--config.train.log_every_steps=100",
               "--config.train.checkpoint_every_steps=100"]
    launched = watched(launch_command(workdir, *endless))
    launched.wait_for(r"\[worker 0\] .*step 200/")
    pids = worker_pids(launched.output)
    assert len(pids) == 2 and saved_steps(workdir)
    launched.proc.kill()
    t0 = time.monotonic()
    while any(alive(pid) for pid in pids) and time.monotonic() - t0 < 10:
        time.sleep(0.01)
    gone_s = time.monotonic() - t0
    print(f"no worker left {gone_s:.2f}s after SIGKILL of the launcher")
    assert not any(alive(pid) for pid in pids), f"workers outlived the launcher by {gone_s:.1f}s"

    last = saved_steps(workdir)[-1]  # the kill may have hit a save: the relaunch may fall back one checkpoint
    relaunched = watched(launch_command(workdir, f"--config.train.steps={last + 20}",  # shorter, on purpose:
                                        "--config.train.allow_changed=train.steps",  # (resume_check)
                                        "--config.train.log_every_steps=20"))
    assert relaunched.wait() == 0, relaunched.output[-5000:]
    resumed = int(re.search(r"\[worker 0\] .*resumed from step (\d+)", relaunched.output)[1])
    assert 0 < resumed <= last and "in use by a live run" not in relaunched.output


def test_ctrl_c_saves_at_the_current_step_exits_130_and_resumes_there(tmp_path, watched):
    workdir = tmp_path / "run"
    run = watched(main_command(workdir, "--config.train.steps=20000", "--config.distribution.strategy=default",
                               "--config.train.checkpoint_every_steps=0"))
    run.wait_for(r"step 1000/20000")
    run.proc.send_signal(signal.SIGINT)
    assert run.wait() == errors.INTERRUPTED, run.output[-3000:]
    saved = int(run.wait_for(r"interrupted: saving a checkpoint at step (\d+)")[1])
    print(f"SIGINT: exit {run.proc.returncode}, saved step {saved}")
    assert saved >= 1000 and saved_steps(workdir) == [saved]  # the interrupt's checkpoint, no other
    assert "Traceback" not in run.output and "KeyboardInterrupt" not in run.output

    rerun = warm_main.run(main_command(workdir, f"--config.train.steps={saved + 20}",
                                       "--config.train.allow_changed=train.steps",  # shorter on purpose
                                       "--config.distribution.strategy=default")[3:], env=ENV, timeout=120)
    assert rerun.returncode == 0 and f"resumed from step {saved}" in rerun.stderr, rerun.stderr[-3000:]


def test_a_second_ctrl_c_exits_at_once_without_saving(tmp_path, watched):
    """Even inside a long loop call (20000 steps, seconds): the signal thread exits, not the busy main thread."""
    workdir = tmp_path / "run"
    run = watched(main_command(workdir, "--config.train.steps=1000000", "--config.train.steps_per_loop=20000",
                               "--config.train.log_every_steps=20000", "--config.train.checkpoint_every_steps=0",
                               "--config.distribution.strategy=default"))
    run.wait_for(r"step 20000/", timeout_s=180)  # a slow, loaded machine: this waits, it tests nothing
    time.sleep(0.2)  # into the second loop call
    run.proc.send_signal(signal.SIGINT)
    run.wait_for(r"received SIGINT: saving a checkpoint at the end of this loop call")
    t0 = time.monotonic()
    run.proc.send_signal(signal.SIGINT)  # (two at once would merge into one pending signal)
    assert run.wait() == errors.INTERRUPTED, run.output[-3000:]
    print(f"second SIGINT: exited {time.monotonic() - t0:.2f}s after it")
    assert "received SIGINT again: exiting now" in run.output
    assert "interrupted: saving a checkpoint" not in run.output and saved_steps(workdir) == []
    assert "Traceback" not in run.output


def test_launcher_stops_on_a_user_error_without_restarting(tmp_path):
    result = subprocess.run(launch_command(tmp_path / "run", "--config.train.stepz=1", max_restarts=2),
                            env=warm_main.serving(ENV), cwd=ROOT, capture_output=True, text=True, check=False,
                            timeout=120)
    assert result.returncode == errors.USER_ERROR, result.stderr[-3000:]
    assert "error: unknown config key 'stepz' (did you mean 'steps'?)" in result.stderr
    assert "(stopped all workers, no restart: it would repeat)" in result.stderr.strip().splitlines()[-1]
    assert len(worker_pids(result.stderr)) == 2 and "restart 1/2" not in result.stderr


@pytest.mark.parametrize("whole_group", [False, True], ids=["one_worker", "whole_group"])
def test_ctrl_c_in_multi_worker_saves_on_every_worker_at_one_step_and_exits_130(tmp_path, watched, whole_group):
    """SIGINT to one worker (the others learn it through the preemption handler), or to the launcher and
    its workers at once as a terminal's Ctrl-C: all save at the same step, all exit 130, no restart."""
    workdir = tmp_path / "run"
    launched = watched(launch_command(workdir, "--config.train.steps=1000000", "--config.train.log_every_steps=100",
                                      "--config.train.checkpoint_every_steps=0", max_restarts=2),
                       # The whole group's Ctrl-C: a group of its own (and its own warm-start server, whose tasks
                       # are in it).
                       **({"start_new_session": True} if whole_group else {}))
    launched.wait_for(r"\[worker 0\] .*step 200/")
    if whole_group:
        os.killpg(launched.proc.pid, signal.SIGINT)
    else:
        os.kill(worker_pids(launched.output)[1], signal.SIGINT)
    assert launched.wait() == errors.INTERRUPTED, launched.output[-5000:]
    saved = re.findall(r"\[worker (\d)\] .*interrupted: saving a checkpoint at step (\d+)", launched.output)
    assert sorted(w for w, _ in saved) == ["0", "1"] and len({step for _, step in saved}) == 1, launched.output
    assert saved_steps(workdir) == [int(saved[0][1])]
    assert "worker exits: 0 exited with 130, 1 exited with 130" in launched.output
    assert "restart 1/2" not in launched.output and "Traceback" not in launched.output
