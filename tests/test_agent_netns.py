"""The multi-machine elastic agent (mwloop/launcher/agent.py) training a real TensorFlow job across three
"machines" in network namespaces, against a real etcd (split from tests/test_agent.py).
"""

from __future__ import annotations

import re
import sys

import pytest

from tests.test_agent import TTL_S

# --- real TensorFlow jobs ---

# tests/test_elastic.py's settings (a checkpoint every 500 steps): the change at step 700 falls between two.
REAL = {"train.steps": 1500, "train.global_batch_size": 48, "eval.global_batch_size": 96,
        "train.checkpoint_every_steps": 500, "deterministic": True}


# --- three "machines" in network namespaces: one machine's link cut for good, then mended ---

APART = dict(REAL, **{"train.steps": 3000})


@pytest.mark.slow
def test_agents_in_network_namespaces_re_form_when_a_link_is_cut_and_readmit_it_when_mended(tmp_path):
    """Each agent on a machine of its own (a network namespace on a private bridge, etcd on the bridge's
    address): one machine's link is set down between checkpoints -- its lease runs out, the other two re-form
    with 2 and train on; the link is set up again -- that machine's agent, which stopped its workers when it lost
    its lease, joins again and is admitted at the next checkpoint; the job ends with 3 and the weights of an
    uninterrupted run."""
    from mwloop.artifacts import files
    from tests.services import bridge as bridge_lib
    from tests.services import etcd as etcd_lib
    from tests.test_elastic import _assert_same_result
    from tests.test_multiworker import Watched, env_for_workers
    from tests.test_multiworker import flags as mw_flags

    lab = bridge_lib.Bridge(3)
    server = None
    jobs: dict[int, Watched] = {}
    try:
        server = etcd_lib.start(host=lab.host)
        workdir = tmp_path / "run"
        env = env_for_workers(tmp_path)
        for i in range(3):
            jobs[i] = Watched([*lab.prefix(i), sys.executable, "-m", "mwloop.launch",
                               f"--rdzv={server.rendezvous_url('apart')}", "--num_workers=2:3", f"--host_id=m{i}",
                               f"--address={lab.address(i)}", f"--rdzv_ttl_s={TTL_S}", "--grace_s=10",
                               "--wait_for_min_s=120", "--", *mw_flags(workdir, **APART)], env)
        # The first listed is the leader (etcd's join order), the last one's link is cut.
        leader, _, victim = map(int, jobs[0].wait_for(r"round 0: 3 workers on m(\d), m(\d), m(\d)",
                                                      timeout_s=90).groups())
        jobs[leader].wait_for(r"\[worker 0\] .*step 700/3000", timeout_s=240)  # between checkpoints 500, 1000
        lab.cut(victim)
        jobs[leader].wait_for(rf"membership: workers 3 -> 2 from step 500 \(m{victim} left", timeout_s=120)
        jobs[victim].wait_for(rf"m{victim}: dropped from the job \(", timeout_s=120)  # it stopped its workers
        jobs[leader].wait_for(r"membership: training again with 2 workers", timeout_s=120)
        lab.mend(victim)
        jobs[leader].wait_for(r"membership: workers 2 -> 3 from step \d+", timeout_s=180)
        for i in range(3):
            assert jobs[i].wait(timeout_s=300) == 0, jobs[i].output[-5000:]
    finally:
        for job in jobs.values():
            job.stop()
        if server is not None:
            server.stop()
        lab.close()
        for i, job in jobs.items():
            print(f"machine {i}:", "".join(line for line in job.lines
                                          if re.search(r"membership|round \d|lease|exits", line)))
    events = [e for e in files.read_metrics(str(workdir)) if e["split"] == "membership"]
    assert [(e["workers_before"], e["workers_after"]) for e in events] == [(3, 2), (2, 3)], events
    assert events[0]["step"] == 500 and events[1]["steps_redone"] == 0
    print("membership events", events, "max relative weight difference",
          _assert_same_result(tmp_path, workdir, APART))
