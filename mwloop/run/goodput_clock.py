"""The goodput clock: where one process's time goes, recorded by the chief in metrics.jsonl.

A hook (`mwloop.run.hooks`): it is told of what already happens, never per step: once per loop call
(`after_call`, with the seconds the controller measures anyway and the loop's tracing count), around saves,
evals and exports (`section`), at the start of training (`train_started`: the attempt record, with what the
resume drops), before each rotating checkpoint (`before_save`: a `clock` record a killed attempt is read back
from) and at the end (`closing`: the `goodput` event). The time between two loop calls outside any timed
section is "other" (the actions and the loop's Python); before the first loop call it is start-up, counted from
the process's creation. The records and their reading: mwloop.artifacts.goodput.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator

from absl import logging

from mwloop.artifacts import goodput
from mwloop.artifacts.writers import MetricWriter
from mwloop.run.hooks import Hook, LoopCall


def process_start_time() -> float:
    """When this process was created, in seconds since the epoch (Linux: /proc/self/stat's start time, to the
    clock tick; elsewhere: now, so start-up counts from the Trainer's creation)."""
    try:
        with open("/proc/self/stat") as f:
            # Field 22 (starttime, clock ticks after boot); the command name in field 2 may hold spaces.
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


_process_start_taken = False
# count_from's moment, if any.
_work_started: float | None = None


def count_from(when: float) -> None:
    """This process's work began at `when` (seconds since the epoch), not at its creation: a launcher's standby
    worker (mwloop.launcher.standby) was created ahead of need and imported while the attempt before trained, so
    its first clock counts start-up from when it was given its task; a warm-started one (mwloop.launcher.warm) was
    forked after the launcher asked for it, so its clock counts from the asking, the wait for the warm server's
    imports included."""
    global _work_started
    _work_started = when


def _start_of_this_clock() -> float:
    """The process's creation (or `count_from`'s moment) for its first clock; now for any later one (a second
    Trainer in one process starts its attempt when it is made, not when the process started)."""
    global _process_start_taken
    if _process_start_taken:
        return time.time()
    _process_start_taken = True
    created = process_start_time()
    return created if _work_started is None else _work_started


class GoodputClock(Hook):
    """One process's seconds by cause (`goodput.CLOCK_FIELDS`); the chief writes its records (`writer`)."""

    def __init__(self, writer: MetricWriter, tracing_count: Callable[[], int] | None = None,
                 process_start: float | None = None):
        """`tracing_count`: the train loop's tf.function tracing count (a call that raised it traced); it can
        be set later (`tracing_count` attribute), once the loop is built."""
        self.writer = writer
        self.tracing_count = tracing_count
        self.process_start = _start_of_this_clock() if process_start is None else process_start
        self.seconds = dict.fromkeys(goodput.CLOCK_FIELDS, 0.0)
        # perf_counter for durations; the epoch only for records. The process start in perf_counter's terms:
        self._window_start = time.perf_counter() - (time.time() - self.process_start)
        # What the time outside timed sections is, until the first loop call.
        self._window_cause = "startup"
        # Seconds of timed sections since the window started.
        self._in_sections = 0.0
        self._traces_seen = 0
        # perf_counter at the start of the loop call under way: a call that never returns waits for a peer
        self.call_started: float | None = None
        self._lost: dict | None = None
        # Whether the attempt record was written.
        self.started = False

    # ------------------------------------------------------------------ measuring
    def loop_call(self, started: float, seconds: float, steps: int) -> None:
        """A loop call of `steps` steps that began at `started` (perf_counter) and took `seconds`."""
        self.seconds[self._window_cause] += started - self._window_start - self._in_sections
        count = self.tracing_count() if self.tracing_count is not None else 0
        kind = "traced" if count != self._traces_seen else "steady"
        self._traces_seen = count
        self.seconds[f"{kind}_s"] += seconds
        self.seconds[f"{kind}_steps"] += steps
        self._window_start, self._window_cause, self._in_sections = started + seconds, "other", 0.0
        self.call_started = None

    # ------------------------------------------------------------------ as the run's hook
    def loop_built(self, train_loop: Callable) -> None:
        self.tracing_count = getattr(train_loop, "tracing_count", None)

    def before_call(self, step: int, started: float) -> None:
        self.call_started = started

    def after_call(self, call: LoopCall) -> None:
        self.loop_call(call.started, call.seconds, call.end_step - call.first_step)

    def section(self, cause: str) -> contextlib.AbstractContextManager[None]:
        return self.timing(cause)

    def train_started(self, step: int, dropped_events: list[dict]) -> None:
        """Training starts at `step`; the events a resume dropped from metrics.jsonl (`dropped_events`) are the
        attempt before's lost work, kept in this attempt's record."""
        if dropped_events:
            self._lost = goodput.lost_record(dropped_events, step)
        self.started_training(step)

    def before_save(self, step: int) -> None:
        # First: once an asynchronous write started, TensorFlow's writing thread holds the GIL in 5 ms slices,
        # and this small append took 5-16 ms.
        self.saved(step)

    def closing(self, step: int) -> None:
        self.close(step)

    @contextlib.contextmanager
    def timing(self, cause: str) -> Iterator[None]:
        """Counts the block's seconds as `cause` ("checkpoint", "eval", "other"), less those of timed blocks
        inside it (a save inside an action)."""
        started = time.perf_counter()
        outer, self._in_sections = self._in_sections, 0.0
        try:
            yield
        finally:
            elapsed = time.perf_counter() - started
            self.seconds[cause] += elapsed - self._in_sections
            self._in_sections = outer + elapsed

    def totals(self) -> dict[str, float]:
        """The seconds by cause up to now (the time since the last loop call, outside timed sections, too)."""
        totals, now = dict(self.seconds), time.perf_counter()
        # A loop call that raised (a lost peer) or is under way: it trains nothing.
        if self.call_started is not None:
            totals["stalled"] += now - self.call_started
            now = self.call_started
        totals[self._window_cause] += now - self._window_start - self._in_sections
        return totals

    # ------------------------------------------------------------------ records (the chief's writer)
    def started_training(self, step: int) -> None:
        """Training starts at `step`: the attempt record (once per process)."""
        if self.started:
            return
        self.started = True
        record = {"time": time.time(), "clock": {"process_start": self.process_start, "pid": os.getpid()}}
        if self._lost:
            record["lost"] = self._lost
        self.writer.write_event(step, goodput.ATTEMPT, record)

    def saved(self, step: int) -> None:
        """A rotating checkpoint of `step` is saved: the clock so far (a killed attempt is read back from it)."""
        if self.started:
            self.writer.write_event(step, goodput.CLOCK, {"time": time.time(), "clock": self.totals()})

    def report(self) -> goodput.Report | None:
        """The job's goodput so far, this attempt included (None before training started, or off the chief)."""
        if not (self.started and self.writer.enabled):
            return None
        return goodput.report([*self.writer.read(), self._end_record()])

    def _end_record(self) -> dict:
        return {"split": goodput.GOODPUT, "step": -1, "time": time.time(), "clock": self.totals()}

    def close(self, step: int) -> goodput.Report | None:
        """The attempt ends at `step`: the `goodput` event (metrics.jsonl, TensorBoard, MLflow). Never raises:
        it runs on the way out of errors too."""
        if not (self.started and self.writer.enabled):
            return None
        try:
            end = self._end_record()
            result = goodput.report([*self.writer.read(), end])
            self.writer.write(step, goodput.GOODPUT, result.figures(), record={"time": end["time"],
                                                                               "clock": end["clock"]})
            return result
        except Exception as e:  # noqa: BLE001 - the run is ending (maybe on an error): say so, do not mask it
            logging.warning("goodput: no end record written (%s: %s)", type(e).__name__, e)
            return None
