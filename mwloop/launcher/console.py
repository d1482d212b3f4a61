"""A console a user reads: TensorFlow's start-up and per-save notices off by default.

A plain run used to open with a dozen C++ lines (oneDNN, CUDA stubs, "failed
call to cuInit" on every CPU machine, CPU features) and print TensorFlow's
internals after every save and export. They say nothing about the run. A
user's own TF_CPP_MIN_LOG_LEVEL, or --verbosity, brings them back.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile

TF_LOG_ENV = "TF_CPP_MIN_LOG_LEVEL"


def import_tensorflow_quietly() -> None:
    """Imports TensorFlow with its C++ start-up notices hidden, unless TF_CPP_MIN_LOG_LEVEL is set.

    The level (3: C++ errors too, which mwloop reports as Python exceptions) hides what comes after
    the import; a few lines come from libraries loaded before TensorFlow reads it, so stderr is held
    in a temporary file while TensorFlow loads, and replayed only if the import fails.
    """
    if TF_LOG_ENV in os.environ or "tensorflow" in sys.modules:
        return
    os.environ[TF_LOG_ENV] = "3"
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


def quiet_tensorflow_logger(verbosity_given: bool) -> None:
    """TensorFlow's Python INFO lines (per save, per export, per all-reduce set-up) off, unless the
    user asked for a verbosity; mwloop's own INFO lines stay."""
    if verbosity_given:
        return
    from absl import logging as absl_logging
    logger = logging.getLogger("tensorflow")
    logger.setLevel(logging.INFO)  # INFO reaches the filter, which keeps only _KEPT_INFO's
    logger.addFilter(_TensorFlowInfo())
    absl_logging.get_absl_handler().addFilter(_LibraryInfo())
