"""Elastic local jobs (`mwloop.launch --num_workers=MIN:MAX`): shrink, grow, notice, below MIN.

The launcher's decisions are pinned down with stand-in workers (tests/fake_worker.py, milliseconds each); one
real TensorFlow job then goes through every kind of change and must end with the weights of an uninterrupted
run, metrics.jsonl continuous and one `membership` event per change.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import ml_collections
import numpy as np
import pytest

from mwloop.artifacts import files
from mwloop.config import check
from mwloop.launcher import elastic
from tests.helpers import ROOT
from tests.test_multiworker import Watched, checkpoint_weights, env_for_workers, stop_leftover_processes, train_here
from tests.test_multiworker import flags as mw_flags

ENV = dict(os.environ, PYTHONPATH=ROOT)
__all__ = ["stop_leftover_processes"]  # the fixture that stops a real job's launcher after each test


def test_bounds_parse_and_reject():
    assert elastic.parse_bounds("3") == elastic.Bounds(3, 3) and not elastic.parse_bounds("3").elastic
    assert elastic.parse_bounds("2:4") == elastic.Bounds(2, 4) and str(elastic.parse_bounds("2:4")) == "2:4"
    for bad in ("0", "3:2", "a:b", "1:2:3", "", ":3", "-1:2"):
        with pytest.raises(ValueError, match="must be N or MIN:MAX"):
            elastic.parse_bounds(bad)


def _batches(train: int, eval_: int = 96, k: int = 1) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict({"train": {"global_batch_size": train}, "eval": {"global_batch_size": eval_},
                                      "optimizer": {"gradient_accumulation_steps": k}})


def test_a_global_batch_must_divide_among_every_worker_count_of_the_bounds():
    check.check_worker_counts(_batches(48), replicas_per_worker=1, counts=range(2, 5))  # 2, 3, 4 all divide 48
    with pytest.raises(check.ConfigError) as e:
        check.check_worker_counts(_batches(64), replicas_per_worker=1, counts=range(2, 5))
    assert str(e.value) == ("config.train.global_batch_size=64 does not divide among the replicas of 3 worker(s) (1 "
                            "replica(s) each), a count this elastic job (--num_workers=2:4) may train with; set it to "
                            "a multiple of 12, e.g. 60 or 72, or narrow --num_workers")
    with pytest.raises(check.ConfigError, match=r"eval.global_batch_size=100 .* of 3 worker\(s\) \(2 replica"):
        check.check_worker_counts(_batches(48, 100), replicas_per_worker=2, counts=range(1, 4))
    with pytest.raises(check.ConfigError, match=r"x 4 micro-batches.*multiple of 24, e\.g\. 24 or 48"):
        check.check_worker_counts(_batches(36, k=4), replicas_per_worker=1, counts=range(2, 4))


def _launch(state_dir, bounds: str, *plans: str, **flags) -> subprocess.CompletedProcess:
    options = {"max_restarts": 3, "grace_s": 5, "rejoin_s": "inf", "wait_for_min_s": 60, **flags}
    command = [sys.executable, "-m", "mwloop.launch", f"--num_workers={bounds}", "--network=host",
               "--module=tests.fake_worker", *(f"--{k}={v}" for k, v in options.items()), "--", str(state_dir),
               *plans]
    return subprocess.run(command, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=90)


def _rounds(state_dir) -> list[int]:
    """The worker count of each start, in start order (one entry per worker start)."""
    records = [json.load(open(os.path.join(state_dir, name))) for name in sorted(
        os.listdir(state_dir), key=lambda name: os.path.getmtime(os.path.join(state_dir, name)))
        if name.endswith(".json")]
    return [len(r["tf_config"]["cluster"]["worker"]) for r in records]


@pytest.mark.slow
def test_a_lost_worker_shrinks_the_job_and_its_place_comes_back_at_a_coordinated_save(tmp_path):
    # Round 0: worker 2 dies -> round 1 with 2 workers (sleeping) -> its place back after 2 s: a coordinated
    # save (SIGTERM) -> round 2 with 3 workers, which finish.
    run = _launch(tmp_path, "2:3", "sleep,sleep,ok", "sleep,sleep,ok", "kill9,ok", rejoin_s=2)
    assert run.returncode == 0, run.stderr[-3000:]
    counts = _rounds(tmp_path)
    assert counts == [3, 3, 3, 2, 2, 3, 3, 3], counts
    assert re.search(r"membership: workers 3 -> 2 from step 0 \(worker 2 exited with -9 \(SIGKILL\); lost \(1/3",
                     run.stderr), run.stderr[-3000:]
    assert "membership: workers 2 -> 3 from step 0 (1 place(s) back after --rejoin_s=2: a coordinated save" \
        in run.stderr
    ports = [json.load(open(tmp_path / f"0-{a}.json"))["tf_config"]["cluster"]["worker"] for a in range(3)]
    assert len({tuple(p) for p in ports}) == 3  # every round on fresh ports


@pytest.mark.slow
def test_a_worker_given_notice_leaves_after_the_save_and_the_others_go_on(tmp_path):
    # The one given notice exits errors.LEAVING, the others errors.PREEMPTED (every worker saved).
    run = _launch(tmp_path, "1:3", "exit42,ok", "exit43,ok", "exit42,ok")
    assert run.returncode == 0, run.stderr[-3000:]
    assert _rounds(tmp_path)[3:] == [2, 2]
    assert "membership: workers 3 -> 2 from step 0 (worker 1 given notice (SIGTERM): saved at the current step)" \
        in run.stderr


@pytest.mark.slow
def test_below_min_waits_saying_who_is_missing_then_ends_with_one_line(tmp_path):
    run = _launch(tmp_path, "2:3", "sleep", "kill9", "kill9", wait_for_min_s=3)
    assert run.returncode == 1
    assert re.search(r"waiting for workers: 1 present, at least 2 needed, 2 missing; no place comes back "
                     r"\(--rejoin_s\); giving up in \d+s", run.stderr), run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last == ("error: only 1 of at least 2 workers for --wait_for_min_s=3s (2 lost); stopped, nothing lost: "
                    "rerun to resume from the newest checkpoint"), last


@pytest.mark.slow
def test_workers_killed_together_are_lost_together_in_one_re_form(tmp_path):
    # Counted one at a time, the 2-worker round in between would start with a place already dead.
    run = _launch(tmp_path, "1:3", "sleep,ok", "kill9", "kill9")
    assert run.returncode == 0, run.stderr[-3000:]
    assert _rounds(tmp_path) == [3, 3, 3, 1], _rounds(tmp_path)
    assert re.search(r"membership: workers 3 -> 1 from step 0 \(worker [12] exited with -9 \(SIGKILL\); with "
                     r"worker [12] \(SIGKILL\); lost \(1/3", run.stderr), run.stderr[-3000:]


@pytest.mark.slow
def test_user_errors_and_repeated_losses_end_an_elastic_job_in_one_line(tmp_path):
    (tmp_path / "a").mkdir()
    run = _launch(tmp_path / "a", "1:3", "exit2", "sleep", "sleep")
    assert run.returncode == 2 and _rounds(tmp_path / "a") == [3, 3, 3]
    assert run.stderr.strip().splitlines()[-1].startswith("error: worker 0: a user error")
    (tmp_path / "b").mkdir()
    run = _launch(tmp_path / "b", "1:3", "sleep", "sleep", "kill9", max_restarts=0)
    assert run.returncode == 128 + signal.SIGKILL
    assert run.stderr.strip().splitlines()[-1] == (
        "error: worker 2 exited with -9 (SIGKILL); stopped all workers (0 of --max_restarts=0 losses survived); "
        "rerun to resume from the newest checkpoint")


def test_a_loss_names_the_peer_that_stopped_answering_not_the_survivor_that_saw_it():
    said = ("worker 2 stopped answering (UnavailableError: frozen, killed or cut off): this attempt ends without a "
            "save (saving needs every worker); a restart resumes from ckpt-500")
    assert elastic.why_lost("worker 0", 1, said) == ("worker 2 stopped answering (UnavailableError, seen by "
                                                     "worker 0)")
    assert elastic.why_lost("worker 1", -9, None) == "worker 1 exited with -9 (SIGKILL)"
    assert elastic.why_lost("worker 1", 1, "boom") == "worker 1 exited with 1 (boom)"


@pytest.mark.slow
def test_parameter_servers_refuse_elastic_bounds(tmp_path):
    run = subprocess.run([sys.executable, "-m", "mwloop.launch", "--num_workers=1:2", "--num_ps=1", "--", "x"],
                         env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "started" not in run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith("error: --num_workers=1:2 (elastic) with --num_ps=1:")


def test_metrics_tail_reads_a_replaced_file_again(tmp_path):
    path = tmp_path / files.METRICS
    path.write_text('{"step": 1, "split": "train"}\n{"step": 2, "split": "train"}\n')
    tail = files.MetricsTail(str(tmp_path))
    assert [e["step"] for e in tail.poll()] == [1, 2]
    (tmp_path / "new").write_text('{"step": 1, "split": "train"}\n')
    os.replace(tmp_path / "new", path)  # a resume's truncate_after
    assert [e["step"] for e in tail.poll()] == [1] and [e["step"] for e in tail.events] == [1]
    with open(path, "a") as f:
        f.write('{"step": 3, "split": "train"}\n')
    assert [e["step"] for e in tail.poll()] == [3]


def test_a_run_that_trained_to_the_end_is_not_re_formed_to_admit_a_place(tmp_path):
    # Its newest checkpoint is config.json's train.steps: it only evaluates and exports from there (CI once
    # re-formed such a round, which then had nothing to train).
    assert not files.trained_to_the_end(str(tmp_path))  # neither a config nor a checkpoint
    (tmp_path / files.CONFIG).write_text(json.dumps({"train": {"steps": 1000}}))
    (tmp_path / files.CHECKPOINTS).mkdir()
    (tmp_path / files.CHECKPOINTS / "ckpt-500.index").write_text("")
    assert not files.trained_to_the_end(str(tmp_path))
    (tmp_path / files.CHECKPOINTS / "ckpt-1000.index").write_text("")
    assert files.trained_to_the_end(str(tmp_path))
    (tmp_path / files.CONFIG).write_text("{not json")
    assert not files.trained_to_the_end(str(tmp_path))



def test_a_lost_place_comes_back_rejoin_s_after_the_job_went_on_without_it_and_the_line_names_who_trains(
        tmp_path, caplog):
    # CI: survivors of a SIGKILLed peer took longer to stop than --rejoin_s=3, so the place was back before the
    # 2-worker round ever formed: 3 workers trained while the line said "training again with 2 workers".
    job = elastic.ElasticJob(["true"], {}, elastic.Bounds(2, 3), workdir=str(tmp_path), grace_s=1, rejoin_s=0.2,
                             wait_for_min_s=1, max_restarts=3)
    job._lose(1, "worker 2 exited with -9")
    time.sleep(0.3)  # the stop of its round takes longer than rejoin_s
    assert job._returned() == 0  # its clock has not started: the job has not gone on without it yet
    job._start_return_clocks()
    assert job._returned() == 0
    time.sleep(0.3)
    assert job._returned() == 1
    caplog.set_level("INFO")
    job.log.forms(3)  # back before the round formed: that round trains with 3
    job.log.settle()
    assert "membership: workers 3 -> 3 from step 0 (worker 2 exited with -9; 1 place(s) back before the round " \
        "formed)" in caplog.text


# --- one real TensorFlow job per story: every change must leave the result of an uninterrupted run ---

REAL = {"train.steps": 1500, "train.global_batch_size": 48, "eval.global_batch_size": 96,
        "train.checkpoint_every_steps": 500, "deterministic": True}
LAST = REAL["train.steps"]  # the stories change membership between 500 and 1000, then train on to the end


def _real_job(tmp_path, bounds: str, **flags) -> Watched:
    workdir = tmp_path / "run"
    command = [sys.executable, "-m", "mwloop.launch", f"--num_workers={bounds}", "--grace_s=10",
               *(f"--{k}={v}" for k, v in flags.items()), "--", *mw_flags(workdir, **REAL)]
    return Watched(command, env_for_workers(tmp_path))


def _pid(job: Watched, worker: int, start: int) -> int:
    """The pid of the `start`-th start (0-based) of worker `worker`."""
    pattern = rf"started worker {worker} \(pid (\d+)\)"
    job.wait_for(rf"(?s)(.*{pattern}){{{start + 1}}}", timeout_s=120)
    return int(re.findall(pattern, job.output)[start])


def _assert_same_result(tmp_path, workdir, settings: dict = REAL) -> float:
    """The final weights against an uninterrupted one-replica run of the same config (`settings`); their max
    relative difference. Float rounding differs with the replica count (an all-reduce of 2 or 3 partial sums) and
    the SGD steps amplify it (~1e-5 after 3000, measured even without a change: BENCHMARKS.md "Elastic training")."""
    reference = tmp_path / "reference"
    train_here(reference, **settings)
    last = settings["train.steps"]
    ours, theirs = checkpoint_weights(workdir, last), checkpoint_weights(reference, last)
    assert ours.keys() == theirs.keys()
    worst = max(float(np.max(np.abs(ours[k] - theirs[k])) / (np.max(np.abs(theirs[k])) + 1e-12)) for k in ours)
    assert worst < 1e-4, worst
    steps = [e["step"] for e in files.read_metrics(str(workdir)) if e["split"] == "train"]
    assert steps == sorted(set(steps)) and steps[-1] == last  # continuous: no step twice, none after the end
    return worst


@pytest.mark.slow
def test_real_job_shrinks_after_a_kill_grows_back_and_ends_with_the_uninterrupted_weights(tmp_path):
    # The place is back 3 s after the 2-worker round formed, long before that round reaches its next checkpoint
    # (1000) whatever the machine's speed: it joins there.
    job = _real_job(tmp_path, "2:3", rejoin_s=3)
    job.wait_for(rf"\[worker 0\] .*step 700/{LAST}", timeout_s=150)  # between checkpoints 500 and 1000
    os.kill(_pid(job, 2, 0), signal.SIGKILL)
    job.wait_for(r"membership: workers 3 -> 2 from step 500 \(worker 2 exited with -9")
    job.wait_for(r"membership: training again with 2 workers, [\d.]+s after")
    job.wait_for(r"membership: workers 2 -> 3 from step \d+ \(1 place\(s\) back", timeout_s=150)
    saved = int(job.wait_for(r"\[worker 0\] .*preempted: saving a checkpoint at step (\d+)")[1])
    chief_resumed = r"\[worker 0\] .*resumed from step (\d+)"
    assert int(job.wait_for(rf"{chief_resumed}(?s:.*){chief_resumed}")[2]) == saved
    assert job.wait(timeout_s=240) == 0, job.output[-5000:]
    events = [e for e in files.read_metrics(str(tmp_path / "run")) if e["split"] == "membership"]
    assert [(e["workers_before"], e["workers_after"], e["step"]) for e in events] == [(3, 2, 500), (2, 3, saved)]
    assert events[0]["steps_redone"] >= 200 and events[1]["steps_redone"] == 0
    assert all(e["seconds_lost"] > 0 for e in events)
    print("max relative weight difference", _assert_same_result(tmp_path, tmp_path / "run"))


@pytest.mark.slow
def test_real_job_a_worker_given_notice_saves_first_and_a_lost_chief_is_replaced(tmp_path):
    job = _real_job(tmp_path, "1:3", rejoin_s="inf")
    job.wait_for(rf"\[worker 0\] .*step 700/{LAST}", timeout_s=150)
    os.kill(_pid(job, 1, 0), signal.SIGTERM)  # a preemption notice to worker 1 alone
    saved = int(job.wait_for(r"\[worker 0\] .*preempted: saving a checkpoint at step (\d+)")[1])
    job.wait_for(r"membership: workers 3 -> 2 from step (\d+) \(worker 1 given notice")
    assert int(job.wait_for(r"\[worker 0\] .*resumed from step (\d+)")[1]) == saved  # no step lost
    job.wait_for(rf"\[worker 0\] .*step {saved // 50 * 50 + 300}/{LAST}", timeout_s=120)
    os.kill(_pid(job, 0, 1), signal.SIGKILL)  # the chief of the second round, for good
    job.wait_for(r"membership: workers 2 -> 1 from step \d+ \(worker 0 exited with -9")
    assert job.wait(timeout_s=240) == 0, job.output[-5000:]
    events = [e for e in files.read_metrics(str(tmp_path / "run")) if e["split"] == "membership"]
    assert [(e["workers_before"], e["workers_after"]) for e in events] == [(3, 2), (2, 1)]
    assert events[0]["step"] == saved and events[0]["steps_redone"] == 0
    print("max relative weight difference", _assert_same_result(tmp_path, tmp_path / "run"))


def test_the_agents_bounds_variable_is_the_one_workers_read():
    from mwloop.cluster import distribute  # TensorFlow: the launcher itself never imports it
    assert elastic.BOUNDS_ENV == distribute.ELASTIC_ENV
