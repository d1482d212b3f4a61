"""config.on_nonfinite: what a NaN or Inf loss does to the run, and why no checkpoint ever holds one.

"fail" stops at the first step whose loss or gradients were not finite on any replica, naming the step
(and the loss part); "skip" lets the loop skip that update on every replica alike and counts it. Either
way a checkpoint is never written with non-finite weights: it would poison every resume.
"""

from __future__ import annotations

import keras
import tensorflow as tf
from absl import logging

from mwloop.loop import loops
from mwloop.run.hooks import Hook, LoopCall


class NonfiniteGuard(Hook):
    """Reads each loop call's non-finite status; checks the weights before each save.

    Args:
      model: the model whose weights a save would write.
      skip: config.on_nonfinite == "skip" (the loop skipped the update; count it), else fail.
      fix: what the failure's line suggests besides a lower learning rate (the engine's `nonfinite_fix`).
    """

    def __init__(self, model: keras.Model, *, skip: bool, fix: str):
        self.model, self.skip, self.fix = model, skip, fix
        # In the current `train` call.
        self.skipped_updates = 0
        # Traced at the first save.
        self._weights_finite: tf.types.experimental.PolymorphicFunction | None = None

    def train_started(self, step: int, dropped_events: list[dict]) -> None:
        self.skipped_updates = 0

    def after_call(self, call: LoopCall) -> None:
        bad_step = loops.first_nonfinite_step(call.status, call.first_step)
        if bad_step is None:
            return
        if not self.skip:
            raise FloatingPointError(loops.nonfinite_message(bad_step, call.sums, self.fix))
        skipped = round(call.status["skipped"])
        self.skipped_updates += skipped
        logging.warning("skipped %d non-finite update(s) from step %d (%d so far)", skipped, bad_step,
                        self.skipped_updates)

    def before_save(self, step: int) -> None:
        # One traced call over every weight: checked one eager op at a time it took 42 ms per save of
        # ResNet-50, 80 % of what an asynchronous save blocked.
        if self._weights_finite is None:
            weights = list(self.model.weights)
            self._weights_finite = tf.function(
                lambda: tf.reduce_all([tf.reduce_all(tf.math.is_finite(v)) for v in weights]), autograph=False)
        if not bool(self._weights_finite()):
            raise FloatingPointError(f"weights are not finite at step {step}; not saving a checkpoint. "
                                     f"Lower the learning rate and resume from the last checkpoint")

    before_best_save = before_save
