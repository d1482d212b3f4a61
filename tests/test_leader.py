"""The leader's decisions (mwloop/launcher/leader.py) in-process, against a stand-in for the rendezvous: which
round it proposes, with whom, and why."""

from __future__ import annotations

from mwloop.launcher.elastic import Bounds
from mwloop.launcher.leader import Leader
from mwloop.launcher.membership import MembershipLog


class Rendezvous:
    """What the leader reads and writes of etcd: round events, proposals and its own lease."""

    job, url, host_id = "job", "etcd://127.0.0.1:1/job", "a"

    def __init__(self, events: dict[int, list[tuple[str, dict]]]):
        self.rounds_events, self.proposed = events, []

    def events(self, number: int) -> list[tuple[str, dict]]:
        return self.rounds_events.get(number, [])

    def confirm_lease(self) -> None:
        return None

    def propose_round(self, number: int, members: list[str]) -> bool:
        self.proposed.append((number, members))
        return True

    def post(self, number: int, event: dict) -> None:
        self.rounds_events.setdefault(number, []).append((self.host_id, event))


def _lead(events: list[tuple[str, dict]], hosts: dict[str, dict]) -> tuple[Rendezvous, MembershipLog]:
    rdzv = Rendezvous({0: events})
    log = MembershipLog(None)
    Leader(rdzv, Bounds(2, 3), per_host=1, workdir=None, max_restarts=3, log=log).lead(
        hosts, events, 0, 0, ["a", "b", "c"], None)
    return rdzv, log


HOSTS = {"a": {"workers": 1}, "b": {"workers": 1}, "c": {"workers": 1}}
STARTED = [(host, {"kind": "started"}) for host in "abc"]


def test_a_member_whose_worker_stopped_answering_and_that_reports_nothing_is_left_out_at_once():
    # c's machine is gone, its lease not yet run out: a's and b's workers found worker 2 (on c) not answering.
    failures = [(host, {"kind": "failure", "code": 1, "line": f"{host} worker {i} exited with 1 (worker 2 stopped "
                        "answering (UnavailableError: frozen, killed or cut off): this attempt ends)"})
                for i, host in enumerate("ab")]
    rdzv, log = _lead(STARTED + failures, HOSTS)
    assert rdzv.proposed == [(1, ["a", "b"])]  # not a round whose gather waits for c's lease to run out
    assert log.change.why.endswith("restarting (1/3 of --max_restarts); c left out: its worker stopped answering "
                                   "and it reported nothing")
    assert (log.change.before, log.change.after) == (3, 2)


def test_a_member_that_reported_its_own_failure_is_kept_and_a_plain_failure_restarts_everyone():
    named_but_alive = STARTED + [
        ("a", {"kind": "failure", "code": 1, "line": "a worker 0 exited with 1 (worker 2 stopped answering (x))"}),
        ("c", {"kind": "failure", "code": -9, "line": "c worker 2 exited with -9 (SIGKILL)"})]
    assert _lead(named_but_alive, HOSTS)[0].proposed == [(1, ["a", "b", "c"])]
    plain = STARTED + [("b", {"kind": "failure", "code": 1, "line": "b worker 1 exited with 1"})]
    assert _lead(plain, HOSTS)[0].proposed == [(1, ["a", "b", "c"])]
    # Never itself: the leader's own worker may only be slow to exit.
    itself = STARTED + [("b", {"kind": "failure", "code": 1, "line": "b worker 1 exited with 1 (worker 0 stopped "
                                                                      "answering (x))"})]
    assert _lead(itself, HOSTS)[0].proposed == [(1, ["a", "b", "c"])]
