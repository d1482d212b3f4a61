"""The elastic launcher's membership store (mwloop/launcher/rendezvous.py) against a real etcd (issue 29).

Agents that must die for real (SIGKILL) or race for real run as their own processes. Leases are 2 s here, so
"leaves by itself" is seconds. Each test uses its own job name on the shared etcd_server; the one that
pauses etcd (SIGSTOP: a partition, to the agents) starts an etcd of its own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import etcd3gw
import portpicker
import pytest

from mwloop.errors import UserError
from mwloop.launcher.rendezvous import EtcdRendezvous, EtcdUnavailable, LeaseLost, RendezvousError, RoundIncomplete
from tests.helpers import ROOT
from tests.services import etcd

pytestmark = pytest.mark.slow
TTL_S = 2
MARGIN_S = 1.5  # etcd checks for expired leases every 0.5 s; the rest is this machine's two busy cores


@pytest.fixture
def url(etcd_server) -> str:
    return etcd_server.rendezvous_url(f"job-{uuid.uuid4().hex[:8]}")


def agent(url: str, host_id: str, script: str = "time.sleep(600)") -> subprocess.Popen:
    """A process that joins as `host_id`, prints "joined", then runs `script` (with `rdzv` and `time` at hand)."""
    code = textwrap.dedent(f"""
        import json, sys, time
        from mwloop.launcher.rendezvous import EtcdRendezvous
        rdzv = EtcdRendezvous({url!r}, ttl_s={TTL_S})
        rdzv.join({host_id!r}, {{"pid": __import__("os").getpid()}})
        print("joined", flush=True)
    """) + textwrap.dedent(script)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=ROOT))


def wait_for(condition, timeout_s: float) -> float:
    """Seconds until condition() held; fails after timeout_s."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"not within {timeout_s} s"
        time.sleep(0.05)
    return time.monotonic() - start


def test_a_killed_agent_leaves_by_itself_and_a_restarted_one_gets_its_id_back(url):
    process = agent(url, "h1")
    try:
        assert process.stdout.readline() == "joined\n"
        observer = EtcdRendezvous(url, ttl_s=TTL_S)
        time.sleep(TTL_S + 0.5)  # the keep-alive renews: still there after one TTL
        assert list(observer.hosts()) == ["h1"]
        process.send_signal(signal.SIGKILL)
        process.wait()
        gone_after = wait_for(lambda: "h1" not in observer.hosts(), TTL_S + MARGIN_S)
    finally:
        process.kill()
        process.wait()
    assert gone_after <= TTL_S + MARGIN_S
    restarted = EtcdRendezvous(url, ttl_s=TTL_S)
    restarted.join("h1", {"again": True})
    assert observer.hosts() == {"h1": {"again": True}}
    restarted.leave()


def test_leave_removes_at_once_and_hosts_keep_join_order(url):
    agents = {name: EtcdRendezvous(url, ttl_s=TTL_S) for name in ("c", "a", "b")}
    for name, rdzv in agents.items():
        rdzv.join(name, {"address": f"{name}:1234", "slots": 2})
    observer = agents["a"]
    assert list(observer.hosts()) == ["c", "a", "b"]  # join order, not key order
    assert observer.hosts()["b"] == {"address": "b:1234", "slots": 2}
    agents["a"].publish(0, {"worker": "a:5000"})
    agents["a"].leave()
    assert list(observer.hosts()) == ["c", "b"]  # at once: no waiting for the TTL
    with pytest.raises(RoundIncomplete, match="a left the job"):
        agents["c"].gather(0, ["a"], timeout_s=5)  # its address went with its lease
    agents["c"].rejoin()
    assert list(observer.hosts()) == ["b", "c"]  # a rejoined agent joins at the end
    for rdzv in agents.values():
        rdzv.leave()
    assert observer.hosts() == {}


def test_concurrent_proposals_have_exactly_one_winner_and_everyone_reads_its_members(url):
    rounds, racers = 10, 4
    start_at = time.time() + 2.0  # every process past its imports: they all propose each round at one instant
    script = f"""
        results = []
        for number in range(1, {rounds} + 1):
            time.sleep(max(0.0, {start_at} + number * 0.1 - time.time()))
            won = rdzv.propose_round(number, [rdzv.host_id, "extra"])
            results.append([won, rdzv.round(number)])
        print(json.dumps(results), flush=True)
    """
    processes = [agent(url, f"racer{i}", script) for i in range(racers)]
    try:
        outputs = [process.communicate(timeout=30)[0].splitlines() for process in processes]
    finally:
        for process in processes:
            process.kill()
    results = [json.loads(lines[-1]) for lines in outputs]
    observer = EtcdRendezvous(url)
    for number in range(1, rounds + 1):
        members = observer.round(number)
        winners = [f"racer{i}" for i in range(racers) if results[i][number - 1][0]]
        assert len(winners) == 1, (number, winners)
        assert members == [winners[0], "extra"]
        assert all(result[number - 1][1] == members for result in results)
    assert observer.latest_round() == (rounds, observer.round(rounds))
    assert observer.round(rounds + 1) is None
    assert EtcdRendezvous(observer.url.rpartition("/")[0] + "/other-job").latest_round() is None


def test_gather_returns_when_all_published_and_times_out_naming_who_is_missing(url):
    a, b = EtcdRendezvous(url, ttl_s=TTL_S), EtcdRendezvous(url, ttl_s=TTL_S)
    a.join("a", {})
    b.join("b", {})
    assert a.propose_round(7, ["a", "b"])
    a.publish(7, {"worker": "10.0.0.1:5000"})
    late = threading.Timer(0.5, b.publish, (7, {"worker": "10.0.0.2:5000"}))
    late.start()
    started = time.monotonic()
    assert a.gather(7, ["b", "a"], timeout_s=10) == {"b": {"worker": "10.0.0.2:5000"},
                                                     "a": {"worker": "10.0.0.1:5000"}}
    assert 0.4 < time.monotonic() - started < 3
    late.join()
    started = time.monotonic()
    with pytest.raises(RoundIncomplete) as error:
        a.gather(8, ["a", "b"], timeout_s=0.5)
    assert time.monotonic() - started < 2
    assert error.value.missing == ["a", "b"] and error.value.left == []
    message = str(error.value)
    assert "no value from a, b after 0.5 s" in message and "round 8" in message and url in message
    assert "\n" not in message
    a.leave()
    b.leave()


def test_events_are_kept_in_order_and_outlive_the_agent_that_posted_them(url):
    a, b = EtcdRendezvous(url, ttl_s=TTL_S), EtcdRendezvous(url, ttl_s=TTL_S)
    a.join("a", {})
    b.join("b", {})
    a.post(3, {"worker_exit": -9})
    b.post(3, {"leaving": "preemption notice"})
    b.leave()
    a.post(3, {"worker_exit": 0})
    assert a.events(3) == [("a", {"worker_exit": -9}), ("b", {"leaving": "preemption notice"}),
                           ("a", {"worker_exit": 0})]
    assert a.events(4) == []
    a.leave()


def test_a_lease_that_expired_while_etcd_was_paused_is_lost_until_rejoin():
    server = etcd.start()
    try:
        lost = []
        rdzv = EtcdRendezvous(server.rendezvous_url("paused"), ttl_s=TTL_S, request_timeout_s=1,
                              on_lost=lost.append)
        rdzv.join("h1", {"slots": 1})
        rdzv.publish(1, {"worker": "w:1"})
        server.pause()
        try:
            started = time.monotonic()
            with pytest.raises(EtcdUnavailable, match="did not answer within 1 s"):
                rdzv.hosts()
            assert time.monotonic() - started < 2
            wait_for(lambda: rdzv.lost_lease, TTL_S + MARGIN_S)  # this agent cannot tell: it acts as dropped
            time.sleep(max(0.0, TTL_S + 0.5 - (time.monotonic() - started)))  # paused > TTL: etcd expires it
        finally:
            server.resume()
        assert lost == [rdzv.lost_lease] and "no lease renewal reached etcd" in lost[0]
        wait_for(lambda: rdzv.hosts() == {}, MARGIN_S)
        with pytest.raises(LeaseLost, match="h1 is not in job 'paused'"):
            rdzv.publish(2, {"worker": "w:1"})
        rdzv.rejoin()
        assert rdzv.lost_lease is None and rdzv.hosts() == {"h1": {"slots": 1}}
        time.sleep(TTL_S + 0.5)
        assert rdzv.hosts() == {"h1": {"slots": 1}} and rdzv.lost_lease is None and len(lost) == 1
        rdzv.publish(2, {"worker": "w:2"})
        assert rdzv.gather(2, ["h1"], timeout_s=1) == {"h1": {"worker": "w:2"}}
    finally:
        server.stop()


def test_a_lease_etcd_dropped_is_reported_as_lost(url, etcd_server):
    rdzv = EtcdRendezvous(url, ttl_s=TTL_S)
    rdzv.join("h1", {})
    client = etcd3gw.client(host=etcd_server.host, port=etcd_server.port, api_path="/v3/", timeout=5)
    [(_, meta)] = client.get(f"/mwloop/{rdzv.job}/{rdzv.generation}/hosts/h1", metadata=True)
    client.post(client.get_url("/kv/lease/revoke"), json={"ID": int(meta["lease"])})  # an operator, or etcd itself
    with pytest.raises(LeaseLost, match="h1 is not in job"):  # found out by the call or by the keep-alive first
        rdzv.publish(1, {"worker": "w:1"})
    assert "expired this agent's lease" in rdzv.lost_lease
    assert rdzv.hosts() == {}
    rdzv.leave()  # a lost lease leaves quietly
    rdzv.rejoin()
    assert rdzv.hosts() == {"h1": {}} and rdzv.lost_lease is None
    rdzv.leave()


def test_an_agent_woken_from_a_freeze_asks_etcd_for_its_lease_before_its_keep_alive_thread_does(url):
    """SIGSTOP wakes every thread together; the agent's own must not act on a round it was dropped from because the
    keep-alive thread has not run yet: `confirm_lease` renews from the caller once the newest renewal is overdue."""
    lost: list[str] = []
    rdzv = EtcdRendezvous(url, ttl_s=TTL_S, on_lost=lost.append)
    rdzv.join("h1", {})
    rdzv._stop_keep_alive.set()  # the keep-alive thread has not woken (yet)
    time.sleep(TTL_S * 2 / 3 + 0.2)
    assert rdzv.confirm_lease() is None and rdzv.hosts() == {"h1": {}}  # overdue, still etcd's: renewed here
    time.sleep(TTL_S + MARGIN_S)
    reason = rdzv.confirm_lease()
    assert "expired this agent's lease" in reason and lost == [reason] and rdzv.lost_lease == reason
    assert rdzv.hosts() == {}
    rdzv.rejoin()
    assert rdzv.confirm_lease() is None and rdzv.hosts() == {"h1": {}}
    rdzv.leave()


def test_a_second_live_agent_with_the_same_id_is_refused(url):
    first, second = EtcdRendezvous(url, ttl_s=TTL_S), EtcdRendezvous(url, ttl_s=TTL_S)
    first.join("twin", {"n": 1})
    started = time.monotonic()
    with pytest.raises(RendezvousError, match="host id 'twin' is already in job .* another agent uses that id"):
        second.join("twin", {"n": 2})
    assert TTL_S < time.monotonic() - started < TTL_S + 2  # it waited for a crashed one's key to expire
    assert first.hosts() == {"twin": {"n": 1}}
    first.leave()


def test_an_unreachable_etcd_is_one_line_naming_the_url_quickly():
    url = f"etcd://127.0.0.1:{portpicker.pick_unused_port()}/job"
    rdzv = EtcdRendezvous(url)
    started = time.monotonic()
    for call in (lambda: rdzv.join("h1", {}), rdzv.hosts, rdzv.latest_round):
        with pytest.raises(EtcdUnavailable) as error:
            call()
        message = str(error.value)
        assert message.startswith(f"cannot reach etcd at {url} (") and "Connection refused" in message
        assert "check the host and port" in message and "\n" not in message
    assert time.monotonic() - started < 1


@pytest.mark.parametrize("bad", ["etcd://host:2379", "etcd://host:2379/", "http://host:2379/job", "host:2379/job",
                                 "etcd://host:notaport/job", "etcd://host:99999/job", "etcd://:2379/job",
                                 "etcd://host:2379/a/b", "etcd://host:2379/job?x=1", "etcd://user@host/job"])
def test_bad_urls_are_one_line_user_errors_naming_the_form(bad):
    with pytest.raises(UserError) as error:
        EtcdRendezvous(bad)
    assert str(error.value).startswith(f"bad rendezvous URL {bad!r}: expected etcd://HOST:PORT/JOB")


def test_good_urls_parse():
    good = EtcdRendezvous("etcd://10.0.0.5:2400/resnet-1")
    assert (good.host, good.port, good.job) == ("10.0.0.5", 2400, "resnet-1")
    assert EtcdRendezvous("etcd://e/j").port == 2379
    assert EtcdRendezvous("etcd://[::1]:2379/j.x_y").host == "::1"
    with pytest.raises(UserError, match="bad host id 'a/b'"):
        EtcdRendezvous("etcd://e/j").join("a/b", {})


def test_a_store_that_lost_or_rewound_the_job_is_noticed_and_every_agent_meets_in_one_new_generation(url, etcd_server):
    from mwloop.launcher.rendezvous import StoreLost
    a, b = EtcdRendezvous(url, ttl_s=TTL_S), EtcdRendezvous(url, ttl_s=TTL_S)
    assert a.join("a", {}, "/w") == f"a new job {a.job!r}" and b.join("b", {}, "/w") is None
    first = a.generation
    assert b.generation == first and a.hosts() == {"a": {}, "b": {}}
    # Rewound (b found a round it followed gone): b starts a new generation, a finds its own gone.
    assert "went back in time" in b.rejoin(stale=True)
    assert b.generation != first
    with pytest.raises(StoreLost, match=rf"is in generation {b.generation} now, not {first}"):
        a.check()
    assert a.rejoin(stale=True) is None and a.generation == b.generation  # joins b's: never a third
    assert b.hosts() == {"b": {}, "a": {}}
    # The job's keys gone (a wipe, as far as this job can tell): the next agent back starts one more.
    client = etcd3gw.client(host=etcd_server.host, port=etcd_server.port, api_path="/v3/", timeout=5)
    client.delete_prefix(f"/mwloop/{a.job}/")
    with pytest.raises(StoreLost, match=r"lost the state of job .* \(its generation \w+ is gone"):
        b.check()
    assert "lost the state" in b.rejoin(stale=True)
    a.leave()
    b.leave()
