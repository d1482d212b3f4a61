"""benchmarks/goodput.py's pure parts: the rounds its kills read from the launcher's output, and the elastic
job's command (issue 45's goodput under kills)."""

from __future__ import annotations

from benchmarks import goodput as bench
from mwloop.config import check
from mwloop.config.base import load_config

# A fixed job's attempt and an elastic job's rounds print the same lines: worker 0 opens each.
OUTPUT = """\
I1207 started worker 0 (pid 101) on localhost:1, forked warm
I1207 started worker 1 (pid 102) on localhost:2, forked warm
I1207 started worker 2 (pid 103) on localhost:3, forked warm
[worker 0] I1207 step 50/3000 loss 2.1
I1207 waiting up to 30s for 2 task(s) to exit after SIGTERM
W1207 membership: workers 3 -> 2 from step 200 (worker 1 killed by SIGKILL)
I1207 started worker 0 (pid 201) on localhost:4, forked warm
I1207 started worker 1 (pid 202) on localhost:5, forked warm
"""


def test_rounds_name_each_rounds_workers_and_whether_it_trains_or_stops():
    rounds = bench._rounds(OUTPUT)
    assert [pids for _, pids in rounds] == [{"0": 101, "1": 102, "2": 103}, {"0": 201, "1": 202}]
    first, second = rounds[0][0], rounds[1][0]
    assert bench.TRAINING.search(OUTPUT, first) and bench.STOPPING.search(OUTPUT, first)
    # The new round has not trained yet, and nothing stops it: no kill lands in it before its first train log.
    assert not bench.TRAINING.search(OUTPUT, second) and not bench.STOPPING.search(OUTPUT, second)
    # A worker started before any worker 0 belongs to no round.
    assert bench._rounds("I1207 started worker 1 (pid 9)\n") == []


def test_the_elastic_job_is_2_to_3_warm_async_and_its_batches_divide_among_2_and_3():
    command = bench._command("/tmp/w", 3000, 5, "elastic")
    assert "--num_workers=2:3" in command and "--rejoin_s=10" in command and "--max_restarts=5" in command
    assert "--nowarm_starts" not in command and "--config.train.async_checkpoint=True" in command
    assert all(f"--config.{k}={v}" in command for k, v in bench.overrides(3000, "elastic").items())
    config = load_config("configs/resnet.py:digits", bench.overrides(3000, "elastic"))
    check.check_worker_counts(config, replicas_per_worker=1, counts=range(2, 4))
    # The fixed jobs keep their command: 2 workers, the config's own batches.
    fixed = bench._command("/tmp/w", 3000, 5, "improved")
    assert "--num_workers=2" in fixed and not any("global_batch_size" in a for a in fixed)
