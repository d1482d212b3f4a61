"""Elastic local jobs (`--num_workers=MIN:MAX`): a lost worker shrinks the job instead of ending it.

A synchronous TensorFlow cluster cannot change size while it runs (MultiWorkerMirroredStrategy is fixed
when its collectives are configured, once per process), so every change of membership is a *re-form*: the
workers of one round stop, and a new round of worker processes starts on fresh ports with a new TF_CONFIG,
resuming from the chief's newest checkpoint. What makes that exact is mwloop's input: the examples of every
step are a pure function of (seed, step) and the global batch stays fixed, so a run that goes on with fewer
workers trains on the same examples at the same steps (each replica takes a larger share), only slower.

One round ends in one of these ways, and the next round follows from it:

- a worker **dies** (a crash, SIGKILL, a lost peer): it is lost; the survivors stop (they cannot save: a save
  is a collective that needs the lost worker) and the job goes on without it, from the newest checkpoint;
- a worker is **given notice** (SIGTERM, a preemption): every worker saves at the current step (TensorFlow's
  PreemptionCheckpointHandler), the one given notice exits errors.LEAVING, the others errors.PREEMPTED, and
  the job goes on without it: no step is lost;
- a lost worker's place **comes back** (`rejoin_s` after the job went on without it, that is after its round
  stopped, which may take up to `grace_s`; on one machine the capacity is the machine's own): the launcher
  asks every worker for a coordinated save at the current step (SIGTERM, at a step boundary, never mid-step)
  and the next round has one worker more;
- fewer than MIN workers are left: the job waits for places to come back, saying every few seconds who is
  present and who is missing, and ends with one line after `wait_for_min_s` (the checkpoint stays).

Every change is one `membership` line on the console and one event in metrics.jsonl: the step the new round
resumes from, the workers before -> after, why, and the seconds from the event to the first step trained
again. Worker 0 of each round is its chief; when the chief is the one lost, the next round's worker 0 resumes
from the same (shared) checkpoint directory.
"""

from __future__ import annotations

import dataclasses
import math
import re
import signal
import sys
import time

import portpicker
from absl import logging

from mwloop import errors
from mwloop.artifacts import files
from mwloop.launcher.attempt import (
    POLL_S,
    Attempt,
    Terminated,
    describe_exit,
    pause,
    wait_for_exit,
    worker_config,
)
from mwloop.launcher.membership import MembershipLog, local_checkpoint_step
from mwloop.launcher.warm import WarmServer

# The environment variable that tells each worker the job's bounds ("MIN:MAX"): its config check then requires a
# global batch that divides among the replicas of every worker count in between (mwloop.config.check).
BOUNDS_ENV = "MWLOOP_ELASTIC_WORKERS"
# How often a job below MIN says who is missing.
WAIT_REPORT_S = 5.0
# Workers SIGKILLed within this many seconds of the first loss are lost with it (two machines, one power cut):
# counted one at a time, the job would re-form with a worker already dead and lose a round to each.
TOGETHER_S = 0.5


@dataclasses.dataclass(frozen=True)
class Bounds:
    """How many workers the job trains with: at least `min`, at most `max` (`min == max`: a fixed count)."""

    min: int
    max: int

    @property
    def elastic(self) -> bool:
        return self.min < self.max

    def __str__(self) -> str:
        return f"{self.min}:{self.max}" if self.elastic else str(self.min)


def parse_bounds(text: str) -> Bounds:
    """'3' -> Bounds(3, 3), '2:4' -> Bounds(2, 4). Raises ValueError with the one-line reason."""
    parts = text.split(":")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (None, None)
    except ValueError:
        low = high = None
    if low is None or high is None or low < 1 or high < low:
        raise errors.UserError(f"--num_workers={text!r} must be N or MIN:MAX with 1 <= MIN <= MAX, e.g. 4 or 2:4")
    return Bounds(low, high)


def workdir_of(args: list[str]) -> str | None:
    """The `--workdir` among a worker's arguments, or None."""
    for i, arg in enumerate(args):
        if arg.startswith("--workdir="):
            return arg.split("=", 1)[1]
        if arg == "--workdir" and i + 1 < len(args):
            return args[i + 1]
    return None


class ElasticJob:
    """Runs one local elastic job to its end (`run`); see the module docstring.

    Attributes:
      present: places with a worker to run (on one machine: all of them, until one is lost).
      returns: time.monotonic() at which each lost place comes back.
      lost_since_stop: places lost in the round being stopped: their rejoin_s has not started yet.
      losses: rounds ended by a worker that died: bounded by max_restarts, like a fixed job's restarts.
    """

    def __init__(self, command: list[str], env: dict[str, str], bounds: Bounds, *, workdir: str | None,
                 grace_s: float, rejoin_s: float, wait_for_min_s: float, max_restarts: int,
                 warm: WarmServer | None = None):
        """`warm`: the warm-start server every round's workers are forked from (mwloop.launcher.warm)."""
        self.command, self.bounds, self.workdir, self.warm = command, bounds, workdir, warm
        self.env = dict(env, **{BOUNDS_ENV: f"{bounds.min}:{bounds.max}"})
        self.grace_s, self.rejoin_s, self.wait_for_min_s = grace_s, rejoin_s, wait_for_min_s
        self.max_restarts = max_restarts
        self.present = bounds.max
        self.returns: list[float] = []
        self.lost_since_stop = 0
        self.losses = 0
        self.log = MembershipLog(workdir)
        self.attempt: Attempt | None = None

    # --- membership ---

    def _lose(self, count: int, why: str) -> None:
        before = min(self.present, self.bounds.max)
        self.present -= count
        self.lost_since_stop += count
        # When the loss was seen (the membership line follows the stop): what a re-form's cost is measured from.
        logging.info("the round of %d lost %d worker(s): stopping it", before, count)
        self.log.announce(before, self.present, why)

    def _start_return_clocks(self) -> None:
        """The job goes on without the places lost in the round just stopped: their `rejoin_s` starts now. From
        the loss instead, a stop that took longer than `rejoin_s` (survivors of a lost peer can need all of
        `grace_s`) would bring the place back before the job ever went on without it."""
        if math.isfinite(self.rejoin_s):
            self.returns += [time.monotonic() + self.rejoin_s] * self.lost_since_stop
        self.lost_since_stop = 0

    def _returned(self) -> int:
        """Places whose `rejoin_s` has passed: they come back now."""
        now = time.monotonic()
        back = [t for t in self.returns if t <= now]
        self.returns = [t for t in self.returns if t > now]
        return len(back)

    # --- rounds ---

    def run(self) -> int:
        """Runs rounds until the job finishes or cannot go on; the exit code (0, or the failure's). A signal to the
        launcher (Terminated, KeyboardInterrupt) at any phase of a round or a re-form is raised once the workers
        stopped (they save when they can), its pending membership change recorded as never trained."""
        try:
            return self._rounds()
        except (Terminated, KeyboardInterrupt):
            self.log.end()
            raise

    def _rounds(self) -> int:
        while True:
            self._start_return_clocks()
            self.present = min(self.bounds.max, self.present + self._returned())
            if self.present < self.bounds.min and not self._wait_for_min():
                self.log.end()
                print(f"error: only {self.present} of at least {self.bounds.min} workers for "
                      f"--wait_for_min_s={self.wait_for_min_s:g}s ({self.bounds.max - self.present} lost); "
                      f"stopped, nothing lost: rerun to resume from {self._resume_point()}", flush=True,
                      file=sys.stderr)
                return 1
            # Places back while it waited below MIN: the line says who trains.
            self.log.forms(self.present)
            self.attempt = Attempt(self.command, self.env, self.grace_s, errors.INTERRUPT_SIGNAL, warm=self.warm)
            with self.attempt:
                outcome = self._round(self.present)
            if outcome is not None:
                # The job ends before the change trained.
                self.log.end()
                code, message = outcome
                # After the attempt closed: the last line a user reads.
                if message:
                    print(f"error: {message}", file=sys.stderr, flush=True)
                return code

    def _wait_for_min(self) -> bool:
        """Waits below MIN until enough places came back; False at `wait_for_min_s`."""
        deadline = time.monotonic() + self.wait_for_min_s
        next_report = 0.0
        while self.present < self.bounds.min:
            now = time.monotonic()
            if now >= deadline:
                return False
            if now >= next_report:
                comes = f"next place back in {min(self.returns) - now:.0f}s" if self.returns else \
                    "no place comes back (--rejoin_s)"
                logging.warning("waiting for workers: %d present, at least %d needed, %d missing; %s; giving up in "
                                "%.0fs", self.present, self.bounds.min, self.bounds.max - self.present, comes,
                                deadline - now)
                next_report = now + WAIT_REPORT_S
            pause(min(POLL_S * 5, max(0.0, deadline - now)))
            self.present += self._returned()
        return True

    def _checkpoint_step(self) -> int | None:
        return local_checkpoint_step(self.workdir)

    def _resume_point(self) -> str:
        return files.resume_point(self.workdir) if self.workdir else "the newest checkpoint"

    def _round(self, n: int) -> tuple[int, str | None] | None:
        """Runs one round of `n` workers; None when the next round follows, else the job's exit code and its
        last line."""
        attempt = self.attempt
        self.log.settle()
        ports = [portpicker.pick_unused_port() for _ in range(n)]
        for i in range(n):
            attempt.start(f"worker {i}", worker_config(ports, i), f"localhost:{ports[i]}")
        procs = list(attempt.procs.values())
        start_step = self._checkpoint_step()
        while True:
            pause(POLL_S)
            self.log.poll()
            failure = attempt.first_failure()
            if failure is None and all(p.poll() == 0 for p in procs):
                self.log.finish()
                logging.info("all %d workers finished", n)
                return 0, None
            if failure is not None:
                return self._after_failure(*failure, n)
            # A place that came back joins at the round's next checkpoint: a round that has not trained yet would
            # only lose its start-up, and the coordinated save then follows a save that was due anyway.
            # Nor does a round that trained to the end: it only evaluates and exports now.
            if n < self.bounds.max and self.returns and min(self.returns) <= time.monotonic() and (
                    start_step is None or self._checkpoint_step() > start_step) and not (
                    self.workdir and files.trained_to_the_end(self.workdir)):
                back = self._returned()
                grow = min(back, self.bounds.max - n)
                self.present = n + grow
                self.log.announce(n, n + grow, f"{grow} place(s) back after --rejoin_s={self.rejoin_s:g}: "
                                            "a coordinated save, then a re-form")
                # SIGTERM: every worker saves at the current step and exits.
                attempt.stop()
                return None

    def _after_failure(self, name: str, code: int, n: int) -> tuple[int, str | None] | None:
        attempt = self.attempt
        if code == errors.USER_ERROR:
            message = attempt.last_errors.get(name, "a user error (see its output above)")
            return code, f"{name}: {message} (stopped all workers, no restart: it would repeat)"
        if code == errors.INTERRUPTED:
            logging.warning("%s was interrupted (exit %d); stopped all workers, no restart", name, code)
            return code, None
        # A notice: everyone saves at one step, then exits.
        if code in (errors.PREEMPTED, errors.LEAVING):
            wait_for_exit(list(attempt.procs.values()), self.grace_s)
            leaving = [name for name, p in attempt.procs.items() if p.returncode == errors.LEAVING]
            # No worker took the notice as its own: the whole job was preempted, restart it all.
            if not leaving:
                self.log.announce(n, n, "preempted: saved; restarting every worker")
                return None
            self._lose(len(leaving), f"{', '.join(leaving)} given notice (SIGTERM): saved at the current step")
            return None
        said = attempt.last_errors.get(name)
        why = why_lost(name, code, said)
        if self.losses == self.max_restarts:
            return code if code > 0 else 128 - code, (
                f"{name} {describe_exit(code)}{' (' + said + ')' if said else ''}; stopped all workers "
                f"({self.losses} of --max_restarts={self.max_restarts} losses survived); rerun to resume from "
                f"{self._resume_point()}")
        self.losses += 1
        peer = _peer_stopped_answering(said)
        also = self._lost_together({name, peer[1] if peer else name})
        if also:
            why += f"; with {', '.join(also)} (SIGKILL)"
        self._lose(1 + len(also), f"{why}; lost ({self.losses}/{self.max_restarts} of --max_restarts)")
        return None

    def _lost_together(self, counted: set[str]) -> list[str]:
        """The workers, other than the loss `counted`, SIGKILLed by the end of `TOGETHER_S` after it was seen.
        Only SIGKILL: a survivor that saw its peer die exits with a code of its own (or TensorFlow aborts it)."""
        deadline = time.monotonic() + TOGETHER_S
        while True:
            killed = [other for other, p in self.attempt.procs.items()
                      if other not in counted and p.poll() == -signal.SIGKILL]
            if time.monotonic() >= deadline:
                return killed
            pause(POLL_S)


def why_lost(name: str, code: int, said: str | None) -> str:
    """Why a round lost a worker, for its membership line: the task that died, or, when the first to exit was a
    survivor that saw a peer stop answering (a frozen or cut-off peer exits last), that peer."""
    peer = _peer_stopped_answering(said)
    if peer:
        return f"{peer[1]} stopped answering ({peer[2]}, seen by {name})"
    return f"{name} {describe_exit(code)}{f' ({said})' if said else ''}"


def _peer_stopped_answering(said: str | None) -> re.Match | None:
    """A survivor's last error naming the peer that stopped answering: groups (the peer, how)."""
    return re.match(r"(\w+ \d+) stopped answering \(([^:)]*)", said or "")
