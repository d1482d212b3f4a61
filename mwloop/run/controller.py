"""The controller: loop calls of steps_per_loop steps and, between them, the actions that are due.

Orbit's Controller, sized to mwloop. It receives its parts built (`mwloop.run.build`) and knows no policy by
name: what happens around a loop call (the goodput clock, the non-finite guard) are hooks, what happens between
calls (log, eval, checkpoint, preemption, the user's own) are actions. A stop requested by an action is the
chief's decision on every worker (`Schedule.run`), so no worker trains on alone.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import tensorflow as tf
from absl import logging

from mwloop.errors import UserError
from mwloop.run.actions import Action
from mwloop.run.context import ActionContext
from mwloop.run.hooks import Hooks, LoopCall
from mwloop.run.schedule import Schedule


class Controller:
    """Drives a run's train loop and its actions.

    Args:
      step: the run's step variable (assigned after each loop call).
      actions, schedule: what runs between loop calls, and when each is due.
      context: what every action receives (`ActionContext`).
      hooks: the policies told of each loop call.
      num_workers: workers running in step (a stop by an action that did not declare it needs them agreed).
    Attributes:
      stop_reason: why training stopped early (an action's request, agreed), or None.
      last_eval_step: the step of the latest eval (actions with `after_eval` run right after it).
    """

    def __init__(self, *, step: tf.Variable, actions: Sequence[Action], schedule: Schedule, context: ActionContext,
                 hooks: Hooks, num_workers: int):
        self.step, self.actions, self.schedule, self.context = step, list(actions), schedule, context
        self.hooks, self.num_workers = hooks, num_workers
        self.stop_reason: str | None = None
        self.last_eval_step: int | None = None
        self._observers = [a for a in self.actions if type(a).observe is not Action.observe]
        self._running: Action | None = None

    def train(self, train_loop: Callable, train_input: Any, *, start: int, until: int, total: int,
              steps_per_loop: int, finish: Callable[[], None] = lambda: None) -> int:
        """Trains from `start` to `until` (of `total`, the run's last step); returns the step reached (earlier
        if an action stopped training). Every action's `start` and `end` run around it, and `finish` (the
        last checkpoint's write) before the actions end: a preemption meanwhile is still handled."""
        for action in self.actions:
            action.start(self.context, start)
        try:
            step = self._loop(train_loop, train_input, start, until, total, steps_per_loop)
            finish()
            return step
        finally:
            for action in self.actions:
                action.end(self.context)

    def _loop(self, train_loop: Callable, train_input: Any, step: int, until: int, total: int,
              steps_per_loop: int) -> int:
        while step < until:
            stop = self.schedule.call_end(step, until, steps_per_loop)
            started = time.perf_counter()
            self.hooks.before_call(step, started)
            sums, status = train_loop(train_input, tf.constant(stop - step))
            # The call returns floats, so its work is done.
            seconds = time.perf_counter() - started
            self.hooks.after_call(LoopCall(step, stop, started, seconds, sums, status))
            step = stop
            # No read back: ~10 us a call.
            self.step.assign(step, read_value=False)
            for action in self._observers:
                action.observe(self.context, step, sums, seconds)
            if self._run_actions(step, final=step == total):
                break
        logging.info("training %s at step %d", "stopped" if self.stop_reason else "done", step)
        return step

    def _run_actions(self, step: int, final: bool) -> bool:
        """The actions due at `step` (`Schedule.run`); whether training stops here."""
        stopping = self.schedule.run(step, final=final, call=lambda action: self._call(action, step),
                                     last_eval_step=lambda: self.last_eval_step,
                                     stop_reason=lambda: self.stop_reason)
        if not stopping:
            # A worker's own request counts only if the chief agreed.
            self.stop_reason = None
            return False
        self.stop_reason = self.stop_reason or "the chief stopped training"
        if not final:
            self.context.writer.write_event(step, "stop", {"reason": self.stop_reason})
            logging.info("stopping at step %d: %s", step, self.stop_reason)
        return True

    def _call(self, action: Action, step: int) -> None:
        self._running = action
        try:
            action(self.context, step)
        finally:
            self._running = None

    def request_stop(self, reason: str) -> None:
        """Ends training after the current step's actions, on every worker (the chief's request decides).
        An action that calls it declares `may_stop = True`, so that every worker knows when to agree."""
        if self._running is not None and not self._running.may_stop and self.num_workers > 1:
            raise UserError(f"{type(self._running).__name__} asked to stop training but does not declare "
                            f"may_stop = True; add it, so that every worker agrees on the stop")
        self.stop_reason = self.stop_reason or reason
