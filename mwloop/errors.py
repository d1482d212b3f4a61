"""Exit codes of mwloop's commands, in one place: the launcher and sweeps decide by them.

Anything else non-zero is a crash: an uncaught internal error keeps Python's
traceback and exits 1; a worker killed by signal N exits -N (128 + N through
the launcher).
"""

import signal

PREEMPTED = 42  # SIGTERM: every worker saved a checkpoint at one step and exited; a restart resumes there
USER_ERROR = 2  # a one-line user or config error: a restart would fail the same way
INTERRUPTED = 128 + signal.SIGINT  # 130, Ctrl-C: saved like a preemption (unless pressed twice), but do not restart

# How the launcher forwards its own Ctrl-C to the workers. Not SIGINT: a terminal's Ctrl-C reaches the
# workers too (one process group), and a second SIGINT means "exit now, do not save". A worker treats
# this signal as a first Ctrl-C that never counts as a second one.
INTERRUPT_SIGNAL = signal.SIGUSR1
