"""Multi-worker training: real MultiWorkerMirroredStrategy processes on localhost ports.

Each TensorFlow process costs seconds, so each test runs few of them and checks
several things at once. Single-process reference runs happen in the test
process itself.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import portpicker
import pytest
import tensorflow as tf

from mwloop.artifacts import checkpoint, goodput
from mwloop.run import train
from tests import warm_main
from tests.digest_worker import state_digest
from tests.helpers import ROOT, load_config, read_metrics
from tests.test_startup import WAITING as STARTUP_WAITING

pytestmark = pytest.mark.slow  # multi-worker runs: TensorFlow worker processes

MLP = os.path.join(ROOT, "configs", "mlp.py")
PLAIN_SGD = {"optimizer.momentum": 0.0, "optimizer.weight_decay": 0.0, "optimizer.schedule": "constant"}
CHIEF_FILES = {"checkpoints", "config.json", "metrics.jsonl", "summaries"}
OPTIONAL_CHIEF_FILES = {".lock", "export"}


class Watched:
    """A subprocess whose merged output is collected line by line, so a test can wait for a line."""
    started: list[Watched] = []  # stopped after each test, whatever happened

    def __init__(self, command: list[str], env: dict[str, str]):
        if command[:3] == [sys.executable, "-m", "mwloop.main"]:  # a worker started by hand: forked warm
            self.proc = warm_main.popen(command[3:], env=env, stderr=subprocess.STDOUT)
        else:
            self.proc = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True)
        Watched.started.append(self)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    def stop(self) -> None:
        """SIGTERM (a launcher then stops its workers), SIGKILL if still running after 20 s."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout_s: float = 90) -> re.Match:
        """The first match of `pattern` in the output, waiting for it to appear."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            match = re.search(pattern, self.output)
            if match:
                return match
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} in the output:\n{self.output[-5000:]}")

    def wait(self, timeout_s: float) -> int:
        """The exit code; fails (after stopping the process) if it runs past `timeout_s`."""
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"still running after {timeout_s}s:\n{self.output[-5000:]}") from None
        self._reader.join(timeout=10)
        return code


@pytest.fixture(autouse=True)
def stop_leftover_processes():
    yield
    while Watched.started:
        Watched.started.pop().stop()


def env_for_workers(tmp_path) -> dict[str, str]:
    """Worker environment; TMPDIR is the test's own, so leftover temporary directories can be seen. A launcher
    started with it forks its warm-start server from this test process's (warm_main.serving)."""
    tmpdir = tmp_path / "worker_tmp"
    tmpdir.mkdir(exist_ok=True)
    return warm_main.serving(dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", TMPDIR=str(tmpdir),
                                  GCE_METADATA_IP="127.0.0.1:9"))


def flags(workdir, **overrides) -> list[str]:
    return [f"--config={MLP}", f"--workdir={workdir}", *(f"--config.{k}={v}" for k, v in overrides.items())]


def launcher(workdir, num_workers=2, max_restarts=0, **overrides) -> list[str]:
    return [sys.executable, "-m", "mwloop.launch", f"--num_workers={num_workers}",
            f"--max_restarts={max_restarts}", "--", *flags(workdir, **overrides)]


def by_hand(cluster: dict[str, list[str]], tasks: list[tuple[str, int]], args: list[str], env: dict[str, str],
            module: str = "mwloop.main") -> list[Watched]:
    """One process per (task type, index), with the TF_CONFIG a user would set on each machine."""
    return [Watched([sys.executable, "-m", module, *args],
                    dict(env, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}})))
            for kind, index in tasks]


def localhost_ports(n: int) -> list[str]:
    return [f"localhost:{portpicker.pick_unused_port()}" for _ in range(n)]


def assert_chief_files_only(workdir, tmp_path, killed: bool = False) -> None:
    """The chief's outputs and nothing else in the workdir; no worker left a checkpoint directory
    (unless one was killed, perhaps mid-save)."""
    assert set(os.listdir(workdir)) - OPTIONAL_CHIEF_FILES == CHIEF_FILES
    assert all(re.fullmatch(r"checkpoint|ckpt-\d+\.(index|data-\d+-of-\d+|config\.json)", f)
               for f in os.listdir(os.path.join(workdir, "checkpoints")))
    left = {d: sorted(os.listdir(d)) for d in glob.glob(str(tmp_path / "worker_tmp" / "mwloop-worker*"))}
    assert killed or left == {}, left
    assert glob.glob(str(tmp_path / "worker_tmp" / "mwloop-preemption-handler*")) == []  # never made (issue 31)
    # Each step's events once, from the chief only (attempt records: one per start, several may start at one step).
    events = [(e["step"], e["split"]) for e in read_metrics(workdir) if e["split"] != goodput.ATTEMPT]
    assert len(events) == len(set(events)), events


def checkpoint_weights(workdir, step: int) -> dict[str, np.ndarray]:
    """The weight tensors of a checkpoint (Keras 3 stores them under optimizer/_trainable_variables)."""
    reader = tf.train.load_checkpoint(os.path.join(workdir, "checkpoints", f"ckpt-{step}"))
    values = {name: np.asarray(reader.get_tensor(name)) for name in reader.get_variable_to_shape_map()}
    return {name: v for name, v in values.items() if v.ndim and v.dtype.kind == "f"}


def train_here(workdir, mode="train", **overrides) -> None:
    """A single-process reference run in the test process (no start-up cost)."""
    train.train_and_evaluate(load_config("mlp", **{"distribution.strategy": "default", **overrides}), str(workdir),
                             mode)


def test_two_workers_through_the_launcher_match_one_worker(tmp_path):
    """Global batch B on 2 workers = global batch B on 1 worker (loss scaling and sharding together),
    and only the chief writes."""
    steps = dict(PLAIN_SGD, **{"train.steps": 20, "train.steps_per_loop": 10, "train.log_every_steps": 10,
                               "train.eval_every_steps": 20, "train.checkpoint_every_steps": 20})
    two = tmp_path / "two_workers"
    run = subprocess.run(launcher(two, **steps), env=env_for_workers(tmp_path), cwd=ROOT, capture_output=True,
                         text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-5000:]
    assert re.search(r"\[worker 0\] .*2 replicas, 2 workers, chief=True", run.stderr)
    assert re.search(r"\[worker 1\] .*2 replicas, 2 workers, chief=False", run.stderr)
    assert_chief_files_only(two, tmp_path)
    assert [(e["step"], e["split"]) for e in read_metrics(two) if e["split"] not in goodput.RECORDS] == [
        (10, "train"), (20, "train"), (20, "eval")]

    one = tmp_path / "one_worker"
    train_here(one, **steps)
    a, b = checkpoint_weights(two, 20), checkpoint_weights(one, 20)
    assert a.keys() == b.keys() and len(a) >= 4
    relative = {k: float(np.max(np.abs(a[k] - b[k])) / np.max(np.abs(b[k]))) for k in a}
    worst = max(relative, key=relative.get)
    print(f"2 workers vs 1 worker after 20 steps: largest relative weight difference {relative[worst]:.2e} ({worst})")
    assert relative[worst] < 1e-5  # not bitwise: the gradient sums are added in another order


def test_two_workers_accumulating_4_micro_batches_match_one_worker_without(tmp_path):
    """gradient_accumulation_steps=4 on 2 workers (tf.data input cut into micro-batches of B/8 per replica)
    = one step of the global batch B on 1 worker: one all-reduce per update, exact loss scaling, same data."""
    steps = dict(PLAIN_SGD, **{"train.steps": 20, "train.steps_per_loop": 10, "train.log_every_steps": 10,
                               "train.eval_every_steps": 0, "train.checkpoint_every_steps": 20, "export": False})
    two = tmp_path / "two_workers"
    run = subprocess.run(launcher(two, **steps, **{"optimizer.gradient_accumulation_steps": 4,
                                                   "train.feed": "iterator"}),
                         env=env_for_workers(tmp_path), cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-5000:]
    one = tmp_path / "one_worker"
    train_here(one, **steps)
    a, b = checkpoint_weights(two, 20), checkpoint_weights(one, 20)
    relative = max(float(np.max(np.abs(a[k] - b[k])) / np.max(np.abs(b[k]))) for k in b)
    print(f"2 workers x 4 micro-batches vs 1 worker after 20 updates: largest relative weight difference "
          f"{relative:.2e}")
    assert a.keys() == b.keys() and relative < 1e-5


def test_chief_and_worker_form_restores_the_chief_checkpoint_on_every_worker(tmp_path, monkeypatch):
    """TF_CONFIG with a chief task (and an evaluator listed, never started: trainers don't wait for it).
    After a resume, each worker holds exactly the state in the chief's checkpoint.

    Also tests/test_startup.py's normal run (merged here: one pair of TensorFlow processes for both stories):
    two workers started together by hand train to the end and exit 0, no startup-watchdog line comes after the
    strategy is made, and neither prints an error."""
    workdir = tmp_path / "run"
    saved = {}  # step -> digest of the state saved
    save = checkpoint.Checkpointer.save

    def save_and_record(self, step):
        save(self, step)
        saved[step] = state_digest(self.checkpoint)

    monkeypatch.setattr(checkpoint.Checkpointer, "save", save_and_record)
    short = {"train.steps": 20, "train.steps_per_loop": 10, "train.checkpoint_every_steps": 10}
    train_here(workdir, **short)  # written by 1 worker, resumed by 2: the data order does not depend on it
    assert sorted(saved) == [10, 20]

    chief, worker, evaluator = localhost_ports(3)
    cluster = {"chief": [chief], "worker": [worker], "evaluator": [evaluator]}
    longer = dict(short, **{"train.steps": 30, "train.allow_changed": "train.steps"})
    # TF_CPP_MIN_LOG_LEVEL=3: no TensorFlow C++ start-up lines (one says "CUDA error:"), as tests/test_startup.py
    procs = by_hand(cluster, [("chief", 0), ("worker", 0)], flags(workdir, **longer),
                    dict(env_for_workers(tmp_path), TF_CPP_MIN_LOG_LEVEL="3"), module="tests.digest_worker")
    for proc in procs:
        assert proc.wait(timeout_s=180) == 0, proc.output[-5000:]
        restored = proc.wait_for(r"restored \S+/ckpt-(\d+) digest (\w+)")
        assert (int(restored[1]), restored[2]) == (20, saved[20]), "a worker's state differs from the checkpoint"
        started = proc.output.index("with CollectiveAllReduceStrategy: 2 replicas, 2 workers")
        assert STARTUP_WAITING not in proc.output[started:]  # (before it, a peer slower to start may be named)
        assert "error:" not in proc.output
    assert "training done at step 30" in procs[0].output
    assert re.search(r"2 replicas, 2 workers, chief=True", procs[0].output)
    assert re.search(r"2 replicas, 2 workers, chief=False", procs[1].output)
    assert "resumed from step 20" in procs[0].output
    assert_chief_files_only(workdir, tmp_path)
    assert max(e["step"] for e in read_metrics(workdir)) == 30


def test_sigkill_of_a_worker_never_hangs_the_others(tmp_path):
    """By hand: the surviving worker fails by itself (its collectives see the peer gone).
    Under the launcher without restarts: it stops the survivor and exits non-zero."""
    endless = {"train.steps": 10**6, "train.log_every_steps": 100, "train.eval_every_steps": 0,
               "train.checkpoint_every_steps": 0}
    env = env_for_workers(tmp_path)
    procs = by_hand({"worker": localhost_ports(2)}, [("worker", 0), ("worker", 1)],
                    flags(tmp_path / "by_hand", **endless), env)
    procs[0].wait_for(r"step 200/")
    procs[1].proc.kill()
    t0 = time.monotonic()
    assert procs[0].wait(timeout_s=60) != 0
    print(f"surviving worker exited {time.monotonic() - t0:.1f}s after its peer was killed")

    launched = Watched(launcher(tmp_path / "launched", **endless), env)
    pid = int(launched.wait_for(r"started worker 1 \(pid (\d+)\)")[1])
    launched.wait_for(r"\[worker 0\] .*step 200/")
    os.kill(pid, signal.SIGKILL)
    assert launched.wait(timeout_s=60) == 128 + signal.SIGKILL
    assert "worker 1 exited with -9 (SIGKILL); stopped all workers (0 of 0 restarts done)" in launched.output


def test_launcher_restarts_after_sigkill_and_preemption_and_resumes(tmp_path):
    """--max_restarts=2: a SIGKILLed worker (resume from the last checkpoint), then a SIGTERM to the
    chief (preemption: every worker saves at the same step and exits 42; resume there, 0 steps lost)."""
    workdir = tmp_path / "run"
    launched = Watched(launcher(workdir, max_restarts=2, **{
        "train.steps": 1200, "train.log_every_steps": 100, "train.eval_every_steps": 0,
        "train.checkpoint_every_steps": 200}), env_for_workers(tmp_path))
    worker1 = int(launched.wait_for(r"started worker 1 \(pid (\d+)\)")[1])
    launched.wait_for(r"\[worker 0\] .*step 300/1200")  # between checkpoints 200 and 400
    os.kill(worker1, signal.SIGKILL)
    launched.wait_for(r"restart 1/2: worker 1 exited with -9 \(SIGKILL\); restarting all workers")
    resumed = int(launched.wait_for(r"\[worker 0\] .*resumed from step (\d+)")[1])
    assert resumed in (200, 400)  # 400 if the kill came late

    chief = int(re.findall(r"started worker 0 \(pid (\d+)\)", launched.output)[1])
    launched.wait_for(r"\[worker 0\] .*step 700/1200")
    os.kill(chief, signal.SIGTERM)
    assert launched.wait(timeout_s=180) == 0, launched.output[-5000:]
    assert re.search(r"restart 2/2: worker \d exited with 42; restarting all workers", launched.output)
    saved = re.findall(r"\[worker (\d)\] .*preempted: saving a checkpoint at step (\d+)", launched.output)
    assert {w for w, _ in saved} == {"0", "1"} and len({at for _, at in saved}) == 1  # all at one step
    assert re.findall(r"\[worker 0\] .*resumed from step (\d+)", launched.output)[1] == saved[0][1]

    assert_chief_files_only(workdir, tmp_path, killed=True)
    train_steps = [e["step"] for e in read_metrics(workdir) if e["split"] == "train"]
    assert train_steps == list(range(100, 1201, 100))  # truncated past each resume point, then each step once
