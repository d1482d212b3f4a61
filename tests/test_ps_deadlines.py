"""Parameter servers: a frozen ps or worker ends the chief's attempt within config.distribution.peer_timeout_s,
in one line naming the task (mwloop.cluster.ps_watch), and the launcher's restart resumes from the last checkpoint.

One launcher run (4 TensorFlow processes, started twice: their start-up is most of the time) and the watch
process alone against fake servers.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import portpicker
import pytest

from mwloop.cluster import ps_watch
from tests.test_multiworker import Watched
from tests.test_ps import RECOMMEND, env, stop_leftover_processes, train_losses  # noqa: F401 - a fixture

pytestmark = pytest.mark.slow  # parameter-server clusters and stand-in chiefs: processes

# config.distribution.peer_timeout_s in these runs: short (each frozen task costs the story this long), and still
# far above a busy but live task's answer to the watch's probe (the watch starts once the cluster is up).
DEADLINE = 6
# The seconds a line may say: the deadline, or up to 9 s more on a busy machine (as 1\d s allowed for 10).
WITHIN = "([6-9]|1[0-5])"
SLACK = 15  # the probe's period (0.6 s here), the line's way through the launcher, a busy machine


def ps_env() -> dict[str, str]:
    return dict(env(), GCE_METADATA_IP="127.0.0.1:9")


def launcher(workdir, *, num_workers: int, num_ps: int, max_restarts: int, steps: int) -> list[str]:
    """The recommendation example, kept short: --mode=train (no final eval), no export, small data; a stopped
    task gets 2 s after the launcher's SIGTERM before its SIGKILL."""
    settings = {"train.steps": steps, "train.log_every_steps": 20, "train.eval_every_steps": 0,
                "train.checkpoint_every_steps": 100, "dataset.num_ratings": 20_000, "export": False,
                "distribution.peer_timeout_s": DEADLINE}
    return [sys.executable, "-m", "mwloop.launch", f"--num_workers={num_workers}", f"--num_ps={num_ps}",
            f"--max_restarts={max_restarts}", "--grace_s=2", "--", f"--config={RECOMMEND}", f"--workdir={workdir}",
            "--mode=train", *(f"--config.{k}={v}" for k, v in settings.items())]


def freeze(run: Watched, task: str) -> float:
    """SIGSTOPs the launcher's latest `task` ("ps 1"); the time it was frozen."""
    pid = int(re.findall(rf"started {task} \(pid (\d+)\)", run.output)[-1])
    os.kill(pid, signal.SIGSTOP)
    return time.monotonic()


def frozen_line(run: Watched, frozen_at: float, after: int = 0) -> str:
    """The chief's error line for a frozen task (the first one printed after `after` characters of output),
    checked to come within the deadline."""
    line = run.wait_for(rf"^[\s\S]{{{after}}}[\s\S]*?\[chief\] error: (.*)\n", DEADLINE + SLACK + 30)[1]
    seconds = time.monotonic() - frozen_at
    print(f"frozen -> the chief's line in {seconds:.1f} s: {line}")
    assert DEADLINE - 1 <= seconds < DEADLINE + SLACK, (seconds, line)
    return line


def test_a_frozen_ps_then_the_only_worker_each_end_the_attempt_in_one_line(tmp_path):
    """One cluster of a chief, 1 worker and 2 ps: ps 1 frozen -> named, restart, resume from the checkpoint the
    line named, train on; then the only worker frozen -> named, no restart left: the launcher stops (137). (That
    a restart after a frozen ps also finishes the run: the fault suite's ps_frozen_ps_restarts.)"""
    workdir = tmp_path / "run"
    run = Watched(launcher(workdir, num_workers=1, num_ps=2, max_restarts=1, steps=100_000), ps_env())
    run.wait_for(r"\[chief\].*step 120/100000", 180)  # ckpt-100 saved
    line = frozen_line(run, freeze(run, "ps 1"))
    assert re.fullmatch(rf"ps 1 \(/job:ps/replica:0/task:1 at localhost:\d+\) has not answered for {WITHIN} s "
                        r"\(frozen, or its host or link is down\): the chief ends this attempt \(SIGKILL: it is stuck "
                        r"inside TensorFlow\); a restart of the whole job resumes from ckpt-\d+00 \(the launcher "
                        r"restarts with --max_restarts, .*\); raise config\.distribution\.peer_timeout_s if the task "
                        r"was only slow", line), line
    before = run.output[:run.output.index("[chief] error:")]
    assert re.search(r"\[chief\] waiting for ps 1 \(/job:ps/replica:0/task:1 at localhost:\d+\): no answer for \d+ s; "
                     rf"the chief ends this attempt at {DEADLINE} s \(config\.distribution\.peer_timeout_s\)",
                     before), before[-3000:]
    assert "Traceback" not in before and "waiting for ps 0" not in before and "waiting for worker" not in before
    # The launcher restarts every task (SIGKILL ends the stopped ps); the chief resumes where the line said.
    run.wait_for(r"restart 1/1: chief exited with -9 \(SIGKILL\) \(ps 1 \(/job:ps/replica:0/task:1", 30)
    resumed = int(run.wait_for(r"restart 1/1[\s\S]*\[chief\].*resumed from step (\d+)", 180)[1])
    assert f"resumes from ckpt-{resumed} " in line and resumed >= 100, (resumed, line)
    restarted = len(run.output)
    run.wait_for(rf"restart 1/1[\s\S]*\[chief\].*step {resumed + 40}/100000", 60)  # training again

    line = frozen_line(run, freeze(run, "worker 0"), after=restarted)
    assert re.match(rf"worker 0 \(/job:worker/replica:0/task:0 at localhost:\d+\) has not answered for {WITHIN} s "
                    r"\(frozen",
                    line), line
    assert run.wait(60) == 128 + signal.SIGKILL, run.output[-3000:]
    last = run.output.strip().splitlines()[-1]
    assert re.match(r"error: chief exited with -9 \(SIGKILL\) \(worker 0 \(/job:worker/replica:0/task:0 at "
                    rf"localhost:\d+\) has not answered for {WITHIN} s .*stopped all workers \(1 of 1 restarts done\)",
                    last), last
    assert "Traceback" not in run.output
    steps = [step for step, _ in train_losses(workdir)]
    assert steps == sorted(set(steps)) and steps[-1] > resumed  # the events past ckpt-N were rewritten once


def _servers(answering: int, frozen: int) -> tuple[list, list[str], threading.Event]:
    """gRPC servers answering TensorFlow's GetStatus: `answering` at once, `frozen` never (like a SIGSTOPped
    task: the connection is accepted, no answer comes)."""
    release = threading.Event()

    def handler(wait: bool):
        def get_status(request, context):
            if wait:
                release.wait()
            return b""
        return grpc.method_handlers_generic_handler(
            "tensorflow.WorkerService", {"GetStatus": grpc.unary_unary_rpc_method_handler(get_status)})
    servers, addresses = [], []
    for wait in [False] * answering + [True] * frozen:
        server = grpc.server(futures.ThreadPoolExecutor(4), handlers=[handler(wait)])
        addresses.append(f"localhost:{server.add_insecure_port('localhost:0')}")
        server.start()
        servers.append(server)
    return servers, addresses, release


@pytest.mark.parametrize("timeout_s", [3.0, 0.0])
def test_the_watch_names_the_task_that_does_not_answer_and_ends_the_chief(tmp_path, capfd, timeout_s):
    """No TensorFlow cluster: ps 0 accepts connections but never answers (named), worker 0 answers, worker 1 is
    gone (only logged: worker 0 still runs the steps); the 'chief' is a sleeping process."""
    servers, (worker, frozen), release = _servers(1, 1)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "ckpt-200.index").write_text("")
    chief = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gone = f"localhost:{portpicker.pick_unused_port()}"  # nothing listens: a worker that died (the others work on)
    tasks = [("worker 0", "/job:worker/replica:0/task:0", worker), ("worker 1", "/job:worker/replica:0/task:1", gone),
             ("ps 0", "/job:ps/replica:0/task:0", frozen)]
    try:
        with ps_watch.watching(timeout_s, str(tmp_path), tasks, chief_pid=chief.pid):
            try:
                code = chief.wait(timeout=timeout_s + 8 if timeout_s else 2)
            except subprocess.TimeoutExpired:
                code = None
    finally:
        chief.kill()
        release.set()
        for server in servers:
            server.stop(0)
    lines = capfd.readouterr().err.splitlines()
    waiting = [line for line in lines if line.startswith("waiting for ")]
    assert not any("worker 0" in line for line in lines), lines
    if waiting:
        assert re.search(r"worker 1 \(/job:worker/replica:0/task:1 at localhost:\d+\): unreachable: UNAVAILABLE for "
                         r"\d+ s", waiting[-1]), waiting
    errors = [line for line in lines if line.startswith("error: ")]
    if timeout_s:
        assert waiting and re.search(r"[ ;] ps 0 \(/job:ps/replica:0/task:0 at localhost:\d+\): no answer for \d+ s; "
                                     r"the chief ends this attempt at 3 s", waiting[0]), lines
        assert code == -signal.SIGKILL, (code, lines)
        assert len(errors) == 1 and re.fullmatch(
            r"error: ps 0 \(/job:ps/replica:0/task:0 at localhost:\d+\) has not answered for [34] s \(frozen, or "
            r"its host or link is down\): the chief ends this attempt \(SIGKILL: it is stuck inside TensorFlow\); a "
            r"restart of the whole job resumes from ckpt-200 \(the launcher restarts with --max_restarts, a TFJob "
            r"with its restartPolicy\); raise config\.distribution\.peer_timeout_s if the task was only slow",
            errors[0]), errors
    else:
        assert code is None and not errors, lines  # 0: no deadline (the first waiting line comes at 30 s)
