"""The leader of a multi-machine elastic job (mwloop.launcher.agent): when to propose the next round, and with whom.

The *leader* is simply the first agent in etcd's join order; nothing votes or elects, and if two agents believe
they lead at once, etcd still creates each round once (`propose_round`: one winner). It proposes round n+1 when

- no round exists yet and at least MIN workers are present;
- a member of round n left (its lease ran out, or it posted `leaving` after a SIGTERM: its workers saved first;
  or `dropped`: it lost its lease, stopped its workers and joined again),
  a member's worker failed (bounded by --max_restarts, counted in rounds), was preempted, or a member could
  not gather every address for round n (`incomplete`: re-formed without the missing ones);
- an agent is waiting outside round n, round n has room (< MAX) and every member started, and -- when the
  workers' --workdir is local -- round n wrote a checkpoint since it started (grow at a checkpoint boundary).
"""

from __future__ import annotations

import re
import time

from mwloop.artifacts import files
from mwloop.launcher.elastic import Bounds
from mwloop.launcher.membership import MembershipLog, local_checkpoint_step
from mwloop.launcher.rendezvous import EtcdRendezvous, StoreLost

# The first round waits this long for more agents once MIN are present (at once when MAX are): agents that start
# together would otherwise form a round of MIN and grow at the first checkpoint, a re-form for nothing.
FIRST_ROUND_WAIT_S = 3.0


class Leader:
    """The leader's decisions for one agent (used while that agent leads).

    Attributes:
      proposed: the rounds this agent proposed (a round due twice was lost by etcd).
      first_call: when this agent, leading, first saw MIN present before round 0.
    """

    def __init__(self, rdzv: EtcdRendezvous, bounds: Bounds, *, per_host: int, workdir: str | None,
                 max_restarts: int, log: MembershipLog):
        """`log`: the job's membership log, which the leader writes."""
        self.rdzv, self.bounds, self.per_host, self.workdir = rdzv, bounds, per_host, workdir
        self.max_restarts, self.log = max_restarts, log
        self.proposed: set[int] = set()
        self.first_call: float | None = None

    def forget(self) -> None:
        """The job's rounds are gone (a new generation): none of them was proposed here."""
        self.proposed, self.first_call = set(), None

    def lead(self, hosts: dict[str, dict], events: list[tuple[str, dict]], latest: int | None, number: int | None,
             members: list[str], start_step: int | None) -> None:
        """Proposes the next round when round `number` (None: none followed yet; its `members`, the checkpoint step
        `start_step` when it started) cannot or should not go on (see the module docstring).

        Args:
          hosts: the agents present, in join order, with their info.
          events: round `number`'s events.
          latest: the newest round in etcd (None: none yet).
        """
        kinds: dict[str, list[tuple[str, dict]]] = {}
        for host, event in events:
            kinds.setdefault(event["kind"], []).append((host, event))
        leaving = {host for host, _ in kinds.get("leaving", [])}
        # A host that reported in the round is alive and took part: never left out for being slow to publish.
        missing = {host for _, event in kinds.get("incomplete", []) for host in event["missing"]} - {
            host for host, _ in events}
        silent = self._silent(kinds.get("failure", []), events, members, hosts)
        missing |= silent
        # The candidates in join order, up to MAX workers.
        candidates, count = [], 0
        for host, info in hosts.items():
            if host not in leaving and host not in missing and count + info["workers"] <= self.bounds.max:
                candidates.append(host)
                count += info["workers"]
        if count < self.bounds.min:
            return  # below MIN: everyone waits (the agent's _check_min)
        # The first round, or the one after a round this agent was dropped from.
        if number is None:
            self.first_call = self.first_call or time.monotonic()
            if latest is None and count < self.bounds.max and time.monotonic() - self.first_call < FIRST_ROUND_WAIT_S:
                return
            self._propose(0 if latest is None else latest + 1, candidates, 0, count, None)
            return
        before = sum(hosts.get(host, {}).get("workers", self.per_host) for host in members)
        # Lost its lease, joined again: a candidate.
        dropped = {host for host, _ in kinds.get("dropped", [])}
        gone = [host for host in members if host not in hosts or host in leaving or host in dropped]
        if gone:
            how = {host: "given notice: saved at the current step" if host in leaving else
                   "dropped: its lease was lost; joined again" if host in dropped else "its lease ran out: lost"
                   for host in gone}
            why = "; ".join(f"{host} left ({how[host]})" for host in gone)
        elif "failure" in kinds:
            losses = self._losses(number)
            line = kinds["failure"][0][1]["line"]
            if losses > self.max_restarts:
                code = kinds["failure"][0][1]["code"]
                self.rdzv.post(number, {"kind": "give_up", "code": code if code > 0 else 128 - code, "line": (
                    f"{line}; stopped all workers ({losses - 1} of --max_restarts={self.max_restarts} restarts done); "
                    f"rerun to resume from the newest checkpoint")})
                return
            why = f"{line}; restarting ({losses}/{self.max_restarts} of --max_restarts)" + "".join(
                f"; {host} left out: its worker stopped answering and it reported nothing" for host in sorted(silent))
        elif missing:
            why = f"{', '.join(sorted(missing))} did not publish for round {number}"
        elif "saved" in kinds:
            why = kinds["saved"][0][1]["line"]
        else:
            started = {host for host, _ in kinds.get("started", [])}
            new = [host for host in candidates if host not in members]
            checkpoint = local_checkpoint_step(self.workdir)
            if not new or not started >= set(members) or "done" in kinds or (
                    checkpoint is not None and checkpoint <= start_step) or (
                    checkpoint is not None and files.trained_to_the_end(self.workdir)):
                return
            why = f"{', '.join(new)} joined: a coordinated save, then a re-form"
        self._propose(number + 1, candidates, before, count, why)

    def _propose(self, number: int, members: list[str], before: int, after: int, why: str | None) -> None:
        if number in self.proposed:
            # Proposed once: whoever won, the round existed, and this agent follows the newest round before it
            # leads. Due again means etcd lost it.
            raise StoreLost(f"round {number} of job {self.rdzv.job!r}, proposed before, is gone from etcd at "
                            f"{self.rdzv.url}")
        # Woken from a freeze, this leader's view may be older than its lease: dropped, it proposes nothing.
        if self.rdzv.confirm_lease():
            return
        self.proposed.add(number)
        if self.rdzv.propose_round(number, members) and why is not None:
            self.log.announce(before, after, why)

    def _silent(self, failures: list[tuple[str, dict]], events: list[tuple[str, dict]], members: list[str],
                hosts: dict[str, dict]) -> set[str]:
        """Members whose worker another member's worker found not answering (its failure line names it) and which
        reported nothing in the round after they started: most likely a lost machine whose lease has not run out
        yet. Left out of the restarted round at once, rather than waited for in its gather until the lease runs
        out; if alive after all (a frozen worker), it is admitted again at a checkpoint. Never this agent."""
        named = {int(m[1]) for _, event in failures for m in re.finditer(r"\bworker (\d+) stopped answering",
                                                                         event.get("line", ""))}
        reported = {host for host, event in events if event["kind"] != "started"}
        silent, first = set(), 0
        for host in members:
            count = hosts.get(host, {}).get("workers", self.per_host)
            if any(first <= index < first + count for index in named) and host not in reported and (
                    host != self.rdzv.host_id):
                silent.add(host)
            first += count
        return silent

    def _losses(self, number: int) -> int:
        """Rounds so far ended by a failed worker (etcd's record: a new leader counts them the same)."""
        return sum(any(event["kind"] == "failure" for _, event in self.rdzv.events(n)) for n in range(number + 1))
