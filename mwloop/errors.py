"""Exit codes of mwloop's commands, in one place: the launcher and sweeps decide by them.

Anything else non-zero is a crash: an uncaught internal error keeps Python's
traceback and exits 1; a worker killed by signal N exits -N (128 + N through
the launcher).

`one_line` turns a config_flags error into the one line a user error prints
(mwloop.main, mwloop.sweep). No TensorFlow here: the sweep imports this module.
"""

import os
import re
import signal
import sysconfig
import traceback

# SIGTERM: every worker saved a checkpoint at one step and exited; a restart resumes there.
PREEMPTED = 42
# An elastic job's worker that was itself given notice (SIGTERM): it saved with the others (who exit PREEMPTED)
# and leaves; the job goes on without it (mwloop.launcher.elastic).
LEAVING = 43
# A one-line user or config error: a restart would fail the same way.
USER_ERROR = 2
# Starts a failed data check's message inside a TensorFlow error (an in-graph check, a corrupt record read by
# tf.data): mwloop.step.graph_checks turns that error into the message's one line.
DATA_CHECK_MARK = "mwloop data check: "
# 130, Ctrl-C: saved like a preemption (unless pressed twice), but do not restart.
INTERRUPTED = 128 + signal.SIGINT

# How the launcher forwards its own Ctrl-C to the workers. Not SIGINT: a terminal's Ctrl-C reaches the
# workers too (one process group), and a second SIGINT means "exit now, do not save". A worker treats
# this signal as a first Ctrl-C that never counts as a second one.
INTERRUPT_SIGNAL = signal.SIGUSR1


class UserError(ValueError):
    """A mistake in a config, the data, a task or the environment: `mwloop.main` prints its message as one
    `error: ...` line and exits USER_ERROR. Anything else keeps its traceback. (A ValueError, so callers
    that caught ValueError for these still do.)"""


class JobLost(Exception):
    """A peer of the job went away (a worker, a parameter server): the attempt ends in one line, exit 1, since a
    restart from the last checkpoint can succeed (the launcher's --max_restarts, a TFJob's restartPolicy)."""


# How a command ends, by exception type, in one place (mwloop.main, mwloop.launch): the first match gives the
# exit code, and the message is printed as one `error: ...` line. Anything else is an internal error: it keeps its
# traceback (exit 1).
EXIT_CODES: tuple[tuple[type[BaseException], int], ...] = (
    (UserError, USER_ERROR),
    # A non-finite loss (or weights), named with its step: the input's doing.
    (FloatingPointError, USER_ERROR),
    (JobLost, 1),
)


def exit_code(error: BaseException) -> int | None:
    """The exit code `error` ends a command with (EXIT_CODES), or None for an internal error."""
    return next((code for kind, code in EXIT_CODES if isinstance(error, kind)), None)


def one_line(error: Exception) -> str:
    """The useful line of a config_flags error (they embed newlines, reprs and tracebacks)."""
    text = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    lines = [line.strip() for line in text.replace("\\n", "\n").replace("\\'", "'").splitlines() if line.strip()]
    if any(line.startswith(("Traceback", "[Errno")) for line in lines):
        # The exception itself, not the traceback or search path around it.
        lines = lines[-1:]
    message = " ".join(lines)
    typo = re.search(r'Did you mean "([^"]+)" instead of "([^"]+)"', message)
    if typo:
        return f"unknown config key {typo[2]!r} (did you mean {typo[1]!r}?)"
    bare_key = re.fullmatch(r"""["']*([\w.]+)["']*""", message)
    return f"unknown config key {bare_key[1]!r}" if bare_key else message


# ---------------------------------------------------------------------------- whose code raised it

# The mwloop package's directory and the installed libraries' (and Python's own): frames there are not the user's.
MWLOOP_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
LIBRARY_DIRS = tuple(p + os.sep for p in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
                                          sysconfig.get_paths()["stdlib"]})


def is_user_file(filename: str) -> bool:
    """Whether `filename` is the user's (not mwloop's, TensorFlow's, Keras', Python's or autograph's copy)."""
    return not os.path.abspath(filename).startswith((MWLOOP_DIR, *LIBRARY_DIRS)) and "<frozen" not in filename \
        and "/tmp/__autograph_generated" not in filename


def library_name(filename: str) -> str:
    """The library a file belongs to, e.g. "argparse" for .../lib/python3.11/argparse.py, "absl" for
    .../site-packages/absl/flags/_flagvalues.py."""
    path = os.path.abspath(filename)
    for directory in sorted(LIBRARY_DIRS, key=len, reverse=True):
        if path.startswith(directory):
            first = path[len(directory):].split(os.sep)[0]
            return first.removesuffix(".py")
    return os.path.basename(path).removesuffix(".py")


def exit_site(error: BaseException, *, innermost_is_mwloops: bool = False) -> str:
    """Where the user's code ended the process with `error` (a SystemExit): " at file:line (code)" of its innermost
    frame of the user's, plus ", inside LIBRARY" when a library it called raised it (argparse's parse_args);
    "" when no user frame is in the traceback or mwloop itself raised it (mwloop's and absl's own exits).
    `innermost_is_mwloops`: the innermost frame is a stand-in of mwloop's for what the user called (os._exit)."""
    frames = traceback.extract_tb(error.__traceback__)[:-1 if innermost_is_mwloops else None]
    user = [f for f in frames if is_user_file(f.filename)]
    if not frames or not user or os.path.abspath(frames[-1].filename).startswith(MWLOOP_DIR):
        return ""
    inside = "" if is_user_file(frames[-1].filename) else f", inside {library_name(frames[-1].filename)}"
    return f" at {user[-1].filename}:{user[-1].lineno} ({user[-1].line}){inside}"
