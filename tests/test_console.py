"""The console a person reads (mwloop.launcher.console, mwloop.run.progress): a time and the message, one line per
event when piped, a progress line in a terminal, absl's format under --verbosity=1, and no TensorFlow start-up
lines whatever TF_CPP_MIN_LOG_LEVEL says.

Three runs of a short MLP (one piped, one in a pseudo-terminal, one verbose) carry the command-line claims; the
formatter, the progress line's drawing and the launcher's reading of the train line are checked in-process.
"""

from __future__ import annotations

import fcntl
import io
import logging
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time

import pytest
from absl import logging as absl_logging

from mwloop.launcher import console
from mwloop.run import progress
from tests.helpers import ROOT

ABSL_PREFIX = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] ")
TIME = r"\d\d:\d\d:\d\d"
TF_START_UP = ("oneDNN", "cudart_stub", "cuInit", "absl::InitializeLog", "cpu_feature_guard")
# 40 steps in loop calls of 10: a log line at 20 and 40, the progress line redrawn after every call.
RUN = [sys.executable, "-m", "mwloop.main", "--config=configs/mlp.py", "--config.train.steps=40",
       "--config.train.steps_per_loop=10", "--config.train.log_every_steps=20", "--config.train.eval_every_steps=40",
       "--config.train.checkpoint_every_steps=40"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != console.SHOW_TF_LOGS_ENV}
    return dict(env, PYTHONPATH=ROOT, GCE_METADATA_IP="127.0.0.1:9", TF_CPP_MIN_LOG_LEVEL="2", **extra)


def screen(raw: str) -> list[str]:
    """What a terminal shows after `raw`: each line as its last carriage return left it (escapes dropped)."""
    lines, current = [], []
    column = 0
    for char in re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", raw.replace("\r\n", "\n")):
        if char == "\n":
            lines.append("".join(current).rstrip())
            current, column = [], 0
        elif char == "\r":
            column = 0
        else:
            if column < len(current):
                current[column] = char
            else:
                current.append(char)
            column += 1
    if "".join(current).strip():
        lines.append("".join(current).rstrip())
    return lines


# ---------------------------------------------------------------------------------------------- in-process
def _record(level: int, message: str) -> logging.LogRecord:
    return logging.LogRecord("absl", level, "/x/actions.py", 134, message, None, None)


def test_a_log_line_is_a_time_then_the_message_and_absl_format_stays_in_log_files(monkeypatch, tmp_path):
    handler = absl_logging.get_absl_handler().python_handler
    formatter = console.ConsoleFormatter()
    monkeypatch.setattr(handler, "stream", sys.stderr)
    assert re.fullmatch(rf"{TIME} step 100/600 loss 0.1",
                        formatter.format(_record(logging.INFO, "step 100/600 loss 0.1")))
    assert re.fullmatch(rf"{TIME} warning: slow", formatter.format(_record(logging.WARNING, "slow")))
    assert re.fullmatch(rf"{TIME} error: lost", formatter.format(_record(logging.ERROR, "lost")))
    with open(tmp_path / "absl.INFO", "w") as log_file:  # absl's own log file (use_absl_log_file): its format
        monkeypatch.setattr(handler, "stream", log_file)
        assert ABSL_PREFIX.match(formatter.format(_record(logging.INFO, "step 100/600")))


def test_tensorflow_lines_are_asked_for_by_environment_variable(monkeypatch):
    monkeypatch.delenv(console.SHOW_TF_LOGS_ENV, raising=False)
    assert not console.tensorflow_logs_wanted()
    monkeypatch.setenv(console.SHOW_TF_LOGS_ENV, "0")
    assert not console.tensorflow_logs_wanted()
    monkeypatch.setenv(console.SHOW_TF_LOGS_ENV, "1")
    assert console.tensorflow_logs_wanted()


def _pty_stream(columns: int = 120) -> tuple[int, io.TextIOWrapper]:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    return master, open(slave, "w", encoding="utf-8", closefd=True)


def _drain(master: int) -> str:
    data = b""
    while select.select([master], [], [], 0.2)[0]:
        chunk = os.read(master, 65536)
        if not chunk:
            break
        data += chunk
    return data.decode("utf-8", errors="replace")


def test_the_progress_line_is_redrawn_below_whole_log_lines(monkeypatch):
    master, terminal = _pty_stream()
    monkeypatch.setattr(progress, "_terminal", None)
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setattr(sys, "stdout", io.StringIO())  # not a terminal: left alone
    try:
        assert progress.enable() and sys.stderr is not terminal and isinstance(sys.stdout, io.StringIO)
        assert progress.line(600, 600) is None  # nothing left to train: no line
        line = progress.line(0, 600)
        line.update(300, {"loss": 0.00081, "examples_per_sec": 4453.2, "eta_s": 12.4})
        drawn = _drain(master)
        sys.stderr.write("14:02:31 step 300/600 loss 0.0008\n")
        sys.stderr.write("held until")  # print() writes its text, then the newline: never split by a redraw
        line.update(350, {"loss": 0.0007, "examples_per_sec": 4000.0, "eta_s": 10.0})
        sys.stderr.write(" its newline\n")
        line.close()
        sys.stderr.write("14:02:45 training done\n")  # after the line: straight through
        sys.stderr.flush()
        rest = _drain(master)
    finally:
        terminal.close()
        os.close(master)
    assert re.search(r"step 300/600 .*50%, loss 0\.0008, 4453 examples/s, ETA 0:00:12", drawn), drawn
    assert "step 350/600" in rest and "\r" in rest
    assert screen(drawn + rest) == ["14:02:31 step 300/600 loss 0.0008", "held until its newline",
                                    "14:02:45 training done"], repr(drawn + rest)


# ---------------------------------------------------------------------------------------------- commands
@pytest.mark.slow
def test_piped_output_is_one_short_line_per_event_without_tensorflow_start_up_lines(tmp_path):
    """A user's own TF_CPP_MIN_LOG_LEVEL=2 used to bring TensorFlow's start-up lines back, twice each."""
    run = subprocess.run([*RUN, f"--workdir={tmp_path / 'run'}"], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:]
    lines = run.stdout.splitlines()
    assert not [line for line in lines if ABSL_PREFIX.match(line) or re.match(r"^[IWEF]0000 ", line)], run.stdout
    assert not [line for line in lines if any(word in line for word in TF_START_UP)], run.stdout
    assert "\r" not in run.stdout and not re.search(r"%, loss", run.stdout)  # no progress line in a pipe
    steps = [re.fullmatch(rf"{TIME} step (\d+)/40 loss \S+ accuracy \S+ \d+ examples/s lr \S+ ETA \S+", line)
             for line in lines if re.search(r"\bstep \d+/40\b", line)]
    assert [int(m[1]) for m in steps if m] == [20, 40] and all(steps), lines
    assert re.fullmatch(rf"{TIME} train_and_eval with DefaultDistributionStrategy: .*", lines[0]), lines[0]
    assert re.fullmatch(rf"{TIME} eval at step 40: .*", next(line for line in lines if "eval at step" in line))


@pytest.mark.slow
def test_a_terminal_shows_a_progress_line_below_the_log(tmp_path):
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    proc = subprocess.Popen([*RUN, f"--workdir={tmp_path / 'run'}"], cwd=ROOT, env=_env(TERM="xterm"),
                            stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
    os.close(slave)
    raw, deadline = b"", time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            chunk = os.read(master, 65536) if select.select([master], [], [], 1.0)[0] else b""
        except OSError:  # EIO: the process closed the terminal's last descriptor
            break
        if not chunk and proc.poll() is not None:
            break
        raw += chunk
    os.close(master)
    assert proc.wait(timeout=60) == 0, raw.decode(errors="replace")[-3000:]
    output = raw.decode(errors="replace")
    bars = [re.search(r"step (\d+)/40 .* (\d+)%, loss \d\.\d{4}, \d+ examples/s, ETA \d:\d\d:\d\d", drawn)
            for drawn in re.split(r"[\r\n]", output)]
    assert {int(bar[1]) for bar in bars if bar} >= {10, 30}, output  # redrawn between the log steps too
    shown = screen(output)
    assert not [line for line in shown if "%, loss" in line], shown  # cleared once training ended
    steps = [line for line in shown if re.fullmatch(rf"{TIME} step \d+/40 loss .*", line)]
    assert [line.split()[2] for line in steps] == ["20/40", "40/40"], shown
    assert not [line for line in shown if ABSL_PREFIX.match(line)], shown


@pytest.mark.slow
def test_verbosity_1_brings_absl_format_and_tensorflow_lines_back(tmp_path):
    run = subprocess.run([*RUN, "--config.train.steps=20", "--verbosity=1", f"--workdir={tmp_path / 'run'}"],
                         cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:]
    step_line = r"^I\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ actions\.py:\d+\] step 20/20 loss"
    assert re.search(step_line, run.stdout, re.M), run.stdout
    assert "oneDNN" in run.stdout  # TensorFlow's own start-up line, as TensorFlow prints it
