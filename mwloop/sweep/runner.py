"""Runs sweep points as training subprocesses, a few at a time, and records how each ended.

Each point runs in its own directory with its output in `log.txt`; when the
process exits, `sweep.json` there says done or failed (with the error), so a
rerun of the sweep skips what is done and retries what failed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import ml_collections
from absl import logging

from mwloop import children, errors, jsonl
from mwloop.sweep.report import format_seconds

MARKER = "sweep.json"  # DIR/<point>/sweep.json: how the point's last attempt ended
LOG = "log.txt"


@dataclasses.dataclass(frozen=True)
class Point:
    """One checked sweep point, ready to run."""
    index: int
    name: str  # its directory under the sweep's workdir
    overrides: dict[str, Any]
    flags: list[str]  # --config.key=value, as passed to mwloop.main
    config: ml_collections.ConfigDict  # the resolved config the run will use


def command(config_spec: str, workdir: str, override_flags: Sequence[str], num_workers: int = 1) -> list[str]:
    """The training command of one point: mwloop.main, or mwloop.launch with `num_workers` > 1."""
    main_args = [f"--config={config_spec}", f"--workdir={workdir}", *override_flags]
    if num_workers > 1:
        return [sys.executable, "-m", "mwloop.launch", f"--num_workers={num_workers}", "--", *main_args]
    return [sys.executable, "-m", "mwloop.main", *main_args]


def read_marker(workdir: str) -> dict:
    """How the point's last attempt ended ({} if it never ended, or if its marker is unreadable)."""
    path = os.path.join(workdir, MARKER)
    if not os.path.exists(path):
        return {}
    try:
        return jsonl.read_json(path)
    except jsonl.CorruptFileError as e:
        # The run itself is safe in its checkpoints: rerunning resumes it and writes a new marker.
        logging.warning("%s; running the point again (it resumes from its checkpoint and rewrites the file)", e)
        return {}


def _write_marker(workdir: str, marker: dict) -> None:
    with jsonl.atomic_open(os.path.join(workdir, MARKER)) as f:  # a killed sweep never leaves half a marker
        json.dump(marker, f, indent=2)


def _log_tail(path: str, lines: int = 60) -> list[str]:
    with open(path, errors="replace") as f:
        return [line.rstrip() for line in f.readlines()[-lines:] if line.strip()]


_WORKER_PREFIX = re.compile(r"^\[worker \d+\]\s*")  # mwloop.launch prefixes each worker's lines


def error_line(tail: Sequence[str], returncode: int) -> str:
    """The line of a failed run's log that says why: main's "error: ..." or an exception's last line."""
    def bare(line: str) -> str:
        return _WORKER_PREFIX.sub("", line).strip()

    def compact(line: str) -> str:
        return re.sub(r"\s+", " ", line.strip())

    for line in reversed(tail):
        if bare(line).startswith("error:"):
            return compact(line)
    for line in reversed(tail):
        if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b", bare(line)):
            return compact(line)
    if returncode < 0:
        return f"killed by signal {-returncode}"
    return f"exit code {returncode}" + (f": {compact(tail[-1])}" if tail else "")


class Progress:
    """Counts and the ETA behind each progress line."""

    def __init__(self, *, total: int, already_done: int, parallel: int):
        self.total, self.finished, self.parallel = total, already_done, parallel
        self.failed = 0
        self.walls: list[float] = []

    def line(self, name: str, status: str, wall_s: float) -> str:
        self.finished += 1
        self.failed += status == "failed"
        self.walls.append(wall_s)
        remaining = self.total - self.finished
        eta = remaining * (sum(self.walls) / len(self.walls)) / min(self.parallel, max(remaining, 1))
        failed = f" ({self.failed} failed)" if self.failed else ""
        return (f"[{self.finished}/{self.total}] {status} {name} in {format_seconds(wall_s)}{failed}"
                + (f" ETA {format_seconds(eta)}" if remaining else ""))


@dataclasses.dataclass
class _Running:
    point: Point
    workdir: str
    process: subprocess.Popen
    log: Any
    start: float


def _child_env() -> dict[str, str]:
    # The children import the same mwloop as this process, wherever they start.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # <root>/mwloop/sweep/runner.py
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _start(point: Point, workdir: str, config_spec: str, num_workers: int) -> _Running:
    os.makedirs(workdir, exist_ok=True)
    cmd = command(config_spec, workdir, point.flags, num_workers)
    log = open(os.path.join(workdir, LOG), "a")  # a retry appends: earlier failures stay readable
    log.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n")
    log.flush()
    logging.info("start %s", point.name)
    # Tied to this process: a sweep killed by any signal takes its points with it (their workdir locks too).
    process = children.popen_tied(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  env=_child_env())
    return _Running(point, workdir, process, log, time.time())


def _finish(running: _Running, returncode: int) -> dict:
    running.log.close()
    wall_s = time.time() - running.start
    if returncode in (errors.PREEMPTED, errors.INTERRUPTED):  # saved, then stopped: no marker, a rerun resumes it
        return {"status": "interrupted", "returncode": returncode, "wall_s": wall_s}
    marker = {"status": "done" if returncode == 0 else "failed", "returncode": returncode, "wall_s": wall_s,
              "overrides": running.point.overrides, "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
    if returncode:
        tail = _log_tail(os.path.join(running.workdir, LOG))
        marker.update(error=error_line(tail, returncode), log_tail=tail[-20:])
    _write_marker(running.workdir, marker)
    return marker


def _stop(running: Sequence[_Running], grace_s: float = 60.0) -> None:
    """Stops unfinished points (no marker: a rerun resumes them from their checkpoints)."""
    for r in running:
        r.process.terminate()
    deadline = time.time() + grace_s
    for r in running:
        try:
            r.process.wait(timeout=max(deadline - time.time(), 0.1))
        except subprocess.TimeoutExpired:
            r.process.kill()
            r.process.wait()
        r.log.close()


def run_points(points: Sequence[Point], *, sweep_dir: str, config_spec: str, parallel: int, num_workers: int,
               progress: Progress, on_finish: Callable[[Point, dict], None]) -> None:
    """Runs `points`, `parallel` at a time; `on_finish(point, marker)` after each one ends."""
    queue, running = list(points), []
    try:
        while queue or running:
            while queue and len(running) < parallel:
                point = queue.pop(0)
                running.append(_start(point, os.path.join(sweep_dir, point.name), config_spec, num_workers))
            time.sleep(0.2)
            for r in [r for r in running if r.process.poll() is not None]:
                running.remove(r)
                marker = _finish(r, r.process.returncode)
                line = progress.line(r.point.name, marker["status"], marker["wall_s"])
                if marker["status"] == "failed":
                    line += f": {marker['error']} (log: {os.path.join(r.workdir, LOG)})"
                logging.info("%s", line)
                on_finish(r.point, marker)
    finally:
        if running:
            logging.warning("stopping %d running point(s): %s", len(running), ", ".join(r.point.name for r in running))
            _stop(running)
