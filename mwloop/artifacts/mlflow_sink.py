"""MLflow as a metrics sink (`config.writers=("tensorboard", "mlflow")`, the `mlflow` extra).

One MLflow run per mwloop run: its id is kept in `workdir/mlflow_run.json`, so a resumed run (a rerun, a
restart by the launcher) logs into the same MLflow run. The run holds the flattened config as params, every
train / eval / eval_<set> metric as `SPLIT/NAME` at its step, and each export as artifacts under
`export/<step>`. Tags: `mwloop.workdir`, and `mwloop.sweep` / `mwloop.trial` from the environment variables
MWLOOP_SWEEP / MWLOOP_TRIAL (a sweep sets them for its points).

Where: MLFLOW_TRACKING_URI when set (a tracking server for a team), else a SQLite store beside the workdir
(`sqlite:///<workdir's parent>/mlflow.db`, artifacts in `<workdir's parent>/mlartifacts`), which
`mlflow ui --backend-store-uri sqlite:///<parent>/mlflow.db` shows. Experiment: MLFLOW_EXPERIMENT_NAME, else
config.name.

Sends run in a background thread (the training loop never waits for the server); the run's end waits for
them. No duplicates after a resume: points are sent once a checkpoint covers their step (the writer's `checkpointed`),
so a process killed between checkpoints never leaves in MLflow points that the resumed run writes again
(metrics.jsonl drops them too). At start the sink sends whatever metrics.jsonl has that the MLflow run
lacks (a run that lost its server earlier, or one that turns MLflow on later), so MLflow's history equals
metrics.jsonl's once the run ends.
"""

from __future__ import annotations

import json
import os
import queue
import re
import threading
import time
import urllib.error
import urllib.request

import ml_collections
from absl import logging

from mwloop.artifacts import files, jsonl
from mwloop.artifacts.sink import Sink
from mwloop.errors import UserError

RUN_FILE = "mlflow_run.json"
# A server that is down must cost seconds, not MLflow's default of 7 retries with exponential backoff (minutes)
# at every call; a user's own settings win.
_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                  "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
# The schemes MLflow's tracking stores take (a database's may name a driver: postgresql+psycopg2); a bare path is a
# file store. Anything else (a misspelt `htp://`) would only warn at the first call and train on untracked.
SCHEMES = ("file", "sqlite", "postgresql", "mysql", "mssql", "http", "https", "databricks", "databricks-uc", "uc")
# How long the start waits for a tracking server's /health: one that accepts connections but never answers cost
# MLflow's timeout times its retries (~60 s) before the first step.
HEALTH_TIMEOUT_S = 5.0
_MAX_PARAM_LENGTH, _PARAMS_PER_BATCH, _METRICS_PER_BATCH = 6000, 100, 1000


def tracking_uri(workdir: str) -> str:
    """MLFLOW_TRACKING_URI, or the SQLite store in the workdir's parent."""
    return os.environ.get("MLFLOW_TRACKING_URI") or \
        f"sqlite:///{os.path.join(os.path.dirname(os.path.abspath(workdir)), 'mlflow.db')}"


def check_uri(uri: str) -> None:
    """Raises UserError for a tracking URI whose scheme no MLflow store takes (no MLflow import)."""
    found = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*):", uri)
    if found and found[1].split("+")[0].lower() not in SCHEMES:
        raise UserError(f"MLflow tracking URI {uri!r} has an unknown scheme {found[1]!r}; use one of "
                        f"{', '.join(s + '://' for s in SCHEMES)} (check MLFLOW_TRACKING_URI)")


def wait_for_health(uri: str, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
    """For an http(s) tracking server: its /health answers within `timeout_s`, else ConnectionError naming it."""
    if not uri.lower().startswith(("http://", "https://")):
        return
    health = uri.rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(health, timeout=timeout_s) as response:  # noqa: S310 - http(s) only
            response.read(64)
    except urllib.error.HTTPError:
        # It answered (a server behind a proxy may not serve /health): the calls themselves will tell.
        return
    except (OSError, ValueError) as e:
        raise ConnectionError(f"no answer from the MLflow tracking server at {health} within {timeout_s:g} s "
                              f"({type(e).__name__}: {e})") from None


def flatten(config: ml_collections.ConfigDict) -> dict[str, str]:
    """The config as MLflow params: dotted keys, values as text (cut to MLflow's limit)."""
    flat: dict[str, str] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, (ml_collections.ConfigDict, dict)):
            for key in sorted(value.keys()):
                walk(f"{prefix}{key}.", value[key])
        else:
            text = value.__module__ + ":" + value.__qualname__ if isinstance(value, type) else str(value)
            flat[prefix[:-1]] = text[:_MAX_PARAM_LENGTH]
    walk("", config)
    return flat


class MlflowSink(Sink):
    """The chief's MLflow run (see the module docstring)."""
    name = "MLflow"
    # A tracking server that is down or full warns once; training goes on.
    fallible = True
    catch_up = "rerunning this workdir (it resumes) sends MLflow what it missed"

    def __init__(self, config: ml_collections.ConfigDict, workdir: str):
        try:
            import mlflow  # noqa: F401
        except ImportError:
            raise UserError("config.writers has 'mlflow' but MLflow is not installed; pip install 'mwloop[mlflow]' "
                            "(or drop 'mlflow' from config.writers)") from None
        for key, value in _HTTP_DEFAULTS.items():
            os.environ.setdefault(key, value)
        self.config, self.workdir = config, workdir
        self.uri = tracking_uri(workdir)
        # An error at start, not a warning and a run nobody tracks.
        check_uri(self.uri)
        self.client = None
        self.run_id: str | None = None
        # (step, key, value, timestamp ms) not yet sent.
        self._pending: list[tuple[int, str, float, int]] = []
        self._checkpointed = -1
        # Sends go through one background thread, so the training loop never waits for the server; the first
        # error it meets is raised by the sink's next call (the writer then warns once and drops the sink).
        self._outbox: queue.Queue = queue.Queue()
        self._sender: threading.Thread | None = None
        self._error: Exception | None = None

    # ------------------------------------------------------------------ start: the run, created or resumed
    def start(self, events: list[dict]) -> None:
        from mlflow.tracking import MlflowClient
        # Bounded: a silent server costs seconds, then a warning (the sink is fallible).
        wait_for_health(self.uri)
        self.client = MlflowClient(tracking_uri=self.uri)
        run_file = os.path.join(self.workdir, RUN_FILE)
        kept = jsonl.read_json(run_file) if os.path.exists(run_file) else {}
        self.run_id = kept.get("run_id") if kept.get("tracking_uri") == self.uri else None
        if kept and not self.run_id:
            logging.warning("MLflow: this run was tracked at %s, now at %s: a new MLflow run, with the history "
                            "of metrics.jsonl", kept.get("tracking_uri"), self.uri)
        if self.run_id and not self._exists(self.run_id):
            logging.warning("MLflow: run %s (in %s) is gone; a new MLflow run, with the history of metrics.jsonl",
                            self.run_id, run_file)
            self.run_id = None
        resumed = self.run_id is not None
        if resumed:
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            run = self.client.create_run(self._experiment_id(), run_name=os.path.basename(
                os.path.abspath(self.workdir)), tags=self._tags())
            self.run_id = run.info.run_id
            jsonl.replace_file(run_file, json.dumps({"tracking_uri": self.uri, "run_id": self.run_id,
                                               "experiment_id": run.info.experiment_id}, indent=1) + "\n")
        self._log_params(resumed)
        self._backfill(events, resumed)
        logging.info("MLflow: %s run %s in %s", "resumed" if resumed else "started", self.run_id, self.uri)

    def _exists(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException
        try:
            return self.client.get_run(run_id).info.lifecycle_stage == "active"
        except MlflowException:
            return False

    def _experiment_id(self) -> str:
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or self.config.get("name") or "mwloop"
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        location = None
        if self.uri.startswith("sqlite:///") and "MLFLOW_TRACKING_URI" not in os.environ:
            # Without a server, MLflow would put artifacts in ./mlruns of whatever the current directory is.
            location = "file://" + os.path.join(os.path.dirname(self.uri[len("sqlite:///"):]), "mlartifacts")
        return self.client.create_experiment(name, artifact_location=location)

    def _tags(self) -> dict[str, str]:
        tags = {"mwloop.workdir": os.path.abspath(self.workdir), "mwloop.config": str(self.config.get("name"))}
        for variable, tag in (("MWLOOP_SWEEP", "mwloop.sweep"), ("MWLOOP_TRIAL", "mwloop.trial")):
            if os.environ.get(variable):
                tags[tag] = os.environ[variable]
        return tags

    def _log_params(self, resumed: bool) -> None:
        from mlflow.entities import Param, RunTag
        params = flatten(self.config)
        # Params cannot change in MLflow: log the new ones, name the changed ones.
        if resumed:
            logged = self.client.get_run(self.run_id).data.params
            changed = sorted(k for k in params if k in logged and logged[k] != params[k])
            if changed:
                logging.warning("MLflow: the config changed on resume (%s); the run keeps its first params and "
                                "tags the change", ", ".join(changed)[:300])
                self.client.log_batch(self.run_id, tags=[RunTag("mwloop.config_changed_on_resume",
                                                                ", ".join(changed)[:_MAX_PARAM_LENGTH])])
            params = {k: v for k, v in params.items() if k not in logged}
        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), _PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[i:i + _PARAMS_PER_BATCH])

    def _backfill(self, events: list[dict], resumed: bool) -> None:
        """Sends the points of metrics.jsonl the MLflow run lacks (all of them for a new run)."""
        points = [p for event in events for p in _points(event, now_ms())]
        if resumed and points:
            have = {(key, m.step) for key in {p[1] for p in points}
                    for m in self.client.get_metric_history(self.run_id, key)}
            points = [p for p in points if (p[1], p[0]) not in have]
        # Sent like new points: once a checkpoint covers them.
        if points:
            logging.info("MLflow: catching up %d points of metrics.jsonl the run did not have", len(points))
            self._pending.extend(points)
            self._send_checkpointed()

    # ------------------------------------------------------------------ metrics
    def write_scalars(self, step: int, split: str, metrics: dict[str, float]) -> None:
        self._raise_error()
        self._pending.extend(_points({"step": step, "split": split, **metrics}, now_ms()))
        self._send_checkpointed()

    def truncate_after(self, step: int) -> None:
        self._pending = [p for p in self._pending if p[0] <= step]

    def checkpointed(self, step: int) -> None:
        self._raise_error()
        self._checkpointed = max(self._checkpointed, step)
        self._send_checkpointed()

    def _send_checkpointed(self) -> None:
        ready = [p for p in self._pending if p[0] <= self._checkpointed]
        if ready:
            self._pending = [p for p in self._pending if p[0] > self._checkpointed]
            self._send(ready)

    def _send(self, points: list[tuple[int, str, float, int]]) -> None:
        if self._sender is None:
            self._sender = threading.Thread(target=self._send_loop, name="mlflow-sink", daemon=True)
            self._sender.start()
        self._outbox.put(points)

    def _send_loop(self) -> None:
        from mlflow.entities import Metric
        while (points := self._outbox.get()) is not None:
            # After an error: drain, send nothing more.
            if self._error is None:
                try:
                    metrics = [Metric(key, value, timestamp, step) for step, key, value, timestamp in points]
                    for i in range(0, len(metrics), _METRICS_PER_BATCH):
                        self.client.log_batch(self.run_id, metrics=metrics[i:i + _METRICS_PER_BATCH])
                except Exception as e:  # noqa: BLE001 - raised in the training thread by the next call
                    self._error = e
            self._outbox.task_done()
        self._outbox.task_done()

    def _wait_for_sends(self) -> None:
        """Blocks until every queued send is done (or failed)."""
        if self._sender is not None:
            self._outbox.put(None)
            self._sender.join()
            self._sender = None
        self._raise_error()

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def write_export(self, directory: str, step: int) -> None:
        self._raise_error()
        # export/<step> or export_best/<step>, as in the workdir.
        base = os.path.basename(os.path.dirname(directory))
        self.client.log_artifacts(self.run_id, directory, artifact_path=f"{base}/{step}")

    def close(self, status: str) -> None:
        # Past the newest checkpoint: the rerun writes them again.
        if self._pending:
            logging.info("MLflow: %d points past the last checkpoint not sent (a rerun writes them again)",
                         len(self._pending))
            self._pending = []
        self._wait_for_sends()
        self.client.set_terminated(self.run_id, status=status)


def where(workdir: str) -> str | None:
    """"run <id> in <tracking URI>" of the workdir's MLflow run, or None."""
    path = os.path.join(workdir, RUN_FILE)
    if not os.path.exists(path):
        return None
    kept = jsonl.read_json(path)
    return f"run {kept.get('run_id')} in {kept.get('tracking_uri')}"


def _points(event: dict, timestamp_ms: int) -> list[tuple[int, str, float, int]]:
    """(step, "split/name", value, timestamp) for each number of a metrics.jsonl event."""
    split = event.get("split")
    return [(int(event["step"]), f"{split}/{name}", float(value), timestamp_ms) for name, value in event.items()
            if name not in files.ENVELOPE and isinstance(value, (int, float)) and not isinstance(value, bool)]


def now_ms() -> int:
    return int(time.time() * 1000)

