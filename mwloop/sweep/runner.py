"""A trial as a training process: its command, its environment, and the line of its log that says why it failed.

Each trial runs in its own directory with its output in `log.txt` (the agent starts it: agent.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

import ml_collections


@dataclasses.dataclass(frozen=True)
class Point:
    """One checked sweep point, ready to run.

    Attributes:
      name: its directory under the sweep's workdir.
      flags: --config.key=value, as passed to mwloop.main.
      config: the resolved config the run will use.
    """
    index: int
    name: str
    overrides: dict[str, Any]
    flags: list[str]
    config: ml_collections.ConfigDict


def command(config_spec: str, workdir: str, override_flags: Sequence[str], num_workers: int = 1) -> list[str]:
    """The training command of one point: mwloop.main, or mwloop.launch with `num_workers` > 1."""
    main_args = [f"--config={config_spec}", f"--workdir={workdir}", *override_flags]
    if num_workers > 1:
        return [sys.executable, "-m", "mwloop.launch", f"--num_workers={num_workers}", "--", *main_args]
    return [sys.executable, "-m", "mwloop.main", *main_args]


def log_tail(path: str, lines: int = 60) -> list[str]:
    with open(path, errors="replace") as f:
        return [line.rstrip() for line in f.readlines()[-lines:] if line.strip()]


# mwloop.launch prefixes each worker's lines.
_WORKER_PREFIX = re.compile(r"^\[worker \d+\]\s*")


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


TF_LOG_ENV = "TF_CPP_MIN_LOG_LEVEL"
# Whether quiet_tensorflow set TF_LOG_ENV (then trials do not inherit it).
_QUIETED = []
# Whether held_stderr drops TensorFlow's start-up lines.
_HOLD = []


def quiet_tensorflow() -> None:
    """TensorFlow's C++ start-up lines off in this process (a sweep or config file may import TensorFlow),
    whatever TF_CPP_MIN_LOG_LEVEL says, unless the user asked for them (mwloop.launcher.console)."""
    from mwloop.launcher import console
    if console.tensorflow_logs_wanted():
        return
    _HOLD.append(True)
    if TF_LOG_ENV not in os.environ:
        os.environ[TF_LOG_ENV] = "3"
        _QUIETED.append(True)


_NOISE = re.compile(r"^(WARNING: All log messages before absl::InitializeLog\(\)|[IWE]0000 \d\d:\d\d:)")


@contextlib.contextmanager
def held_stderr() -> Iterator[None]:
    """Runs a block that may import TensorFlow (a user's sweep or config file) with its C++ start-up lines
    dropped: stderr is held in a file meanwhile, then replayed without them (all of it if the block fails).
    The level set by `quiet_tensorflow` cannot hide them: absl prints them before TensorFlow reads it.
    A no-op once TensorFlow is imported, or when the user asked for TensorFlow's lines."""
    if "tensorflow" in sys.modules or not _HOLD:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    failed = True
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
            failed = False
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            lines = held.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(line for line in lines if failed or not _NOISE.match(line)))
            sys.stderr.flush()


def child_env(sweep: str = "", trial: str = "") -> dict[str, str]:
    """The trial's environment: this one, importing the same mwloop wherever it starts; MWLOOP_SWEEP and
    MWLOOP_TRIAL name the study and the trial (the MLflow sink tags the run with them)."""
    # This file is <root>/mwloop/sweep/runner.py.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    if _QUIETED:
        # mwloop.main quiets TensorFlow itself, and keeps a user's own level.
        env.pop(TF_LOG_ENV, None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.update({k: v for k, v in (("MWLOOP_SWEEP", sweep), ("MWLOOP_TRIAL", trial)) if v})
    return env
