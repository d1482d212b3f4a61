"""When the Trainer's actions run: triggers in steps and seconds, the chief's clock, stop decisions.

No TensorFlow here: the Trainer hands in how to broadcast the chief's values (one small all-reduce) and a
clock, so the schedule is tested with a fake loop and a fake clock (tests/test_schedule.py).

Control flow is common to all workers: step-based triggers are known alike everywhere; a time-based trigger
of an action that every worker runs (or that may stop training) is the chief's clock, broadcast at every
call's end; a stop requested by any action is the chief's decision, broadcast at every step where an action
that may stop was due.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from mwloop.errors import UserError

# The chief's values on every worker (each > 0.5).
Broadcast = Callable[[list[float]], list[bool]]


class Triggers:
    """When an action is due, and where it runs; `mwloop.Action` is one.

    Attributes:
      every_steps: every this many optimizer updates (0: never).
      every_secs: every this many seconds, checked when a loop call ends (0: never).
      at_steps: at each of these steps.
      at_end: at the run's last step (and when training stops early).
      every_call: after every loop call, with no trigger of its own.
      after_eval: after every eval, whatever triggered it.
      all_workers: on every worker (anything running collectives); else the chief only.
      may_stop: it may request a stop (the workers then agree after it is due).
      last_time: when it last ran (or training started): every_secs counts from here.
    """
    every_steps: int = 0
    every_secs: float = 0.0
    at_steps: tuple[int, ...] = ()
    at_end: bool = False
    every_call: bool = False
    after_eval: bool = False
    all_workers: bool = False
    may_stop: bool = False

    def __init__(self, *, every_steps: int | None = None, every_secs: float | None = None,
                 at_steps: tuple[int, ...] | None = None, at_end: bool | None = None,
                 all_workers: bool | None = None, clock: Callable[[], float] = time.monotonic):
        for name, value in (("every_steps", every_steps), ("every_secs", every_secs), ("at_steps", at_steps),
                            ("at_end", at_end), ("all_workers", all_workers)):
            if value is not None:
                setattr(self, name, value)
        if self.every_steps < 0 or self.every_secs < 0:
            raise UserError(f"{type(self).__name__}: every_steps={self.every_steps}, every_secs={self.every_secs}; "
                            f"use 0 (never) or a positive interval")
        self.last_time = clock()

    def next_step(self, step: int) -> int | None:
        """The first step after `step` at which a step-based trigger is due (None: no such trigger)."""
        candidates = [s for s in self.at_steps if s > step]
        if self.every_steps > 0:
            candidates.append((step // self.every_steps + 1) * self.every_steps)
        return min(candidates, default=None)

    def due_by_steps(self, step: int) -> bool:
        return (self.every_steps > 0 and step % self.every_steps == 0) or step in self.at_steps

    def due_by_time(self, now: float) -> bool:
        return self.every_secs > 0 and now - self.last_time >= self.every_secs


class Schedule:
    """Runs a list of actions, in order, at the steps and times they are due.

    Args:
      actions: what runs between loop calls, in order.
      chief: whether this process is the chief (chief-only actions run here).
      num_workers: workers in the cluster; with more than one, time triggers and stops are agreed.
      broadcast: the chief's values on every worker (called at common points only).
      clock: seconds, monotonic (a fake one in tests).
    """

    def __init__(self, actions: Sequence[Triggers], *, chief: bool, num_workers: int, broadcast: Broadcast,
                 clock: Callable[[], float] = time.monotonic):
        self.actions, self.chief, self.num_workers = list(actions), chief, num_workers
        self._broadcast, self._clock = broadcast, clock
        self._stepped = [a for a in self.actions if a.every_steps or a.at_steps]
        # Time triggers every worker must agree on: the chief's clock decides, at every call's end.
        self._shared_timed = [a for a in self.actions if a.every_secs > 0 and (a.all_workers or a.may_stop)] \
            if num_workers > 1 else []

    def call_end(self, step: int, until: int, steps_per_loop: int) -> int:
        """Where the loop call starting at `step` ends: after steps_per_loop steps, at `until`, or at the
        next step where a step-based trigger is due, whichever comes first."""
        return min([step + steps_per_loop, until] + [s for a in self._stepped if (s := a.next_step(step))])

    def run(self, step: int, *, final: bool, call: Callable[[Triggers], None],
            last_eval_step: Callable[[], int | None], stop_reason: Callable[[], str | None]) -> bool:
        """Runs the actions due at `step`; with a stop agreed (and not at the last step), the `at_end` ones too.

        Args:
          step: the step the loop call ended at.
          final: whether it is the run's last step.
          call: runs one action (which may request a stop, read back through `stop_reason`).
          last_eval_step: the step of the latest eval (an action may just have run one).
          stop_reason: the stop requested on this worker so far, or None.
        Returns:
          Whether training stops here (on every worker alike).
        """
        now = self._clock()
        timed = [a for a in self.actions if a.due_by_time(now)]
        if self._shared_timed:
            agreed = self._broadcast([float(a in timed) for a in self._shared_timed])
            timed = [a for a in timed if a not in self._shared_timed] + [
                a for a, yes in zip(self._shared_timed, agreed) if yes]
        ran, may_stop = [], False
        for action in self.actions:
            due = (action.every_call or action.due_by_steps(step) or (final and action.at_end) or action in timed
                   or (action.after_eval and last_eval_step() == step))
            # Known alike on every worker: so is the agreement below.
            may_stop |= due and action.may_stop
            if due and (action.all_workers or self.chief):
                self._call(action, call, ran, now)
        stopping = stop_reason() is not None
        if may_stop and self.num_workers > 1:
            # The chief's decision.
            stopping = self._broadcast([float(stopping)])[0]
        if stopping and not final:
            # The end of the run, as at its last step: log, final save.
            for action in self.actions:
                if action.at_end and action not in ran and (action.all_workers or self.chief):
                    self._call(action, call, ran, now)
        return stopping

    @staticmethod
    def _call(action: Triggers, call: Callable[[Triggers], None], ran: list, now: float) -> None:
        call(action)
        action.last_time = now
        ran.append(action)
