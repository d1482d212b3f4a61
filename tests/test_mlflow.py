"""MLflow as a metrics sink, against a real `mlflow server` (SQLite backend store, 127.0.0.1) that the tests
start: a 2-worker launcher run killed and restarted is one MLflow run whose histories equal metrics.jsonl's,
with no step twice; a server that dies mid-run costs one warning and nothing in metrics.jsonl."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import portpicker
import pytest
from mlflow.tracking import MlflowClient  # the `test` extra installs MLflow (and the `mlflow` extra)

import mwloop
from mwloop.artifacts import files, goodput
from tests import warm_main
from tests.helpers import ROOT, read_metrics

pytestmark = pytest.mark.slow  # an `mlflow server` and mwloop.main / launcher runs

MLP = os.path.join(ROOT, "configs", "mlp.py")
WITH_MLFLOW = "--config.writers=('tensorboard', 'mlflow')"


class MlflowServer:
    """`mlflow server` on 127.0.0.1:`port` with a SQLite store under `directory`, in its own process group
    (it starts helper processes); `stop()` ends the group."""

    def __init__(self, directory: str, port: int | None = None):
        self.directory, self.port = directory, port or portpicker.pick_unused_port()
        os.makedirs(directory, exist_ok=True)
        self.uri = f"http://127.0.0.1:{self.port}"
        self.log = open(os.path.join(directory, "server.log"), "a")
        env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")  # no job runner processes
        self.proc = subprocess.Popen(
            [os.path.join(os.path.dirname(sys.executable), "mlflow"), "server",
             "--backend-store-uri", f"sqlite:///{directory}/mlflow.db", "--artifacts-destination",
             f"{directory}/artifacts", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(f"{self.uri}/health", timeout=2).status == 200:
                    return
            if self.proc.poll() is not None:
                break
            time.sleep(0.3)
        self.stop()
        with open(os.path.join(directory, "server.log")) as f:
            raise AssertionError(f"mlflow server did not come up:\n{f.read()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group this test started
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The module's servers: one `mlflow server` start (seconds) serves every test that leaves it running."""
    started: list[MlflowServer] = []
    yield started
    for one in started:
        one.stop()


@pytest.fixture
def server(servers, tmp_path_factory) -> MlflowServer:
    """A running server: the module's last one, or a new one if a test stopped it (each test uses an MLflow
    experiment of its own, so runs never mix)."""
    if not servers or servers[-1].proc.poll() is not None:
        servers.append(MlflowServer(str(tmp_path_factory.mktemp("mlflow"))))
    return servers[-1]


class KillChiefOnce(mwloop.Action):
    """At step 150 the chief SIGKILLs itself, once (a marker file remembers): a crash between checkpoints."""
    at_steps = (150,)

    def __call__(self, run, step):
        marker = os.environ["MWLOOP_TEST_MARKER"]
        if not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


class KillServer(mwloop.Action):
    """At step 100 the chief kills the MLflow server (its process group, from the environment)."""
    at_steps = (100,)

    def __call__(self, run, step):
        os.killpg(int(os.environ["MWLOOP_TEST_SERVER_PGID"]), signal.SIGKILL)


def histories(client: MlflowClient, run_id: str, events: list[dict]) -> tuple[dict, dict]:
    """(MLflow's, metrics.jsonl's) {"split/name": [(step, value), ...]} for every number metrics.jsonl has."""
    want: dict[str, list] = {}
    for event in events:
        for name, value in event.items():
            if name not in files.ENVELOPE and isinstance(value, (int, float)):
                want.setdefault(f"{event['split']}/{name}", []).append((event["step"], float(value)))
    got = {key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key)) for key in want}
    return got, want


def run(args: list[str], env: dict[str, str], timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", GCE_METADATA_IP="127.0.0.1:9", **env)
    if args[:2] == ["-m", "mwloop.main"]:
        proc = warm_main.run(args[2:], env=env, timeout=timeout)
    else:
        proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env=warm_main.serving(env))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    return proc


def test_a_killed_and_restarted_two_worker_run_is_one_mlflow_run_equal_to_metrics_jsonl(tmp_path, server):
    workdir = str(tmp_path / "run")
    env = {"MLFLOW_TRACKING_URI": server.uri, "MLFLOW_EXPERIMENT_NAME": "launcher", "MWLOOP_SWEEP": "lr-sweep",
           "MWLOOP_TRIAL": "7", "MWLOOP_TEST_MARKER": str(tmp_path / "killed")}
    # --network=host: the server listens on the machine's loopback, which the launcher's own namespace hides.
    proc = run(["-m", "mwloop.launch", "--num_workers=2", "--max_restarts=1", "--network=host", "--", f"--config={MLP}",
                f"--workdir={workdir}", WITH_MLFLOW, "--config.actions=('tests.test_mlflow:KillChiefOnce',)"], env)
    output = proc.stdout + proc.stderr
    assert os.path.exists(tmp_path / "killed") and "resumed from step 100" in output, output[-5000:]
    assert "MLflow: resumed run" in output and "MLflow failed" not in output

    client = MlflowClient(server.uri)
    [mlflow_run] = client.search_runs([client.get_experiment_by_name("launcher").experiment_id])  # both attempts
    run_id = mlflow_run.info.run_id
    assert mlflow_run.info.status == "FINISHED"
    assert mlflow_run.data.params["train.steps"] == "200" and mlflow_run.data.params["model.hidden"] == "(32,)"
    assert mlflow_run.data.tags["mwloop.sweep"] == "lr-sweep" and mlflow_run.data.tags["mwloop.trial"] == "7"
    got, want = histories(client, run_id, read_metrics(workdir))
    assert [s for s, _ in want["train/loss"]] == [50, 100, 150, 200] and [s for s, _ in want["eval/loss"]] == [100, 200]
    assert got == want  # every point, once, with metrics.jsonl's value
    artifacts = {a.path for a in client.list_artifacts(run_id, "export/200")}
    assert "export/200/saved_model.pb" in artifacts and "export/200/variables" in artifacts


def test_a_server_that_dies_mid_run_costs_one_warning_and_a_rerun_sends_what_it_missed(tmp_path, server):
    workdir = str(tmp_path / "run")
    env = {"MLFLOW_TRACKING_URI": server.uri, "MLFLOW_EXPERIMENT_NAME": "server-down",
           "MWLOOP_TEST_SERVER_PGID": str(server.proc.pid)}
    proc = run(["-m", "mwloop.main", f"--config={MLP}", f"--workdir={workdir}", WITH_MLFLOW,
                "--config.actions=('tests.test_mlflow:KillServer',)"], env)
    warnings = [line for line in proc.stderr.splitlines() if "MLflow failed" in line]
    assert len(warnings) == 1, proc.stderr[-5000:]
    assert "metrics.jsonl has every event" in warnings[0]
    events = read_metrics(workdir)
    assert [(e["split"], e["step"]) for e in events if e["split"] not in goodput.RECORDS] == [
        ("train", 50), ("train", 100), ("eval", 100), ("train", 150), ("train", 200), ("eval", 200)]
    server.stop()

    # The server back on its port and store: rerunning the finished run sends MLflow the points it missed.
    again = MlflowServer(server.directory, server.port)
    try:
        proc = run(["-m", "mwloop.main", f"--config={MLP}", f"--workdir={workdir}", WITH_MLFLOW], env)
        # 26: the points of steps 150 and 200 and the 13 of the goodput event; 39: also step 100's, if the sink's
        # sender thread had not sent them yet when the server died (the action kills it right after that checkpoint).
        assert re.search(r"MLflow: catching up (26|39) points of metrics.jsonl the run did not have", proc.stderr), \
            proc.stderr[-5000:]
        assert read_metrics(workdir) == events  # the finished run evaluated nothing new
        client = MlflowClient(again.uri)
        [mlflow_run] = client.search_runs([client.get_experiment_by_name("server-down").experiment_id])
        got, want = histories(client, mlflow_run.info.run_id, read_metrics(workdir))
        assert got == want
    finally:
        again.stop()
