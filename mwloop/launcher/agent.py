"""The multi-machine elastic agent (`mwloop.launch --rdzv=etcd://HOST:PORT/JOB --num_workers=MIN:MAX`).

One agent per machine runs that machine's K workers (`--workers_per_host`); MIN:MAX bound the whole job. The
agents meet in etcd (mwloop.launcher.rendezvous): each is a key on its own lease, so a dead or cut-off machine
leaves by itself, and every decision that two agents could race on is one etcd transaction (`propose_round`:
one winner). The leader (mwloop.launcher.leader: the first agent in etcd's join order) proposes each next round.

A job is a sequence of rounds, like the local elastic job's (mwloop.launcher.elastic): a round is a fixed set of
member agents; its workers are started on fresh ports with a worker-only TF_CONFIG (index = member order x K,
index 0 the chief) and resume from the newest checkpoint.

Every agent follows the newest round: it stops its workers (SIGTERM: a coordinated save if the round is whole),
and if it is a member publishes its workers' addresses, gathers every member's, starts its workers and posts
`started`. Outcomes are posted as round events: `done` (the job ends when every member is done), `user_error`
(every agent exits 2 with its one line), `failure`, `saved`, `leaving`, `give_up` (every agent exits with it).
Below MIN every agent waits, naming who is present and missing, and exits 1 after --wait_for_min_s. A lost
lease stops this agent's workers at once and rejoins: it never goes on in a round it was dropped from.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import time

from absl import logging

from mwloop import errors
from mwloop.launcher import generation
from mwloop.launcher.attempt import Terminated, pause
from mwloop.launcher.elastic import BOUNDS_ENV, WAIT_REPORT_S, Bounds
from mwloop.launcher.host_workers import HostWorkers
from mwloop.launcher.leader import Leader
from mwloop.launcher.membership import MembershipLog, local_checkpoint_step
from mwloop.launcher.ports import HeldPorts
from mwloop.launcher.rendezvous import EtcdRendezvous, JobEnded, RendezvousError, RoundIncomplete, StoreLost
from mwloop.launcher.warm import WarmServer

# Each poll is three small etcd reads: a few per second per agent, and a change is seen in < 1 s.
POLL_S = 0.5
# A dead machine leaves the job within this (plus etcd's 0.5 s expiry check).
DEFAULT_TTL_S = 10


def default_host_id() -> str:
    """hostname-pid, as an etcd key segment: unique per agent even with several agents on one machine."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", f"{socket.gethostname()}-{os.getpid()}").lstrip("._-") or "agent"


class Agent:
    """One machine's agent (see the module docstring): `run()` until the job ends; the exit code.

    Attributes:
      workers: this machine's workers in the round (mwloop.launcher.host_workers).
      number: the round this agent follows (its workers are in it, if a member).
      reported: whether this agent posted its workers' outcome in the round.
      ignore_upto: rounds up to this one are from before a lost lease: never joined again.
      rejoining: dropped (a lost lease) and not in the job again yet.
      start_step: the checkpoint step when this agent saw the round start.
      log: the job's membership log, written by the leader only.
    """

    def __init__(self, url: str, command: list[str], env: dict[str, str], bounds: Bounds, *, workers_per_host: int,
                 host_id: str, address: str, workdir: str | None, grace_s: float, wait_for_min_s: float,
                 max_restarts: int, ttl_s: int = DEFAULT_TTL_S, warm: WarmServer | None = None):
        """`warm`: the warm-start server this machine's workers are forked from (mwloop.launcher.warm)."""
        self.bounds, self.per_host, self.host_id, self.address = bounds, workers_per_host, host_id, address
        # BOUNDS_ENV is mwloop.cluster.distribute.ELASTIC_ENV, named apart so that the agent never imports TensorFlow.
        self.workers = HostWorkers(command, dict(env, **{BOUNDS_ENV: f"{bounds.min}:{bounds.max}"}), grace_s, warm)
        self.workdir, self.grace_s, self.wait_for_min_s, self.max_restarts = workdir, grace_s, wait_for_min_s, \
            max_restarts
        # Members stop their old workers (up to grace_s) before they publish: the gather waits for the slowest.
        self.gather_timeout_s = grace_s + 3 * ttl_s + 10
        self.rdzv = EtcdRendezvous(url, ttl_s=ttl_s, on_lost=self._on_lost)
        self.number: int | None = None
        self.members: list[str] = []
        self.reported = False
        self.ignore_upto = -1
        self.rejoining = False
        self.start_step: int | None = None
        # Why the job's state in etcd was found lost or stale, until this agent joined a new generation.
        self.store_lost: str | None = None
        self.log = MembershipLog(workdir)
        self.leader = Leader(self.rdzv, bounds, per_host=workers_per_host, workdir=workdir,
                             max_restarts=max_restarts, log=self.log)
        self.below_since: float | None = None
        self.next_report = 0.0
        # When a newcomer says again that it waits to be admitted.
        self.next_admit = 0.0

    # --- the loop ---

    def run(self) -> int:
        """Joins the job and follows it to its end; 0, 1 (below MIN, or etcd lost), 2 (a user error), 128+N
        (SIGTERM/SIGHUP: this machine left), or the failure's code after --max_restarts."""
        try:
            new = self.rdzv.join(self.host_id, {"address": self.address, "workers": self.per_host},
                                 os.path.abspath(self.workdir) if self.workdir and "://" not in self.workdir
                                 else self.workdir)
            logging.info("%s joined job %s at %s (%d worker(s) here, the job's bounds %s; generation %s%s)",
                         self.host_id, self.rdzv.job, self.rdzv.url, self.per_host, self.bounds,
                         self.rdzv.generation, f": {new}" if new else "")
            failing_since = None
            while True:
                try:
                    outcome = self._step()
                    failing_since = None
                # The job's state in etcd is gone or stale: re-form from the checkpoint, in a new generation.
                except StoreLost as e:
                    self._stop_for_store(str(e))
                    outcome = None
                # etcd unreachable for a while: the lease decides, or we give up.
                except RendezvousError as e:
                    failing_since = failing_since or time.monotonic()
                    if time.monotonic() - failing_since > self.wait_for_min_s:
                        return self._end(1, f"{e}; gave up after --wait_for_min_s={self.wait_for_min_s:g}s",
                                         verdict=False)
                    logging.warning("%s: %s; trying again", self.host_id, e)
                    outcome = None
                if outcome is not None:
                    return outcome
                pause(POLL_S)
        except RendezvousError as e:
            return self._end(1, str(e), verdict=False)
        # A bad host id, or a live job under the name with another workdir: not this agent's job to end.
        except errors.UserError as e:
            return self._end(errors.USER_ERROR, str(e), verdict=False)
        # This machine's notice: save with the others, then leave the job at once.
        except Terminated as e:
            return self._leave(e.signum)
        # Ctrl-C: the same, its workers interrupted (they save and exit 130).
        except KeyboardInterrupt:
            return self._leave(signal.SIGINT)
        finally:
            self.workers.stop()

    def _step(self) -> int | None:
        if self.store_lost:
            return self._start_over()
        # Asked of etcd after a freeze: the keep-alive thread may not have woken yet.
        if self.rdzv.confirm_lease():
            return self._rejoin()
        self.rdzv.check()
        hosts = self.rdzv.hosts()
        latest = self.rdzv.latest_round()
        if self.number is not None and (latest is None or latest[0] < self.number):
            raise StoreLost(f"etcd at {self.rdzv.url} went back in time: round {self.number} of job "
                            f"{self.rdzv.job!r} is gone (newest: {'none' if latest is None else latest[0]})")
        if latest is not None and latest[0] > self.ignore_upto and latest[0] != self.number:
            self._follow(*latest, hosts)
            return None
        events = self.rdzv.events(self.number) if self.number is not None else []
        leader = next(iter(hosts), None) == self.host_id
        ending = self._ending(events, leader)
        if ending is not None:
            return ending
        self._watch_workers()
        if leader:
            self.leader.lead(hosts, events, latest[0] if latest else None, self.number, self.members,
                             self.start_step)
            self.log.poll()
        elif self.number is not None and self.host_id not in self.members and time.monotonic() >= self.next_admit:
            logging.info("%s: waiting to be admitted after round %d (members %s; the leader, %s, admits newcomers at "
                         "the round's next checkpoint)", self.host_id, self.number, ", ".join(self.members),
                         next(iter(hosts), "none"))
            self.next_admit = time.monotonic() + WAIT_REPORT_S
        return self._check_min(hosts)

    def _on_lost(self, reason: str) -> None:
        """From the keep-alive thread: the others go on without us, so our workers must not outlive the round."""
        self.workers.kill_now()

    def _rejoin(self) -> None:
        # Once per loss: while etcd stays out of reach each attempt fails the same way.
        if not self.rejoining:
            logging.warning("%s: dropped from the job (%s): stopped its workers; joining again", self.host_id,
                            self.rdzv.lost_lease)
            self.rejoining = True
        # A round that goes on without us cannot save with us.
        self.workers.stop(signal.SIGKILL)
        # Never the round it was dropped from again; a newer one that lists it was proposed while it was present
        # (its new lease then publishes for it).
        dropped_from, dropped_members, self.number, self.members = self.number, self.members, None, []
        self.ignore_upto = max(self.ignore_upto, -1 if dropped_from is None else dropped_from)
        before = self.rdzv.generation
        try:
            new = self.rdzv.rejoin()
        except JobEnded as e:
            return self._ended_away(e)
        self.rejoining = False
        if self.rdzv.generation != before:
            # Started by another agent that found the store lost it first.
            new = new or generation.lost(self.rdzv.job, self.rdzv.url, before)
            # Its rounds are gone with its generation: none of them is to be followed, ignored or proposed again.
            self._forget_rounds()
            logging.warning("%s: %s: joined the job again in generation %s; it re-forms from the newest "
                            "checkpoint", self.host_id, new, self.rdzv.generation)
            return None
        logging.info("%s: joined the job again", self.host_id)
        # The leader may never have seen our key gone: say the round lost us. Only a round we were a member of: a
        # newer one we followed from outside (woken from a freeze before we knew we were dropped) lost nothing, and
        # its members must still save together when they admit us.
        if dropped_from is not None and self.host_id in dropped_members:
            self.rdzv.post(dropped_from, {"kind": "dropped"})
        return None

    def _stop_for_store(self, why: str) -> None:
        """The job's state in etcd is lost or stale (`why`): stop this machine's workers (SIGTERM: when every agent
        finds out at once, the workers save together; else --grace_s, then SIGKILL); `_start_over` follows."""
        logging.warning("%s: %s: stopping this machine's workers; the job re-forms from the newest checkpoint",
                        self.host_id, why)
        self.store_lost = why
        self.workers.stop()
        self._forget_rounds()

    def _start_over(self) -> int | None:
        """Joins the job again in a new generation (or the one another agent started) after `_stop_for_store`."""
        try:
            new = self.rdzv.rejoin(stale=True)
        except JobEnded as e:
            return self._ended_away(e)
        self.store_lost = None
        logging.info("%s: joined job %s again in generation %s%s", self.host_id, self.rdzv.job, self.rdzv.generation,
                     " (a new one)" if new else " (another agent's)")
        return None

    def _forget_rounds(self) -> None:
        self.number, self.members, self.reported, self.start_step = None, [], False, None
        self.ignore_upto = -1
        self.leader.forget()

    # --- following rounds ---

    def _follow(self, number: int, members: list[str], hosts: dict[str, dict]) -> None:
        """Round `number` is the newest: stop the old workers, and if a member, start this machine's workers."""
        whole = not self.workers.running or self._whole(hosts)
        if not whole:
            # A member's workers are gone, so no save can happen (every worker takes part): waiting --grace_s for
            # workers stuck in a collective with the lost one would only add to the seconds lost.
            logging.warning("round %d lost a member: stopping its workers here at once (no save is possible)",
                            self.number)
        # SIGTERM: the old round is whole, so its workers save at the current step together.
        self.workers.stop(None if whole else signal.SIGKILL)
        self.number, self.members, self.reported = number, members, False
        self.start_step = local_checkpoint_step(self.workdir)
        if self.host_id not in members:
            logging.info("round %d: %s; %s is not a member: waiting to be admitted", number, ", ".join(members),
                         self.host_id)
            self.next_admit = time.monotonic() + WAIT_REPORT_S
            return
        with HeldPorts(self.per_host) as held:
            self.rdzv.publish(number, {"workers": [f"{self.address}:{port}" for port in held.ports]})
            try:
                published = self.rdzv.gather(number, members, self.gather_timeout_s)
            except RoundIncomplete as e:
                # Ourselves dropped meanwhile (a freeze): the next step joins again; we report nothing in this round.
                if self.rdzv.confirm_lease():
                    return
                logging.warning("round %d: %s", number, e)
                # Those who left, if any: the others still missing were only slower, and may be this round's leader.
                self.rdzv.post(number, {"kind": "incomplete", "missing": e.left or e.missing})
                self.reported = True
                return
            # Dropped while it gathered (a freeze): no worker of a round that goes on without us is started.
            if self.rdzv.confirm_lease():
                return
            # Every member's old workers have stopped (and saved): the leader's change resumes from here.
            self.log.settle()
            cluster = [address for host in members for address in published[host]["workers"]]
            first = sum(len(published[host]["workers"]) for host in members[:members.index(self.host_id)])
            logging.info("round %d: %d workers on %s; this machine runs workers %d..%d", number, len(cluster),
                         ", ".join(members), first, first + self.per_host - 1)
            held.release()
            self.workers.start(cluster, first, self.per_host)
            self.rdzv.post(number, {"kind": "started"})

    def _whole(self, hosts: dict[str, dict]) -> bool:
        """Whether every member of the current round still runs its workers (present, nothing failed, not
        dropped): then a SIGTERM makes all of them save at one step. A member that posted `leaving` counts as
        whole even once its key is gone: it left after its workers' save, which the others' workers share."""
        events = self.rdzv.events(self.number)
        leaving = {host for host, event in events if event["kind"] == "leaving"}
        if any(host not in hosts and host not in leaving for host in self.members):
            return False
        return not any(event["kind"] == "failure" or event["kind"] == "dropped" and host in self.members
                       for host, event in events)

    def _watch_workers(self) -> None:
        """Posts this machine's outcome in the round once: done, or the first failure (then stops the rest)."""
        # Dropped meanwhile (its workers woke from a freeze into a round gone on without them): nothing to report.
        if not self.workers.running or self.reported or self.rdzv.confirm_lease():
            return
        event = self.workers.outcome(self.host_id)
        if event is None:
            return
        self.rdzv.post(self.number, event)
        self.reported = True
        if event["kind"] != "done":
            self.workers.stop()

    def _ending(self, events: list[tuple[str, dict]], leader: bool) -> int | None:
        """The job's end, if the round's events say so: every member done, a user error, or a give-up."""
        for _, event in events:
            if event["kind"] == "user_error":
                return self._end(errors.USER_ERROR, event["line"])
            if event["kind"] == "give_up":
                return self._end(event["code"], event["line"])
        done = {host for host, event in events if event["kind"] == "done"}
        if self.members and done >= set(self.members):
            if leader:
                self.log.finish()
            logging.info("all workers of round %d (%s) finished", self.number, ", ".join(self.members))
            return self._end(0, None)
        return None

    # --- waiting, leaving, ending ---

    def _check_min(self, hosts: dict[str, dict]) -> int | None:
        present = sum(info["workers"] for info in hosts.values())
        if present >= self.bounds.min:
            self.below_since = None
            return None
        now = time.monotonic()
        if self.below_since is None:
            self.below_since, self.next_report = now, now
            # Their round cannot go on: a member is gone, and unless it left after a save, no save is possible.
            self.workers.stop(signal.SIGKILL if self.workers.running and not self._whole(hosts) else None)
        missing = [host for host in self.members if host not in hosts]
        who = f"present: {', '.join(hosts) or 'none'}; missing: {', '.join(missing) or 'none'}"
        if now - self.below_since >= self.wait_for_min_s:
            return self._end(1, f"only {present} of at least {self.bounds.min} workers for --wait_for_min_s="
                                f"{self.wait_for_min_s:g}s ({who}); stopped, nothing lost: rerun to resume from the "
                                f"newest checkpoint")
        if now >= self.next_report:
            logging.warning("waiting for workers: %d present, at least %d needed (%s); giving up in %.0fs", present,
                            self.bounds.min, who, self.wait_for_min_s - (now - self.below_since))
            self.next_report = now + WAIT_REPORT_S
        return None

    def _leave(self, signum: int) -> int:
        """SIGTERM/SIGHUP (the machine's notice) or SIGINT to the agent, at any phase of a round or a re-form:
        posted first, so no new round counts on us and the members stop their workers as for a save; then this
        machine's workers save with the others' (when the round is whole: else no save is possible and they stop
        at once), and the lease goes. 128 + `signum` (130 for a Ctrl-C)."""
        whole = True
        try:
            if self.number is not None:
                self.rdzv.post(self.number, {"kind": "leaving"})
            whole = not self.workers.running or self._whole(self.rdzv.hosts())
        except RendezvousError as e:
            logging.warning("%s: could not say it leaves (%s): its lease runs out instead", self.host_id, e)
        logging.warning("%s: %s: %s, then this machine leaves the job", self.host_id, Terminated(signum),
                        "the workers save" if whole else "a member is gone, no save is possible: the workers stop")
        # The leader's change, if one is pending: recorded as never trained, rather than lost.
        self.log.end()
        try:
            self.workers.stop(signal.SIGKILL if not whole else errors.INTERRUPT_SIGNAL if signum == signal.SIGINT
                              else signal.SIGTERM)
        # A second signal while they save: the stop has gone on to its end (or killed them at a Ctrl-C).
        except (Terminated, KeyboardInterrupt) as e:
            logging.warning("%s: %s again while its workers stopped", self.host_id,
                            e if isinstance(e, Terminated) else "SIGINT")
        if killed := self.workers.killed:
            logging.warning("%s: %d worker(s) did not stop within --grace_s=%g and were killed (pid %s): a rerun "
                            "resumes from the last checkpoint saved before", self.host_id, len(killed),
                            self.grace_s, ", ".join(map(str, killed)))
        self._leave_quietly()
        return 128 + signum

    def _leave_quietly(self) -> None:
        try:
            self.rdzv.leave()
        except RendezvousError as e:
            logging.warning("%s: %s (its lease runs out by itself)", self.host_id, e)

    def _ended_away(self, ended: JobEnded) -> int:
        """The job ended while this agent was away (frozen, cut off): its verdict is this agent's too."""
        if not ended.code:
            logging.info("%s", ended)
        return self._end(ended.code, str(ended) if ended.code else None, verdict=False)

    def _end(self, code: int, line: str | None, verdict: bool = True) -> int:
        """Ends this agent with `code` and its last `line`; `verdict`: the job's end too, recorded in etcd."""
        self.workers.stop()
        if verdict:
            try:
                self.rdzv.end(code, line)
            except RendezvousError as e:
                logging.warning("%s: could not record the job's end in etcd (%s)", self.host_id, e)
        # The leader's pending change, if any: the job ends before it trained.
        self.log.end()
        self._leave_quietly()
        if line:
            # After the workers' output: the last line.
            print(f"error: {line}", file=sys.stderr, flush=True)
        return code
