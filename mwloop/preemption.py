"""Preemption: on SIGTERM to any worker, all workers save at the same step and exit 42.

TensorFlow's PreemptionCheckpointHandler does the signalling and the agreement
on the step across workers; mwloop does the saving, through its own
Checkpointer (chief dir on the chief, temporary dirs elsewhere). The handler is
given an empty CheckpointManager on purpose: its built-in restore trusts the
checkpoint state file (no fallback past a corrupt checkpoint) and its run
counter must agree on every worker, so mwloop restores by itself and every
worker starts the handler's count at 0.
"""

from __future__ import annotations

import shutil
import sys
import tempfile

import tensorflow as tf
from absl import logging

from mwloop.checkpoint import Checkpointer

PREEMPTED_EXIT_CODE = 42


class PreemptionWatcher:
    """Call `check(step)` after every loop call: it saves and exits when preempted."""

    def __init__(self, strategy: tf.distribute.Strategy, checkpointer: Checkpointer):
        self._checkpointer = checkpointer
        self._scratch = tempfile.mkdtemp(prefix="mwloop-preemption-")
        config = tf.distribute.experimental.TerminationConfig(exit_fn=self._exit, save_fn=self._save)
        self._handler = tf.distribute.experimental.PreemptionCheckpointHandler(
            getattr(strategy, "cluster_resolver", None),
            tf.train.CheckpointManager(tf.train.Checkpoint(), self._scratch, max_to_keep=1),
            termination_config=config)

    def _save(self, step: int) -> None:
        logging.warning("preempted: saving a checkpoint at step %d", step)
        self._checkpointer.save(step)

    def _exit(self) -> None:
        logging.warning("preempted: checkpoint saved; exiting with code %d for a restart", PREEMPTED_EXIT_CODE)
        self.close()
        sys.exit(PREEMPTED_EXIT_CODE)

    def check(self, step: int) -> None:
        """Saves at `step` and exits with code 42 if any worker was told to stop."""
        self._handler.save_checkpoint_if_preempted(step)

    def close(self) -> None:
        shutil.rmtree(self._scratch, ignore_errors=True)
