"""An elastic job's `membership` events (local: mwloop.launcher.elastic; across machines: the agent's leader,
mwloop.launcher.leader): one console line per change of membership once the step it resumes from is known, and
one metrics.jsonl event with the seconds lost once the new round trains (or the job ends)."""

from __future__ import annotations

import dataclasses
import os
import time

from absl import logging

from mwloop.artifacts import files, jsonl


def local_checkpoint_step(workdir: str | None) -> int | None:
    """The newest checkpoint's step (-1: none yet), or None when there is no local workdir to look in (then a
    place that comes back is admitted without waiting for a checkpoint)."""
    if not workdir or "://" in workdir:
        return None
    step = files.newest_checkpoint_step(workdir)
    return -1 if step is None else step


@dataclasses.dataclass
class _Change:
    """A membership change on its way: recorded once the new round trains (or the job ends).

    Attributes:
      at: time.time() of the event.
      step: the checkpoint step the new round resumes from (0: the start); known at `settle`.
      steps_redone: steps trained after that checkpoint, as far as metrics.jsonl showed them.
    """

    before: int
    after: int
    why: str
    at: float
    step: int | None = None
    steps_redone: int = 0


class MembershipLog:
    """A job's `membership` events: a change is announced when it is decided, its console line follows once the
    step it resumes from is known (`settle`, after the stop and any save on the way), and its metrics.jsonl event
    (with the seconds lost) once the new round trains past that step, or the job ends. Shared by the local
    elastic job and the multi-machine agent's leader (mwloop.launcher.agent), so both write the same events."""

    def __init__(self, workdir: str | None):
        self.workdir = workdir
        self.change: _Change | None = None
        self._tail = files.MetricsTail(workdir) if workdir else None
        # The newest train step metrics.jsonl has shown.
        self._last_step = 0

    def announce(self, before: int, after: int, why: str) -> None:
        """A change of membership: its line and event follow once the step it resumes from is known (`settle`)."""
        # The previous change never trained: its event says so (no seconds).
        if self.change is not None:
            self._record(trained=False)
        self.change = _Change(before, after, why, time.time())

    def forms(self, workers: int) -> None:
        """The next round forms with `workers`: the pending change's line names the round that trains (places
        can come back between a change and the round it leads to)."""
        change = self.change
        if change is not None and change.step is None and change.after != workers:
            change.why += f"; {workers - change.after} place(s) back before the round formed"
            change.after = workers

    def settle(self) -> None:
        """The pending change's resume step, once its stop (and any save on the way) is over: its console line."""
        change = self.change
        if change is None or change.step is not None:
            return
        self._poll_metrics()
        change.step = max(0, local_checkpoint_step(self.workdir) or 0)
        change.steps_redone = max(0, self._last_step - change.step)
        logging.warning("membership: workers %d -> %d from step %d (%s)%s", change.before, change.after, change.step,
                        change.why, f"; {change.steps_redone} step(s) after that checkpoint are trained again"
                        if change.steps_redone else "")

    def poll(self) -> None:
        """Reads metrics.jsonl's new lines; records the pending change once a step past its resume step trained."""
        if self._poll_metrics() and self.change is not None:
            self._record(trained=True)

    def finish(self) -> None:
        """The job finished: records the pending change (trained, if a step past its resume step showed)."""
        self._poll_metrics()
        if self.change is not None:
            self.settle()
            self._record(trained=self._last_step > self.change.step)

    def end(self) -> None:
        """The job ends before the pending change trained: its event says so (no seconds)."""
        if self.change is not None:
            self._record(trained=False)

    def _poll_metrics(self) -> bool:
        """Reads metrics.jsonl's new lines; whether a train step past the pending change's step appeared."""
        if self._tail is None:
            return False
        trained = False
        for event in self._tail.poll():
            if event.get("split") == "train" and isinstance(event.get("step"), int):
                self._last_step = event["step"]
                trained |= self.change is not None and self.change.step is not None and (
                    event["step"] > self.change.step)
        return trained

    def _record(self, trained: bool) -> None:
        """Writes the pending change's `membership` event (when the new round trained, or the job ends)."""
        self.settle()
        change, self.change = self.change, None
        seconds = round(time.time() - change.at, 2)
        event = {"step": change.step, "split": "membership", "workers_before": change.before,
                 "workers_after": change.after, "why": change.why, "steps_redone": change.steps_redone,
                 "seconds_lost": seconds if trained else None}
        if trained:
            logging.info("membership: training again with %d workers, %.1fs after the change (%s)", change.after,
                         seconds, change.why)
        if self.workdir and os.path.isdir(self.workdir):
            # One line, one write: appends from the chief (O_APPEND too) never tear it.
            with open(os.path.join(self.workdir, files.METRICS), "a") as f:
                f.write(jsonl.dumps(event) + "\n")
