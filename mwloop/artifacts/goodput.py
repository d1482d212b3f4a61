"""Goodput: how much of a job's wall time went into training, and where the rest went (badput by cause).

Pure Python on metrics.jsonl's events (no TensorFlow): `report(events)` sums what the run's chief recorded
(`mwloop.run.goodput_clock`), so any workdir can be read back, even one whose job was SIGKILLed.

The records (every one carries `time`, wall-clock seconds since the epoch, and is written by the chief):

    {"step": S, "split": "attempt", "time", "clock": {"process_start", "pid"}, "lost": {"steps", "last_time"}}
        a process started training at step S (its checkpoint); `lost`: what the attempt before it trained after
        that checkpoint (its events, dropped from metrics.jsonl on this resume: their step count and the time
        of the last one), written before they were dropped
    {"step": C, "split": "clock", "time", "clock": {...}}     the attempt's clock after its checkpoint of step C
    {"step": S, "split": "goodput", <the job's figures so far>, "time", "clock": {...}}   the attempt's end
    {"step", "split": "train", ..., "time"}                    train events carry their wall time too

A clock (`CLOCK_FIELDS`) holds one process's seconds by cause since its creation (`process_start`): start-up
(to the first loop call), checkpoint (inside `Trainer.save`/`save_best`), eval, other (actions, logging,
export, the Python between loop calls), stalled (a loop call that never returned: it waited for a lost peer
until the attempt ended; counted as `restart`), and the loop calls: `traced_s`/`traced_steps` of the calls that
traced, `steady_s`/`steady_steps` of the others. A traced call's steps are productive at the steady speed
(the job's, if its own attempt has no steady call); the rest of it is compilation.

How the wall time (the first attempt's process start to the last record) is split, per attempt: from its
process start to its last clock record, the clock's causes (the remainder is `unaccounted`); after that, what
was trained past its last checkpoint and redone (`lost`: to its last dropped event, or, for a last attempt
without an end record, to its last event); then the gap to the next attempt's process start (`restart`: the
launcher's detection and restart, an elastic re-form, a killed attempt's seconds after its last record).
Causes plus productive time equal the wall time by construction; `unaccounted` says how much of it the
records could not attribute.

Each attempt's records come from one process's clock, but consecutive attempts may run on hosts whose wall clocks
disagree (an elastic job's chief moves): an attempt that starts before the one before it ended (by more than
`SKEW_S`) says so. The gaps between attempts are then unknown: the report covers the attempts' own durations
and says why (`Report.skew`), never a share above 100 % or a negative restart. A record without the fields its
kind needs is left out and counted (`Report.skipped`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from mwloop.artifacts import files

# The splits of the records the module docstring lists.
ATTEMPT, CLOCK, GOODPUT = "attempt", "clock", "goodput"
RECORDS = (ATTEMPT, CLOCK, GOODPUT)
CLOCK_FIELDS = ("startup", "checkpoint", "eval", "other", "traced_s", "traced_steps", "steady_s", "steady_steps",
                "stalled")
# The badput causes, in the report's order, with what each line holds.
CAUSES = {
    "startup": "process start to the first loop call (imports, the cluster, building, restoring)",
    "compile": "loop calls that traced, beyond their steps at the steady speed",
    "checkpoint": "blocked in Trainer.save / save_best",
    "eval": "evaluations",
    "other": "other actions and the loop's Python between calls (logging, export)",
    "restart": "detecting a lost peer, the launcher's restart, elastic re-forms, a killed attempt's end",
    "lost": "trained after the last checkpoint, then trained again (a crash)",
    "unaccounted": "not attributed by the records",
}
# Wall clocks of two hosts that disagree by less than this look like one clock (NTP keeps hosts within ms).
SKEW_S = 1.0


@dataclasses.dataclass
class Attempt:
    """One process's share of the job, as its records tell it.

    Attributes:
      start_time: its attempt record's time (training starts).
      clock: its newest clock.
      ended: an end record (`goodput`) survived.
      ended_past_checkpoint: it wrote one, but past its last checkpoint: the resume dropped it.
      last_time: its newest record's time.
      lost_until: the time of its last record that a resume dropped (or never saved).
      reform: the gap before it was an elastic re-form (a membership event at its start step).
    """
    start_step: int
    process_start: float
    start_time: float
    clock: dict[str, float] = dataclasses.field(default_factory=dict)
    clock_time: float | None = None
    clock_step: int | None = None
    ended: bool = False
    ended_past_checkpoint: bool = False
    last_time: float = 0.0
    last_train_step: int | None = None
    lost_steps: int = 0
    lost_until: float | None = None
    reform: bool = False

    @property
    def end(self) -> float:
        """The last moment the records know this attempt alive."""
        return max(self.last_time, self.lost_until or 0.0)


@dataclasses.dataclass
class Report:
    """The goodput of a job: `seconds` by cause (CAUSES) plus `productive`, summing to `wall`."""
    wall: float
    productive: float
    seconds: dict[str, float]
    attempts: list[Attempt]
    lost_steps: int
    # (attempt number, seconds it started before the previous one's last record): clocks that disagree.
    skew: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    # Records left out for lack of a field: (their split, how many).
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def goodput(self) -> float:
        return self.productive / self.wall if self.wall > 0 else 0.0

    def figures(self) -> dict[str, float]:
        """The `goodput` event's numbers (TensorBoard's and MLflow's `goodput/...`)."""
        return {"goodput": self.goodput, "wall_s": self.wall, "productive_s": self.productive,
                **{f"{cause}_s": self.seconds[cause] for cause in CAUSES},
                "lost_steps": float(self.lost_steps), "attempts": float(len(self.attempts))}


def _complete(event: dict) -> bool:
    """Whether a record of the splits this report reads has the fields it needs (a number of seconds, a step)."""
    if event.get("split") not in (ATTEMPT, CLOCK, GOODPUT, "train"):
        return True
    return isinstance(event.get("time"), (int, float)) and isinstance(event.get("step"), int)


def attempts(events: Iterable[dict], skipped: dict[str, int] | None = None) -> list[Attempt]:
    """The attempts of metrics.jsonl's `events`, in order, with what each one's records say. Records without the
    fields they need are left out, counted by split in `skipped`."""
    found: list[Attempt] = []
    reform_steps = set()
    for event in events:
        if not _complete(event):
            if skipped is not None:
                skipped[str(event.get("split"))] = skipped.get(str(event.get("split")), 0) + 1
            continue
        split, time = event.get("split"), event.get("time")
        if split == "membership":
            reform_steps.add(event.get("step"))
        if split == ATTEMPT:
            clock = event.get("clock") or {}
            # What the attempt before it trained past its checkpoint.
            if found and isinstance(event.get("lost"), dict):
                found[-1].lost_steps = int(event["lost"].get("steps") or 0)
                found[-1].lost_until = event["lost"].get("last_time")
                found[-1].ended_past_checkpoint = bool(event["lost"].get("ended"))
            found.append(Attempt(int(event["step"]), float(clock.get("process_start", time)), float(time),
                                 last_time=float(time)))
            continue
        if not found or not isinstance(time, (int, float)):
            continue
        attempt = found[-1]
        attempt.last_time = max(attempt.last_time, float(time))
        if split in (CLOCK, GOODPUT) and isinstance(event.get("clock"), dict):
            attempt.clock, attempt.clock_time, attempt.clock_step = event["clock"], float(time), int(event["step"])
            attempt.ended = split == GOODPUT
        elif split == "train":
            attempt.last_train_step = int(event["step"])
    for attempt in found:
        attempt.reform = attempt.start_step in reform_steps and attempt is not found[0]
    # Killed for good: what it trained past its last clock is lost too.
    if found and not found[-1].ended:
        last = found[-1]
        done = last.clock_step if last.clock_step is not None else last.start_step
        if last.last_train_step is not None and last.last_train_step > done:
            last.lost_steps, last.lost_until = last.last_train_step - done, last.last_time
    return found


def steady_step_s(found: list[Attempt]) -> float | None:
    """The job's seconds per step in loop calls that did not trace (None: no such call yet)."""
    steps = sum(a.clock.get("steady_steps", 0) for a in found)
    return sum(a.clock.get("steady_s", 0.0) for a in found) / steps if steps else None


def _loop_split(clock: dict[str, float], job_step_s: float | None) -> tuple[float, float]:
    """(productive, compile) seconds of one clock's loop calls."""
    steady_s, steady_steps = clock.get("steady_s", 0.0), clock.get("steady_steps", 0)
    traced_s, traced_steps = clock.get("traced_s", 0.0), clock.get("traced_steps", 0)
    step_s = steady_s / steady_steps if steady_steps else job_step_s
    traced_productive = min(traced_s, traced_steps * step_s) if step_s is not None else 0.0
    return steady_s + traced_productive, traced_s - traced_productive


def report(events: Iterable[dict]) -> Report:
    """The job's goodput from metrics.jsonl's `events` (see the module docstring)."""
    skipped: dict[str, int] = {}
    found = attempts(events, skipped)
    # Hosts whose clocks disagree: an attempt that starts before the one before it ended.
    skew = [(i + 2, found[i].end - found[i + 1].process_start) for i in range(len(found) - 1)
            if found[i + 1].process_start < found[i].end - SKEW_S]
    seconds = dict.fromkeys(CAUSES, 0.0)
    productive, lost_steps = 0.0, 0
    job_step_s = steady_step_s(found)
    for i, attempt in enumerate(found):
        clock_time = attempt.clock_time if attempt.clock_time is not None else attempt.start_time
        if attempt.clock:
            for cause in ("startup", "checkpoint", "eval", "other"):
                seconds[cause] += attempt.clock.get(cause, 0.0)
            seconds["restart"] += attempt.clock.get("stalled", 0.0)  # detecting a lost peer
            useful, compile_s = _loop_split(attempt.clock, job_step_s)
            productive += useful
            seconds["compile"] += compile_s
            attributed = sum(attempt.clock.get(c, 0.0) for c in ("startup", "checkpoint", "eval", "other", "stalled")) \
                + useful + compile_s
        else:
            # Killed before its first checkpoint: only its start-up is known.
            seconds["startup"] += attempt.start_time - attempt.process_start
            attributed = attempt.start_time - attempt.process_start
        seconds["unaccounted"] += clock_time - attempt.process_start - attributed
        # After its last clock: lost to the crash from there when a resume dropped its later events; else its
        # records up to its last one are durable (a kill right after a save) but unattributed.
        lost_from = clock_time if attempt.lost_until is not None else max(clock_time, attempt.last_time)
        seconds["unaccounted"] += lost_from - clock_time
        if attempt.lost_until is not None:
            seconds["lost"] += max(0.0, attempt.lost_until - lost_from)
            lost_steps += attempt.lost_steps
        if i + 1 < len(found) and not skew:
            seconds["restart"] += found[i + 1].process_start - attempt.end
    if skew:
        # Each attempt's span on its own clock: the gaps between them are unknown.
        wall = sum(attempt.end - attempt.process_start for attempt in found)
    else:
        wall = found[-1].end - found[0].process_start if found else 0.0
    # What the records cannot attribute: overlaps (a clock set back) and rounding.
    seconds["unaccounted"] += wall - productive - sum(seconds.values())
    return Report(wall=wall, productive=productive, seconds=seconds, attempts=found, lost_steps=lost_steps,
                  skew=skew, skipped=skipped)


def lost_record(dropped: list[dict], resume_step: int) -> dict | None:
    """The `lost` figure of a new attempt's record: of the events a resume at `resume_step` drops, the train
    steps past it, the time of the newest and whether the attempt's end record was among them (None when none
    of them was trained after it)."""
    times = [e["time"] for e in dropped if isinstance(e.get("time"), (int, float))]
    steps = [e["step"] for e in dropped if e.get("split") == "train"]
    if not times:
        return None
    return {"steps": max(steps) - resume_step if steps else 0, "last_time": max(times),
            "ended": any(e.get("split") == GOODPUT for e in dropped)}


def format_report(result: Report, workdir: str = "") -> str:
    """The report as lines for a terminal or a log: goodput, then each cause's seconds and share."""
    if not result.attempts:
        return f"goodput{' of ' + workdir if workdir else ''}: no attempt record in {files.METRICS} (a run " \
               f"before goodput was recorded, or one that never started training)"
    wall = result.wall or 1e-9
    notes = _notes(result)
    if result.goodput > 1.0 or result.productive < 0:
        # A clock set back within one attempt: no figure rather than an impossible one.
        return "\n".join([f"goodput{' of ' + workdir if workdir else ''}: not computable: the records' times go "
                          f"backwards ({result.productive:.1f} s training of {result.wall:.1f} s wall): a host's "
                          "clock was set back during the run", *notes])
    restarts = len(result.attempts) - 1
    reforms = sum(a.reform for a in result.attempts)
    lines = [f"goodput{' of ' + workdir if workdir else ''}: {result.goodput:.1%} ({result.productive:.1f} s "
             f"training of {result.wall:.1f} s wall; {len(result.attempts)} attempt(s), {restarts} restart(s)"
             f"{f', {reforms} of them elastic re-forms' if reforms else ''})",
             f"  {'productive':<12} {result.productive:9.1f} s {result.productive / wall:6.1%}  steps trained once"]
    for cause, what in CAUSES.items():
        value = result.seconds[cause] if abs(result.seconds[cause]) >= 0.005 else 0.0  # no "-0.0"
        note = f" ({result.lost_steps} steps)" if cause == "lost" and result.lost_steps else ""
        lines.append(f"  {cause:<12} {value:9.1f} s {value / wall:6.1%}  {what}{note}")
    for n, attempt in enumerate(result.attempts, 1):
        end = f"ended at step {attempt.clock_step}" if attempt.ended else \
            "ended past its last checkpoint (the resume dropped its end record)" if attempt.ended_past_checkpoint \
            else "no end record (killed)"
        startup = attempt.clock.get("startup", attempt.start_time - attempt.process_start)
        lost = f", {attempt.lost_steps} steps past its last checkpoint lost" if attempt.lost_steps else ""
        lines.append(f"  attempt {n}: from step {attempt.start_step}, {attempt.end - attempt.process_start:.1f} s "
                     f"(start-up {startup:.1f} s), {end}{lost}{', after an elastic re-form' if attempt.reform else ''}")
    return "\n".join(lines + notes)


def _notes(result: Report) -> list[str]:
    """The report's warnings: clocks that disagree, records left out."""
    notes = []
    if result.skew:
        number, seconds = max(result.skew, key=lambda s: s[1])
        notes.append(f"warning: the hosts' wall clocks disagree: attempt {number} started {seconds:.1f} s before "
                     f"attempt {number - 1}'s last record; the gaps between attempts (restarts) are left out, the "
                     f"figures cover the attempts' own durations")
    if result.skipped:
        what = ", ".join(f"{count} {split}" for split, count in sorted(result.skipped.items()))
        notes.append(f"warning: {sum(result.skipped.values())} record(s) without a time or step left out ({what})")
    return notes
