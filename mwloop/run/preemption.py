"""Preemption and Ctrl-C: all workers save at the same step, then exit 42 (SIGTERM) or 130 (SIGINT).

SIGTERM to any worker is a preemption: every worker saves a checkpoint at one
step and exits 42, for a restart. SIGHUP (the terminal closed) is taken the same way:
saved, exit 42. SIGINT (Ctrl-C), or the launcher's forwarded
Ctrl-C (errors.INTERRUPT_SIGNAL), does the same but exits 130, so that nothing
restarts it; a second SIGINT exits 130 at once, without saving.

Across workers, TensorFlow's PreemptionCheckpointHandler does the signalling
and the agreement on the step; mwloop does the saving through its own
Checkpointer (chief dir on the chief, temporary dirs elsewhere). The handler is
given an empty CheckpointManager on purpose, on a directory that is never
created (it is only read, and finds nothing: nothing of a run is left in
TMPDIR): its built-in restore trusts the
checkpoint state file (no fallback past a corrupt checkpoint) and its run
counter must agree on every worker, so mwloop restores by itself and every
worker starts the handler's count at 0. The handler watches SIGTERM itself; a
Ctrl-C reaches it as a SIGTERM this process sends itself. The exit code the
signalled worker chose reaches the others through the coordination service's
key-value store, so every worker exits with the same code.

In an elastic job (distribute.ELASTIC_ENV set by the launcher) the worker that was itself signalled exits
errors.LEAVING (43) instead: the job goes on without it (mwloop.launcher.elastic).

A single process needs no agreement, so it only notes the signal: this also
avoids the handler's platform probe, an HTTP request to the GCE metadata host.

Signals are read by a thread woken through Python's signal wakeup fd, not by
Python-level handlers: those run only when the main thread returns from
TensorFlow, and a second Ctrl-C must exit at once even in a long loop call.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import tensorflow as tf
from absl import logging
from tensorflow.python.eager import context

from mwloop import errors
from mwloop.artifacts.checkpoint import Checkpointer
from mwloop.cluster import distribute, peers

_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, errors.INTERRUPT_SIGNAL)
# Exit 42: a restart resumes.
_PREEMPTING = (signal.SIGTERM, signal.SIGHUP)
# A key in the coordination service's key-value store (context.context(): no public API; TensorFlow's own
# handler uses it the same way): 42 or 130, set by the first worker signalled.
_EXIT_CODE_KEY = "mwloop_stop_exit_code"
# The handler's CheckpointManager directory, under the checkpoints': read once (nothing there), never written.
UNUSED_DIR = ".preemption-handler-unused"


def _ignore(signum, frame) -> None:
    """The Python-level handler: a no-op, the signal thread acts (Python needs a handler to wake it)."""


class PreemptionWatcher:
    """Call `check(step)` after every loop call: it saves and exits when preempted or interrupted."""

    def __init__(self, strategy: tf.distribute.Strategy, checkpointer: Checkpointer):
        self._checkpointer = checkpointer
        self._handler = None
        # This process's own signal: errors.PREEMPTED or errors.INTERRUPTED.
        self._own_code: int | None = None
        self._sigints = 0
        # Every worker's exit code, once known.
        self._final_code: int | None = None
        self._previous_handlers: dict[int, object] = {}
        self._previous_wakeup_fd = -1
        self._wakeup_fd = -1
        if distribute.num_workers(strategy) > 1:
            # TensorFlow's handler watches SIGTERM itself (its Python handler flags it at once; a polled
            # termination_watcher_fn is read once a second, and a SIGTERM in a run's last second then hung the
            # chief at the end). A Ctrl-C reaches it as a SIGTERM to this process (_on_signal).
            config = tf.distribute.experimental.TerminationConfig(exit_fn=self._exit, save_fn=self._save)
            # The handler's threads die with a lost peer: one line, not a traceback.
            peers.quiet_watcher_threads()
            self._handler = tf.distribute.experimental.PreemptionCheckpointHandler(
                strategy.cluster_resolver, tf.train.CheckpointManager(
                    tf.train.Checkpoint(), os.path.join(checkpointer.directory, UNUSED_DIR), 1),
                termination_config=config)
        # Signal handlers can only be set in the main thread.
        if threading.current_thread() is threading.main_thread():
            # Last: nothing after it can fail and leave the handlers installed.
            self._watch_signals()

    def _watch_signals(self) -> None:
        read_fd, self._wakeup_fd = os.pipe()
        # The C-level handler must never block.
        os.set_blocking(self._wakeup_fd, False)
        # A SIGINT ignored from the start (a script's background job, nohup) stays ignored, as Python does it.
        # Nor SIGTERM while TensorFlow's handler watches it (see __init__).
        watched = [s for s in _SIGNALS if not (s == signal.SIGINT and signal.getsignal(s) == signal.SIG_IGN)
                   and not (s == signal.SIGTERM and self._handler is not None)]
        self._previous_handlers = {s: signal.signal(s, _ignore) for s in watched}
        self._previous_wakeup_fd = signal.set_wakeup_fd(self._wakeup_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._read_signals, args=(read_fd,), name="mwloop-signals", daemon=True).start()

    def _read_signals(self, read_fd: int) -> None:
        """Runs until close() closes the pipe's other end."""
        try:
            while data := os.read(read_fd, 64):
                for signum in data:
                    self._on_signal(signum)
        finally:
            os.close(read_fd)

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        # Only a second SIGINT is "exit now": a terminal's Ctrl-C and the launcher's forwarded one reach a
        # worker in either order (different threads may take them), and must count as one.
        self._sigints += signum == signal.SIGINT
        if self._sigints > 1:
            logging.warning("received SIGINT again: exiting now with code %d, without saving", errors.INTERRUPTED)
            sys.stderr.flush()
            # The main thread may be deep in TensorFlow: no unwinding.
            os._exit(errors.INTERRUPTED)
        if self._own_code is None:
            self._own_code = errors.PREEMPTED if signum in _PREEMPTING else errors.INTERRUPTED
            logging.warning("received %s: saving a checkpoint at the end of this loop call, then exiting with "
                            "code %d (a second Ctrl-C exits now, without saving)", name, self._own_code)
            if self._handler is not None:
                self._publish()
                # TensorFlow's handler acts on SIGTERM: pass a Ctrl-C or SIGHUP on.
                if signum != signal.SIGTERM:
                    os.kill(os.getpid(), signal.SIGTERM)
        else:
            logging.info("received %s while already stopping; ignored", name)

    def _publish(self) -> None:
        """Tells every worker this worker's exit code (before TensorFlow's handler tells them to stop)."""
        try:
            context.context().set_config_key_value(_EXIT_CODE_KEY, str(self._own_code))
        except tf.errors.AlreadyExistsError:
            # Another worker was signalled first: its code stands.
            pass
        except tf.errors.OpError as e:
            # One line: a lost peer's gRPC details say no more.
            logging.warning("could not tell the other workers exit code %d: %s", self._own_code,
                            str(e).splitlines()[0][:160])

    def _code(self) -> int:
        """The exit code for all workers: the first signalled worker's (set before the handler tells anyone)."""
        if self._final_code is None:
            self._final_code = self._own_code or errors.PREEMPTED
            if self._handler is not None:
                try:
                    self._final_code = int(context.context().get_config_key_value(_EXIT_CODE_KEY, timeout_in_ms=10_000))
                except (tf.errors.OpError, ValueError) as e:
                    logging.warning("could not read the workers' exit code (%s); using %d", e, self._final_code)
        return self._final_code

    def _save(self, step: int) -> None:
        reason = "interrupted" if self._code() == errors.INTERRUPTED else "preempted"
        logging.warning("%s: saving a checkpoint at step %d", reason, step)
        # Waits for an asynchronous write in flight, then this one.
        self._checkpointer.save(step, final=True)

    def _exit(self) -> None:
        code = self._code()
        if code == errors.PREEMPTED and self._own_code == errors.PREEMPTED and distribute.elastic_worker_counts():
            # The notice was this worker's own: an elastic job goes on without it.
            code = errors.LEAVING
        if code == errors.INTERRUPTED:
            logging.warning("interrupted: checkpoint saved; exiting with code %d (rerun the command to resume)", code)
        elif code == errors.LEAVING:
            logging.warning("given notice: checkpoint saved; exiting with code %d (the elastic job goes on "
                            "without this worker)", code)
        else:
            logging.warning("preempted: checkpoint saved; exiting with code %d for a restart", code)
        self.close()
        # The exit is under way: a Ctrl-C during TensorFlow's teardown (seconds) must not turn it into a
        # kill by SIGINT. Ignored, not handled: Python resets its own handlers to the default while it
        # finalizes, but leaves an ignored signal ignored.
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        # Not the main thread: Python's own handler stays.
        except ValueError:
            pass
        sys.exit(code)

    def check(self, step: int) -> None:
        """Saves at `step` and exits with code 42 (SIGTERM) or 130 (SIGINT) if any worker was told to stop."""
        if self._handler is not None:
            self._handler.save_checkpoint_if_preempted(step)
        elif self._own_code is not None:
            self._save(step)
            self._exit()

    def close(self) -> None:
        """Restores the signal handlers; safe to call twice."""
        if self._wakeup_fd >= 0:
            for signum, handler in self._previous_handlers.items():
                # None: set outside Python.
                signal.signal(signum, signal.SIG_DFL if handler is None else handler)
            signal.set_wakeup_fd(self._previous_wakeup_fd)
            # The signal thread reads end-of-file and ends.
            os.close(self._wakeup_fd)
            self._wakeup_fd = -1
