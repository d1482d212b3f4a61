"""One trial's training process as the agent sees it: the `TrialRun` record, the process started in the
trial's directory (forked from the warm-start server where it can be), its new evals reported to the pruner,
and how long it has shown no sign of life (`Stall`). Asking the study for trials and telling it how one ended
are the agent's (agent.py).
"""

from __future__ import annotations

import dataclasses
import math
import os
import shlex
import subprocess
import time

import optuna

from mwloop.artifacts import files
from mwloop.launcher import children
from mwloop.launcher.warm import PARENT_ENV, WarmProcess, WarmServer
from mwloop.sweep import runner


def reproduce_command(config_spec: str, workdir: str, override_flags: list[str], num_workers: int) -> str:
    """The exact command that reruns a trial by hand (the training process the agent started)."""
    args = runner.command(config_spec, workdir, override_flags, num_workers)
    return shlex.join(["python", *args[1:]])


def metric_values(events: list[dict], metric: str) -> list[tuple[int, float]]:
    """(step, value) of every eval of `metric` ("<split>/<name>") among metrics.jsonl's `events`."""
    split, name = metric.split("/", 1)
    return [(e["step"], e[name]) for e in events if e.get("split") == split and isinstance(e.get(name), (int, float))]


@dataclasses.dataclass
class TrialRun:
    """One asked trial on its way to being told: where and how it runs, and what it has reported so far.

    Attributes:
      workdir: the sweep's directory / the trial's name.
      command: the training process.
      metric: the ranking metric, "<split>/<name>".
      scale: an eval at step s is reported at s * scale: examples seen with PRUNE_BY = "examples", else 1.
      reported: the resources reported (a retry re-reads all).
      pruned_at: the step of the eval at which the pruner said stop.
      pruned_value: that eval's value (the run may write later evals before it stops).
      single: one objective: its evals are reported as intermediate values (a multi-objective study takes none).
    """
    trial: optuna.Trial
    workdir: str
    command: list[str]
    metric: str
    scale: int
    tail: files.MetricsTail
    reported: set[int] = dataclasses.field(default_factory=set)
    pruned_at: int | None = None
    pruned_value: float | None = None
    single: bool = True


def report_new(run: TrialRun) -> None:
    """Reports the ranking metric's new evals in metrics.jsonl as intermediate values (each resource once,
    finite ones only) and, until it has said so once, asks the pruner whether to stop. Several objectives: none
    (objectives.py)."""
    # Read always: the tail keeps the events the trial is told by.
    events = run.tail.poll()
    if not run.single:
        return
    for step, value in metric_values(events, run.metric):
        resource = step * run.scale
        if resource in run.reported or not math.isfinite(value):
            continue
        run.reported.add(resource)
        run.trial.report(value, resource)
        if run.pruned_at is None and run.trial.should_prune():
            run.pruned_at, run.pruned_value = step, value


def start_trial(study: optuna.Study, run: TrialRun, warm: WarmServer | None = None
                ) -> tuple[subprocess.Popen | WarmProcess, float]:
    """Starts the trial's training process in its directory, its output appended to log.txt under a line
    naming the attempt, forked from `warm` where it can be (mwloop.launcher.warm); returns the process and its
    start time (time.time())."""
    os.makedirs(run.workdir, exist_ok=True)
    # A retry appends: earlier attempts stay.
    with open(os.path.join(run.workdir, files.LOG), "a") as log:
        log.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} trial {run.trial.number}: {shlex.join(run.command)}\n")
        log.flush()
        start = time.time()
        # Tied to this thread: an agent killed by any signal takes its trial with it (and its workdir lock).
        # (The child writes to its own copy of the log's descriptor: closing ours does not stop it.)
        env = runner.child_env(study.study_name, str(run.trial.number))
        if warm is not None and run.command[2:3] == ["mwloop.launch"]:
            # A multi-worker trial's launcher forks its warm-start server from ours: no import of its own.
            warm.open(env)
            if warm.listen_path is not None:
                env[PARENT_ENV] = warm.listen_path
        process = None if warm is None else warm.start(run.command, env, output=log.fileno())
        if process is None:
            process = children.popen_tied(run.command, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=env)
    return process, start


class Stall:
    """How long a running trial has shown no sign of life: its log.txt (its console, start-up included) and its
    metrics.jsonl both unchanged. A run stuck in its input (a data source that never answers) or on a peer
    shows nothing, while a slow one still logs or writes its steps."""

    def __init__(self, workdir: str):
        self.paths = [os.path.join(workdir, files.LOG), os.path.join(workdir, files.METRICS)]
        self.sizes: list[int] = []
        self.since = time.monotonic()
        # The idle seconds, set when the trial is stopped for it.
        self.seconds = 0.0

    def idle_s(self) -> float:
        """Seconds since either file last grew."""
        sizes = [os.path.getsize(p) if os.path.exists(p) else -1 for p in self.paths]
        if sizes != self.sizes:
            self.sizes, self.since = sizes, time.monotonic()
        return time.monotonic() - self.since

    def last_line(self) -> str:
        lines = runner.log_tail(self.paths[0], 5) if os.path.exists(self.paths[0]) else []
        return (lines or ["(nothing)"])[-1][:160]

