"""Preemption: on SIGTERM to any worker, all workers save at the same step and exit 42.

Across workers, TensorFlow's PreemptionCheckpointHandler does the signalling
and the agreement on the step; mwloop does the saving through its own
Checkpointer (chief dir on the chief, temporary dirs elsewhere). The handler is
given an empty CheckpointManager on purpose: its built-in restore trusts the
checkpoint state file (no fallback past a corrupt checkpoint) and its run
counter must agree on every worker, so mwloop restores by itself and every
worker starts the handler's count at 0.

A single process needs no agreement, so it only notes the signal: this also
avoids the handler's platform probe, an HTTP request to the GCE metadata host.
"""

from __future__ import annotations

import shutil
import signal
import sys
import tempfile

import tensorflow as tf
from absl import logging

from mwloop import distribute
from mwloop.checkpoint import Checkpointer

PREEMPTED_EXIT_CODE = 42


class PreemptionWatcher:
    """Call `check(step)` after every loop call: it saves and exits when preempted."""

    def __init__(self, strategy: tf.distribute.Strategy, checkpointer: Checkpointer):
        self._checkpointer = checkpointer
        self._scratch = None
        self._handler = None
        self._signalled = False
        self._previous_handler = None
        if distribute.num_workers(strategy) > 1:
            self._scratch = tempfile.mkdtemp(prefix="mwloop-preemption-handler-")
            config = tf.distribute.experimental.TerminationConfig(exit_fn=self._exit, save_fn=self._save)
            self._handler = tf.distribute.experimental.PreemptionCheckpointHandler(
                strategy.cluster_resolver, tf.train.CheckpointManager(tf.train.Checkpoint(), self._scratch, 1),
                termination_config=config)
        else:
            self._previous_handler = signal.signal(signal.SIGTERM, self._note_signal)

    def _note_signal(self, signum, frame) -> None:
        logging.warning("received SIGTERM: saving at the end of this loop call, then exiting")
        self._signalled = True

    def _save(self, step: int) -> None:
        logging.warning("preempted: saving a checkpoint at step %d", step)
        self._checkpointer.save(step)

    def _exit(self) -> None:
        logging.warning("preempted: checkpoint saved; exiting with code %d for a restart", PREEMPTED_EXIT_CODE)
        self.close()
        sys.exit(PREEMPTED_EXIT_CODE)

    def check(self, step: int) -> None:
        """Saves at `step` and exits with code 42 if any worker was told to stop."""
        if self._handler is not None:
            self._handler.save_checkpoint_if_preempted(step)
        elif self._signalled:
            self._save(step)
            self._exit()

    def close(self) -> None:
        if self._scratch:
            shutil.rmtree(self._scratch, ignore_errors=True)
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None
