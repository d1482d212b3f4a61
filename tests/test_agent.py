"""The multi-machine elastic agent (mwloop/launcher/agent.py, issue 29 item 5) against a real etcd.

Every agent is a real `python -m mwloop.launch --rdzv=...` process ("machines" that share this one); the
protocol cases run stand-in workers (tests/fake_worker.py, milliseconds each), so a round forms in about a
second and a dead agent leaves within its 2 s lease. The deployment forms in docs/ (Kubernetes, Slurm):
tests/test_agent_deploy.py; a real TensorFlow job across network namespaces: tests/test_agent_netns.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests import warm_main
from tests.helpers import ROOT

TTL_S = 2
MARGIN_S = 15  # etcd's expiry check (0.5 s), the agents' polls (0.5 s), and two cores that other jobs load heavily


@pytest.fixture
def url(etcd_server) -> str:
    return etcd_server.rendezvous_url(f"job-{uuid.uuid4().hex[:8]}")


class Agents:
    """The agents of one test, by host id; their output in files; all killed at the end."""

    def __init__(self, url: str, directory, bounds: str, worker_args: list[str], **flags):
        self.url, self.directory, self.bounds, self.worker_args = url, directory, bounds, worker_args
        self.flags = {"grace_s": 5, "wait_for_min_s": 30, "rdzv_ttl_s": TTL_S, "module": "tests.fake_worker",
                      **flags}
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, host: str, own_group: bool = False, **flags) -> subprocess.Popen:
        """`own_group`: the agent leads a process group of its own (with its workers), to be frozen whole."""
        options = {**self.flags, **flags}
        command = [sys.executable, "-m", "mwloop.launch", f"--rdzv={self.url}", f"--num_workers={self.bounds}",
                   f"--host_id={host}", *(f"--{k}={v}" for k, v in options.items()), "--", *self.worker_args]
        with open(self.directory / f"{host}.log", "w") as out:
            # A frozen host (own_group: SIGSTOP to its group) freezes its workers: they must be in its group.
            env = dict(os.environ, PYTHONPATH=ROOT)
            self.procs[host] = subprocess.Popen(command, env=env if own_group else warm_main.serving(env), cwd=ROOT,
                                                stdout=out, stderr=subprocess.STDOUT, start_new_session=own_group)
        return self.procs[host]

    def output(self, host: str) -> str:
        return (self.directory / f"{host}.log").read_text()

    def last_line(self, host: str) -> str:
        return self.output(host).strip().splitlines()[-1]

    def wait(self, host: str, timeout_s: float = 60) -> int:
        try:
            return self.procs[host].wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{host} still runs after {timeout_s} s:\n{self.output(host)[-3000:]}") from None

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait()


@pytest.fixture
def agents(url, tmp_path):
    made = []

    def make(bounds: str, *plans: str, **flags) -> Agents:
        state = tmp_path / f"state{len(made)}"
        state.mkdir()
        made.append(Agents(url, tmp_path, bounds, [str(state), *plans], **flags))
        made[-1].state = state
        return made[-1]

    yield make
    for group in made:
        group.close()


def rounds(state) -> list[list[dict]]:
    """The worker starts, grouped by cluster (one group per round that started), in start order."""
    records = []
    for name in os.listdir(state):
        if name.endswith(".json"):
            path = os.path.join(state, name)
            records.append((os.path.getmtime(path), json.load(open(path))))
    groups: dict[tuple, list[dict]] = {}
    for _, record in sorted(records, key=lambda r: r[0]):
        groups.setdefault(tuple(record["tf_config"]["cluster"]["worker"]), []).append(record)
    return list(groups.values())


def complete(group: list[dict]) -> bool:
    """Every worker of the round started, each with its own index of the same cluster list."""
    cluster = group[0]["tf_config"]["cluster"]["worker"]
    indexes = sorted(r["tf_config"]["task"]["index"] for r in group)
    return indexes == list(range(len(cluster))) and all(r["tf_config"]["task"]["type"] == "worker" for r in group)


def wait_for_round(state, workers: int, after: int = 0, timeout_s: float = 30) -> tuple[int, float]:
    """(position, seconds) of the first complete round of `workers` workers at or after position `after`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        for i, group in enumerate(rounds(state)[after:], after):
            if len(group[0]["tf_config"]["cluster"]["worker"]) == workers and complete(group):
                return i, time.monotonic() - start
        time.sleep(0.1)
    raise AssertionError(f"no complete round of {workers} workers within {timeout_s} s: "
                         f"{[len(g) for g in rounds(state)]}")


@pytest.mark.slow
def test_agents_form_a_round_shrink_when_one_dies_and_admit_a_newcomer(agents):
    job = agents("2:3", "sleep", "sleep", "sleep")
    for host in ("a", "b", "c"):
        job.start(host)
    first, _ = wait_for_round(job.state, 3)
    ports = {address for group in rounds(job.state) for address in group[0]["tf_config"]["cluster"]["worker"]}
    assert len(ports) == sum(len(g[0]["tf_config"]["cluster"]["worker"]) for g in rounds(job.state))  # fresh ports
    members = re.search(r"round \d+: 3 workers on (\w+), (\w+), (\w+)", job.output("a")).groups()
    leader, victim = members[0], members[2]  # the leader: the first in join order
    job.procs[victim].kill()  # a machine lost: the agent and (tied to it) its workers
    shrunk, seconds = wait_for_round(job.state, 2, after=first + 1, timeout_s=TTL_S + MARGIN_S)
    print(f"re-formed with 2 workers {seconds:.1f} s after the SIGKILL")
    assert re.search(rf"membership: workers 3 -> 2 from step 0 \({victim} left \(its lease ran out: lost\)\)",
                     job.output(leader)), job.output(leader)[-3000:]
    # A member is gone, so no save can happen: the survivors' workers are stopped at once, not after --grace_s.
    assert re.search(r"round \d+ lost a member: stopping its workers here at once(?s:.*)exited with -9",
                     job.output(leader))
    job.start("d")
    grown, _ = wait_for_round(job.state, 3, after=shrunk + 1)
    assert "d joined: a coordinated save, then a re-form" in job.output(leader)
    every = [a for g in rounds(job.state) for a in g[0]["tf_config"]["cluster"]["worker"]]
    assert len(every) == len(set(every))  # every round on ports of its own
    for host in job.procs:
        if host != victim:
            job.procs[host].send_signal(signal.SIGTERM)  # the machines' notices: each saves, then leaves
    assert all(job.wait(host) == 128 + signal.SIGTERM for host in job.procs if host != victim)


@pytest.mark.slow
def test_several_workers_per_host_and_the_job_ends_when_every_member_is_done(agents):
    job = agents("4", "ok", "ok", "ok", "ok", workers_per_host=2)
    job.start("a")
    job.start("b")
    assert job.wait("a") == 0 and job.wait("b") == 0, job.output("a")[-3000:] + job.output("b")[-3000:]
    (group,) = rounds(job.state)
    assert complete(group) and len(group) == 4
    cluster = group[0]["tf_config"]["cluster"]["worker"]
    members = re.search(r"round 0: 4 workers on (\w+), (\w+)", job.output("a")).groups()
    assert "this machine runs workers 0..1" in job.output(members[0])
    assert "this machine runs workers 2..3" in job.output(members[1])
    assert all(address.startswith("127.0.0.1:") for address in cluster)


@pytest.mark.slow
def test_a_user_error_stops_every_agent_with_its_one_line(agents):
    job = agents("3", "sleep", "exit2", "sleep")
    for host in ("a", "b", "c"):
        job.start(host)
    codes = {host: job.wait(host) for host in ("a", "b", "c")}
    assert codes == {"a": 2, "b": 2, "c": 2}, codes
    lines = {job.last_line(host) for host in ("a", "b", "c")}
    assert len(lines) == 1, lines
    assert re.fullmatch(r"error: \w+ worker 1: a user error \(see its output above\) \(stopped all workers, no "
                        r"restart: it would repeat\)", lines.pop())


@pytest.mark.slow
def test_repeated_failures_end_the_job_after_max_restarts(agents):
    job = agents("2", "sleep", "kill9", max_restarts=1)
    job.start("a")
    job.start("b")
    assert job.wait("a") == job.wait("b") == 128 + signal.SIGKILL
    assert len(rounds(job.state)) == 2  # one restart, then the give-up
    assert re.fullmatch(r"error: \w+ worker 1 exited with -9 \(SIGKILL\); stopped all workers \(1 of "
                        r"--max_restarts=1 restarts done\); rerun to resume from the newest checkpoint",
                        job.last_line("a")), job.output("a")[-3000:]


@pytest.mark.slow
def test_below_min_every_agent_waits_naming_who_is_missing_then_one_line(agents):
    job = agents("2:3", "sleep", "sleep", wait_for_min_s=3)
    job.start("a")
    job.start("b")
    wait_for_round(job.state, 2)
    job.procs["b"].kill()
    assert job.wait("a", timeout_s=TTL_S + MARGIN_S + 3) == 1
    assert re.search(r"waiting for workers: 1 present, at least 2 needed \(present: a; missing: b\); giving up in "
                     r"\d+s", job.output("a")), job.output("a")[-3000:]
    assert job.last_line("a") == ("error: only 1 of at least 2 workers for --wait_for_min_s=3s (present: a; missing: "
                                  "b); stopped, nothing lost: rerun to resume from the newest checkpoint")


@pytest.mark.slow
def test_an_agent_given_notice_saves_and_leaves_and_the_others_go_on(agents):
    job = agents("2:3", "sleep", "sleep", "sleep")
    for host in ("a", "b", "c"):
        job.start(host)
    first, _ = wait_for_round(job.state, 3)
    members = re.search(r"round \d+: 3 workers on (\w+), (\w+), (\w+)", job.output("a")).groups()
    job.procs[members[1]].send_signal(signal.SIGTERM)  # a machine's preemption notice: its agent saves and leaves
    assert job.wait(members[1]) == 128 + signal.SIGTERM
    wait_for_round(job.state, 2, after=first + 1, timeout_s=MARGIN_S)  # at once: no lease to wait for
    assert f"membership: workers 3 -> 2 from step 0 ({members[1]} left (given notice: saved at the current step))" \
        in job.output(members[0])
    for host in (members[0], members[2]):  # the round was whole: SIGTERM, for the save they share
        assert "exited with -15 (SIGTERM)" in job.output(host) and "no save is possible" not in job.output(host)


@pytest.mark.slow
def test_an_agent_frozen_past_its_lease_with_its_workers_is_admitted_again_and_the_job_ends_as_one(agents):
    """SIGSTOP of a machine's agent and its workers (its process group) past the lease, then SIGCONT: it stops the
    workers of the round it was dropped from, joins again and is admitted with a coordinated save (before: woken
    ahead of its keep-alive thread, it followed the newer round from outside and posted `dropped` there, so the
    members killed their workers instead of saving), and every agent ends the job with the same code."""
    # Worker i's plan per start: round 0 (3 workers), the shrink (2), the grow (3) ends the job.
    job = agents("2:3", "sleep,sleep,ok", "sleep,sleep,ok", "sleep,ok")
    for host in ("a", "b", "c"):
        job.start(host, own_group=True)
    first, _ = wait_for_round(job.state, 3)
    members = re.search(r"round \d+: 3 workers on (\w+), (\w+), (\w+)", job.output("a")).groups()
    cut = members[2]
    os.killpg(job.procs[cut].pid, signal.SIGSTOP)  # frozen: no lease renewal reaches etcd (a partition, to the job)
    shrunk, _ = wait_for_round(job.state, 2, after=first + 1, timeout_s=TTL_S + MARGIN_S)
    os.killpg(job.procs[cut].pid, signal.SIGCONT)
    wait_for_round(job.state, 3, after=shrunk + 1, timeout_s=TTL_S + MARGIN_S)
    assert re.search(rf"{cut}: dropped from the job \(.*\): stopped its workers; joining again", job.output(cut))
    assert f"{cut} joined: a coordinated save, then a re-form" in job.output(members[0])
    old = [r["pid"] for r in rounds(job.state)[first] if r["tf_config"]["task"]["index"] == 2]
    assert all(not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
               for pid in old)  # the cut-off agent's workers of the round it was dropped from are gone
    assert [job.wait(host) for host in members] == [0, 0, 0], {host: job.last_line(host) for host in members}
    for host in members[:2]:
        # Killed once, at the shrink; the grow's stop was a SIGTERM (a save), not a kill.
        assert len(re.findall(r"round \d+ lost a member: stopping its workers here at once", job.output(host))) == 1, \
            job.output(host)[-3000:]
        assert "exited with -15 (SIGTERM)" in job.output(host)


@pytest.mark.slow
def test_a_newcomer_waits_for_the_rounds_next_checkpoint_when_the_workdir_is_local(agents, tmp_path):
    workdir = tmp_path / "run"
    (workdir / "checkpoints").mkdir(parents=True)
    (workdir / "checkpoints" / "ckpt-100.index").write_text("")  # the round starts from step 100
    # The fake workers ignore the --workdir after their plans (an index no worker has); the agents look in it.
    job = agents("2:3", "sleep", "sleep", "sleep", f"--workdir={workdir}")
    job.start("a")
    job.start("b")
    first, _ = wait_for_round(job.state, 2)
    job.start("c")
    time.sleep(4)  # c is present (joined in well under a second), but no checkpoint came since the round started
    assert len(rounds(job.state)) == first + 1 and "c joined" not in job.output("a") + job.output("b")
    assert "c is not a member: waiting to be admitted" in job.output("c")
    (workdir / "checkpoints" / "ckpt-200.index").write_text("")  # the round's next checkpoint
    wait_for_round(job.state, 3, after=first + 1, timeout_s=MARGIN_S)
    leader = re.search(r"round 0: 2 workers on (\w+)", job.output("a"))[1]
    assert "membership: workers 2 -> 3 from step 200 (c joined: a coordinated save, then a re-form)" \
        in job.output(leader)


@pytest.mark.slow
def test_when_etcd_is_cut_off_past_the_leases_every_agent_stops_its_workers_and_a_new_round_forms(tmp_path):
    from tests.services import etcd
    server = etcd.start()
    job = Agents(server.rendezvous_url("cut"), tmp_path, "2:3", [str(tmp_path), "sleep", "sleep", "sleep"],
                 wait_for_min_s=60)
    try:
        for host in ("a", "b", "c"):
            job.start(host)
        first, _ = wait_for_round(tmp_path, 3)
        old = [r["pid"] for r in rounds(tmp_path)[first]]
        server.pause()  # to every agent, etcd is gone: no renewal reaches it, so each must act as dropped
        time.sleep(TTL_S + 2)
        server.resume()
        wait_for_round(tmp_path, 3, after=first + 1, timeout_s=TTL_S + 2 * MARGIN_S)
        for host in ("a", "b", "c"):
            assert re.search(rf"{host}: dropped from the job \(", job.output(host)), job.output(host)[-3000:]
        assert all(not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
                   for pid in old)  # no worker of the round before the cut goes on
    finally:
        job.close()
        server.stop()
