"""The elastic agents' membership layer under its own faults (issue 45), with a real etcd and real agent processes
(stand-in workers, tests/fake_worker.py): the store's state from another job, lost (etcd wiped), and a signal
during a re-form.
"""

from __future__ import annotations

import re
import signal
import time

import pytest

from tests.test_agent import TTL_S, Agents, rounds, wait_for_round

pytestmark = pytest.mark.slow


def wait_for_line(job: Agents, host: str, pattern: str, timeout_s: float = 30) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if found := re.search(pattern, job.output(host)):
            return found
        time.sleep(0.1)
    raise AssertionError(f"no {pattern!r} from {host} within {timeout_s} s:\n{job.output(host)[-3000:]}")


def test_a_reused_job_name_a_wiped_etcd_and_another_workdir_are_each_told_apart(tmp_path):
    """A job that ended on a user error; its name reused by the fixed rerun (before: the old error again, exit 2);
    an agent of another workdir under the live name (refused); etcd wiped mid-run (before: a silent hang)."""
    from tests.services import etcd
    server = etcd.start()
    url, workdir = server.rendezvous_url("reused"), f"--workdir={tmp_path / 'run'}"
    groups = []

    def job(name: str, *plans: str) -> Agents:
        (tmp_path / name).mkdir()
        groups.append(Agents(url, tmp_path, "2", [str(tmp_path / name), *plans, workdir], wait_for_min_s=60))
        groups[-1].state = tmp_path / name
        return groups[-1]

    try:
        first = job("first", "sleep", "exit2")
        first.start("a")
        first.start("b")
        assert first.wait("a") == first.wait("b") == 2
        old_error = first.last_line("a")
        rerun = job("rerun", "sleep,ok", "sleep,ok")
        rerun.start("a2")
        rerun.start("b2")
        started, _ = wait_for_round(rerun.state, 2)  # the old job's verdict is not the new one's
        assert "is a new job" in rerun.output("a2") + rerun.output("b2")
        other = Agents(url, tmp_path, "2", [str(tmp_path / "rerun"), "ok", "ok", f"--workdir={tmp_path}/x"])
        groups.append(other)
        other.start("c")
        assert other.wait("c") == 2
        assert re.fullmatch(rf"error: job 'reused' at {re.escape(url)} is running with --workdir=\S+/run \(agents: "
                            rf"\w+, \w+\); this agent's is \S+/x: give this job a name of its own in --rdzv, or the "
                            r"same --workdir", other.last_line("c")), other.output("c")[-2000:]
        server.wipe()
        wait_for_round(rerun.state, 2, after=started + 1, timeout_s=TTL_S + 30)
        for host in ("a2", "b2"):
            assert re.search(r"lost the state of job 'reused' \(its generation \w+ is gone: etcd was wiped",
                             rerun.output(host)), rerun.output(host)[-3000:]
            assert rerun.wait(host) == 0, rerun.output(host)[-3000:]
        assert old_error not in rerun.output("a2") + rerun.output("b2")
        assert len(rounds(rerun.state)) == 2
    finally:
        for group in groups:
            group.close()
        server.stop()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_a_local_re_forms_coordinated_save_ends_the_launcher(tmp_path, signum):
    """Local elastic: worker 1 dies, its place comes back, the grow's coordinated save (SIGTERM to the workers)
    hangs; a signal to the launcher then ends it (before: swallowed, the next round started and trained on)."""
    import subprocess
    import sys

    from tests.helpers import ROOT
    command = [sys.executable, "-m", "mwloop.launch", "--num_workers=1:2", "--network=host", "--rejoin_s=1",
               "--grace_s=4", "--module=tests.fake_worker", "--", str(tmp_path), "hang", "kill9,hang"]
    with open(tmp_path / "out.log", "w") as out:
        launcher = subprocess.Popen(command, cwd=ROOT, env=dict(__import__("os").environ, PYTHONPATH=ROOT),
                                    stdout=out, stderr=subprocess.STDOUT)
    try:
        job = Agents("", tmp_path, "", [])
        job.procs["out"] = launcher
        # Round 1 (worker 0 alone) is stopped for the grow: its coordinated save.
        wait_for_line(job, "out", r"hello from 0 attempt 1: hang(?s:.*)waiting up to 4s for 1 task\(s\) to exit after "
                                  r"SIGTERM")
        launcher.send_signal(signum)
        assert job.wait("out", timeout_s=30) == (143 if signum == signal.SIGTERM else 130)
        output = job.output("out")
        assert "still running 4s after SIGTERM; sending SIGKILL" in output or "Ctrl-C while it was stopping" in output
        if signum == signal.SIGTERM:
            assert "SIGTERM while stopping the tasks: they go on saving" in output, output[-3000:]
            assert re.search(r"SIGTERM: 1 process\(es\) did not stop within --grace_s=4 and were killed", output)
        assert [len(group) for group in rounds(tmp_path)] == [2, 1]  # no round after the signal
    finally:
        launcher.kill()
        launcher.wait()


@pytest.mark.parametrize("victim,signum", [("other", signal.SIGTERM), ("leader", signal.SIGKILL)])
def test_a_signal_or_death_of_an_agent_during_a_re_forms_coordinated_save(tmp_path, victim, signum):
    """Agents a, b train; c comes: the leader re-forms (every agent SIGTERMs its workers for a coordinated save,
    which hangs here). SIGTERM to the non-leader ends it with 143 once its workers stopped (before: swallowed, it
    went on into the next round); a SIGKILLed leader is a lost member. Either way the two left form a round."""
    from tests.services import etcd
    server = etcd.start()
    job = Agents(server.rendezvous_url("signal"), tmp_path, "2:3", [str(tmp_path), "hang", "hang", "hang"],
                 grace_s=4, wait_for_min_s=60)
    try:
        job.start("a")
        job.start("b")
        first, _ = wait_for_round(tmp_path, 2)
        members = re.search(r"round 0: 2 workers on (\w+), (\w+)", job.output("a")).groups()
        hosts = dict(zip(("leader", "other"), members))
        job.start("c")
        wait_for_line(job, hosts[victim], r"waiting up to 4s for 1 task\(s\) to exit after SIGTERM")
        job.procs[hosts[victim]].send_signal(signum)
        assert job.wait(hosts[victim], timeout_s=30) == (143 if signum == signal.SIGTERM else -signal.SIGKILL)
        if signum == signal.SIGTERM:
            assert re.search(rf"SIGTERM while stopping the tasks(?s:.*){hosts[victim]}: SIGTERM: the workers save, "
                             rf"then this machine leaves the job(?s:.*){hosts[victim]}: 1 worker\(s\) did not stop "
                             r"within --grace_s=4 and were killed", job.output(hosts[victim]))
            assert "round 1: 3 workers" not in job.output(hosts[victim])
        wait_for_round(tmp_path, 2, after=first + 1, timeout_s=60)
        survivor = "c" if victim == "leader" else hosts["leader"]
        assert hosts[victim] not in re.findall(r"round \d+: 2 workers on (.*);", job.output(survivor))[-1]
    finally:
        job.close()
        server.stop()
