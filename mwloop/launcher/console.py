"""The console a person reads: short log lines, a progress line in a terminal, TensorFlow's own lines hidden.

- Log lines carry a time and the message (`14:02:31 step 100/600 loss ...`; `14:02:31 warning: ...`), not absl's
  prefix (`I1206 14:02:31.736595 139816339430272 actions.py:134] `): Keras, Lightning and big_vision print
  theirs so. Piped output keeps one line per event (the launcher's `[worker i] ` prefixes and the tests read it);
  absl's full format stays in absl's log files and comes back with `--verbosity=1` (`-v 1`): absl's own flag
  for "more detail", which also lets its DEBUG lines through.
- In a terminal (stderr is a tty) a training process shows a progress line below the log (mwloop.run.progress).
- TensorFlow's C++ start-up lines (oneDNN, CUDA stubs, "failed call to cuInit" on every CPU machine, CPU
  features) and its Python INFO lines after every save and export say nothing about the run: hidden, whatever
  TF_CPP_MIN_LOG_LEVEL says (absl prints the start-up lines before TensorFlow reads it), unless the user asks
  for TensorFlow's lines: `MWLOOP_TF_LOGS=1` (any process: the launcher's workers and a sweep's trials inherit
  it) or `--verbosity=1`.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time

from mwloop.run import progress

TF_LOG_ENV = "TF_CPP_MIN_LOG_LEVEL"
SHOW_TF_LOGS_ENV = "MWLOOP_TF_LOGS"


def verbose() -> bool:
    """Whether the user asked for absl's full format (--verbosity=1 or more; its flags parsed by then)."""
    from absl import flags
    return flags.FLAGS.is_parsed() and "verbosity" in flags.FLAGS and flags.FLAGS["verbosity"].value >= 1


def tensorflow_logs_wanted() -> bool:
    """Whether the user asked for TensorFlow's own lines: MWLOOP_TF_LOGS=1, or --verbosity=1."""
    return os.environ.get(SHOW_TF_LOGS_ENV, "") not in ("", "0") or verbose()


class ConsoleFormatter(logging.Formatter):
    """`14:02:31 message`, `14:02:31 warning: message`, `14:02:31 error: message` on stderr; absl's own format
    where absl writes a log file (its handler's stream is then not the console)."""
    LEVELS = {logging.WARNING: "warning: ", logging.ERROR: "error: ", logging.CRITICAL: "error: "}

    def __init__(self) -> None:
        from absl import logging as absl_logging
        super().__init__()
        self._absl_handler = absl_logging.get_absl_handler().python_handler
        self._absl_format = absl_logging.PythonFormatter()

    def format(self, record: logging.LogRecord) -> str:
        if self._absl_handler.stream not in (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__):
            return self._absl_format.format(record)
        when = time.strftime("%H:%M:%S", time.localtime(record.created))
        return f"{when} {self.LEVELS.get(record.levelno, '')}{super().format(record)}"


def use_console_format(progress_line: bool = False) -> None:
    """The log lines of a command as a person reads them (module docstring), unless --verbosity=1.

    Call it once the flags are parsed (in `main`).

    Args:
        progress_line: a training process: in a terminal, draw the progress line below the log.
    """
    from absl import logging as absl_logging
    if verbose():
        return
    handler = absl_logging.get_absl_handler()
    handler.setFormatter(ConsoleFormatter())
    before = sys.stderr
    if progress_line and progress.enable() and handler.python_handler.stream is before:
        # The log goes out above the line too.
        handler.python_handler.stream = sys.stderr


def import_tensorflow_quietly() -> None:
    """Imports TensorFlow with its C++ start-up lines hidden, whatever TF_CPP_MIN_LOG_LEVEL says, unless the
    user asked for TensorFlow's lines (`tensorflow_logs_wanted`).

    A user's own TF_CPP_MIN_LOG_LEVEL stays for what TensorFlow logs after the import; without one it is 3 (C++
    errors too, which mwloop reports as Python exceptions). The start-up lines come before TensorFlow reads it
    (absl prints them "before absl::InitializeLog()", once per library that carries absl), so stderr is held
    in a temporary file while TensorFlow loads, and replayed only if the import fails.
    """
    if "tensorflow" in sys.modules or tensorflow_logs_wanted():
        return
    os.environ.setdefault(TF_LOG_ENV, "3")
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            import keras  # noqa: F401
            import tensorflow  # noqa: F401
        except BaseException:
            os.dup2(saved, 2)
            held.seek(0)
            sys.stderr.write(held.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


# INFO lines of TensorFlow's that stay: under parameter servers, the coordinator's account of a worker that
# failed (its steps go to the other workers) and came back.
_KEPT_INFO = ("Putting back a closure after it failed", "Cluster now being recovered", "has been recovered.")


def _kept(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING or (
        record.levelno == logging.INFO and any(k in record.getMessage() for k in _KEPT_INFO))


class _LibraryInfo(logging.Filter):
    """Drops INFO records logged from TensorFlow's and Keras' own files (they log through absl too)."""
    LIBRARIES = (f"{os.sep}tensorflow{os.sep}", f"{os.sep}keras{os.sep}", f"{os.sep}tf_keras{os.sep}")

    def filter(self, record: logging.LogRecord) -> bool:
        return _kept(record) or not any(p in record.pathname for p in self.LIBRARIES)


class _TensorFlowInfo(logging.Filter):
    """TensorFlow's logger: WARNING and above, and the few INFO lines of `_KEPT_INFO`."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _kept(record)


def quiet_tensorflow_logger() -> None:
    """TensorFlow's Python INFO lines (per save, per export, per all-reduce set-up) off, unless the user asked
    for TensorFlow's lines (`tensorflow_logs_wanted`); mwloop's own INFO lines stay."""
    if tensorflow_logs_wanted():
        return
    from absl import logging as absl_logging
    logger = logging.getLogger("tensorflow")
    # INFO reaches the filter, which keeps only _KEPT_INFO's.
    logger.setLevel(logging.INFO)
    logger.addFilter(_TensorFlowInfo())
    absl_logging.get_absl_handler().addFilter(_LibraryInfo())
