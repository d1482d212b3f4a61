"""Goodput (issue 32): the records a run leaves in metrics.jsonl add up to its wall time, by cause.

The summing (mwloop.artifacts.goodput) on hand-written events: one attempt, an attempt killed and resumed (its
lost steps recorded by the next one), a job SIGKILLed for good, an elastic re-form, an attempt killed before its
first checkpoint; the clock (mwloop.run.goodput_clock) on a fake time; then real runs through mwloop.main, one
of them SIGKILLed between checkpoints, read back by `python -m mwloop.goodput DIR`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import types

import pytest

import mwloop
from mwloop.artifacts import goodput, sink
from mwloop.artifacts.writers import MetricWriter
from mwloop.run import goodput_clock
from tests import warm_main
from tests.helpers import ROOT, read_metrics

P = 1000.0  # the first attempt's process start (seconds since the epoch, made small)


def clock(startup=10.0, checkpoint=0.0, eval=0.0, other=0.0, traced_s=0.0, traced_steps=0, steady_s=0.0,
          steady_steps=0, stalled=0.0) -> dict:
    return dict(startup=startup, checkpoint=checkpoint, eval=eval, other=other, traced_s=traced_s,
                traced_steps=traced_steps, steady_s=steady_s, steady_steps=steady_steps, stalled=stalled)


def attempt(step, time, process_start, lost=None) -> dict:
    event = {"step": step, "split": "attempt", "time": time, "clock": {"process_start": process_start, "pid": 1}}
    return {**event, "lost": lost} if lost else event


def train(step, time) -> dict:
    return {"step": step, "split": "train", "loss": 0.5, "time": time}


def record(split, step, time, **seconds) -> dict:
    return {"step": step, "split": split, "time": time, "clock": clock(**seconds)}


def adds_up(result: goodput.Report) -> None:
    """The identity: productive time plus every cause is the wall time; the records attribute all but 2 %."""
    assert result.productive + sum(result.seconds.values()) == pytest.approx(result.wall, abs=1e-6)
    assert abs(result.seconds["unaccounted"]) <= 0.02 * result.wall


# Attempt 1 of a job: started at P, trained to its checkpoint of step 200 (its clock at 1020: 20 s, all told).
FIRST = [attempt(0, 1010.0, P), train(100, 1015.0),
         record("clock", 200, 1020.0, checkpoint=1.0, traced_s=3.0, traced_steps=50, steady_s=6.0, steady_steps=150)]
# Trained on past it: the train event of step 250 at 1023 (a resume drops it), then SIGKILLed.
PAST_CHECKPOINT = train(250, 1023.0)
# Attempt 2: the launcher started it at 1030; it resumed from step 200 and finished at step 400 at 1060.
SECOND = [attempt(200, 1040.0, 1030.0, lost={"steps": 50, "last_time": 1023.0}), train(300, 1045.0),
          record("goodput", 400, 1060.0, checkpoint=2.0, other=3.0, traced_s=3.0, traced_steps=50, steady_s=12.0,
                 steady_steps=150)]


def test_one_attempt_splits_its_loop_calls_into_training_and_compilation():
    events = [attempt(0, 1010.0, P), train(50, 1012.0),
              record("goodput", 100, 1021.0, checkpoint=1.0, eval=2.0, other=3.0, traced_s=3.0, traced_steps=50,
                     steady_s=2.0, steady_steps=50)]
    result = goodput.report(events)
    # Steady speed 0.04 s/step: the traced call's 50 steps are 2 s of training, its other 1 s is compilation.
    assert result.productive == pytest.approx(4.0) and result.seconds["compile"] == pytest.approx(1.0)
    assert result.wall == pytest.approx(21.0) and result.goodput == pytest.approx(4 / 21)
    assert {c: round(result.seconds[c], 6) for c in ("startup", "checkpoint", "eval", "other", "restart", "lost")} \
        == {"startup": 10.0, "checkpoint": 1.0, "eval": 2.0, "other": 3.0, "restart": 0.0, "lost": 0.0}
    assert result.attempts[0].ended
    adds_up(result)


def test_a_killed_attempt_resumed_counts_its_lost_steps_and_the_restart_gap():
    result = goodput.report(FIRST + SECOND)  # what metrics.jsonl holds after the resume dropped step 250
    assert result.wall == pytest.approx(60.0)
    assert result.seconds["lost"] == pytest.approx(3.0) and result.lost_steps == 50  # 1020 -> 1023
    assert result.seconds["restart"] == pytest.approx(7.0)  # 1023 -> the next process at 1030
    assert result.seconds["startup"] == pytest.approx(20.0) and result.seconds["checkpoint"] == pytest.approx(3.0)
    # Attempt 1: 0.04 s/step, 2 s of its traced call train; attempt 2: 0.08 s/step, all 3 s of it train.
    assert result.productive == pytest.approx(8.0 + 15.0) and result.seconds["compile"] == pytest.approx(1.0)
    assert [a.ended for a in result.attempts] == [False, True]
    assert "no end record (killed)" in goodput.format_report(result)
    adds_up(result)


def test_an_attempt_whose_end_record_a_resume_dropped_is_told_apart_from_a_killed_one():
    second = [{**SECOND[0], "lost": {"steps": 50, "last_time": 1023.0, "ended": True}}, *SECOND[1:]]
    result = goodput.report(FIRST + second)
    assert result.attempts[0].ended_past_checkpoint and result.seconds["lost"] == pytest.approx(3.0)
    assert "attempt 1: from step 0, 23.0 s (start-up 10.0 s), ended past its last checkpoint" in \
        goodput.format_report(result)


def test_a_job_sigkilled_for_good_is_read_back_from_its_last_records():
    result = goodput.report(FIRST + [PAST_CHECKPOINT])  # no next attempt dropped step 250: it is still there
    assert result.wall == pytest.approx(23.0)
    assert result.seconds["lost"] == pytest.approx(3.0) and result.lost_steps == 50
    assert result.seconds["restart"] == 0.0 and not result.attempts[0].ended
    assert "no end record (killed)" in goodput.format_report(result)
    adds_up(result)


def test_an_elastic_re_form_is_the_gap_between_rounds():
    membership = {"step": 200, "split": "membership", "workers_before": 2, "workers_after": 1, "why": "worker 1 lost",
                  "steps_redone": 50, "seconds_lost": 25.0}
    result = goodput.report(FIRST + SECOND[:1] + [membership] + SECOND[1:])
    assert [a.reform for a in result.attempts] == [False, True]
    assert result.seconds["restart"] == pytest.approx(7.0)
    assert "1 of them elastic re-forms" in goodput.format_report(result)
    adds_up(result)


def test_an_attempt_killed_before_its_first_checkpoint_lost_all_it_trained():
    events = [attempt(0, 1010.0, P), attempt(0, 1040.0, 1030.0, lost={"steps": 50, "last_time": 1012.0}),
              record("goodput", 100, 1060.0, other=15.0, traced_s=3.0, traced_steps=50, steady_s=2.0, steady_steps=50)]
    result = goodput.report(events)
    assert result.seconds["lost"] == pytest.approx(2.0) and result.lost_steps == 50
    assert result.seconds["restart"] == pytest.approx(18.0) and result.seconds["startup"] == pytest.approx(20.0)
    adds_up(result)


def test_what_the_records_cannot_attribute_is_its_own_line():
    events = [attempt(0, 1010.0, P), record("goodput", 100, 1030.0, steady_s=5.0, steady_steps=100)]
    result = goodput.report(events)
    assert result.seconds["unaccounted"] == pytest.approx(15.0)  # 30 s alive, the clock told of 15
    assert result.productive + sum(result.seconds.values()) == pytest.approx(result.wall)
    text = goodput.format_report(result, "DIR")
    assert text.startswith("goodput of DIR: 16.7% (5.0 s training of 30.0 s wall")
    assert [line.split()[0] for line in text.splitlines()[1:10]] == ["productive", *goodput.CAUSES]
    assert "unaccounted       15.0 s  50.0%" in text


def test_lost_record_of_the_events_a_resume_drops():
    dropped = [train(250, 1023.0), {"step": 250, "split": "eval", "loss": 0.4},
               {"step": 260, "split": "goodput", "time": 1024.5, "clock": clock()}]
    assert goodput.lost_record(dropped, 200) == {"steps": 50, "last_time": 1024.5, "ended": True}
    assert goodput.lost_record(dropped[:1], 200) == {"steps": 50, "last_time": 1023.0, "ended": False}
    assert goodput.lost_record([{"step": 250, "split": "eval", "loss": 0.4}], 200) is None
    assert goodput.lost_record([], 200) is None


def test_no_records_is_said_plainly():
    assert "no attempt record" in goodput.format_report(goodput.report([train(50, 1.0)]))


class FakeTime:
    def __init__(self):
        self.now = 100.0

    def perf_counter(self):
        return self.now

    def time(self):
        return 5000.0 + self.now


def test_the_clock_splits_a_process_by_cause(tmp_path, monkeypatch):
    fake = FakeTime()
    monkeypatch.setattr(goodput_clock, "time", types.SimpleNamespace(perf_counter=fake.perf_counter, time=fake.time))
    traces = iter([1, 1, 2])  # the first call traces, the second not, the third traces again
    writer = MetricWriter(str(tmp_path), enabled=True, sinks=[])
    clock_ = goodput_clock.GoodputClock(writer, tracing_count=lambda: next(traces), process_start=5000.0 + 90.0)
    fake.now = 110.0  # 20 s after the process started: its start-up
    clock_.started_training(0)
    clock_.loop_call(110.0, 4.0, 50)  # traced
    fake.now = 116.0  # 3 s between calls, 1 s of them a save inside an action
    with clock_.timing("other"):
        with clock_.timing("checkpoint"):
            fake.now += 1.0
    clock_.loop_call(117.0, 1.0, 50)
    fake.now = 118.0
    with clock_.timing("eval"):
        fake.now = 121.0
    clock_.loop_call(121.0, 2.0, 50)  # traced again (another shape)
    fake.now = 124.0
    clock_.saved(150)
    assert clock_.totals() == {"startup": 20.0, "checkpoint": 1.0, "eval": 3.0, "other": 3.0, "traced_s": 6.0,
                               "traced_steps": 100, "steady_s": 1.0, "steady_steps": 50, "stalled": 0.0}
    result = clock_.close(150)
    assert result.wall == pytest.approx(34.0) and result.productive == pytest.approx(3.0)  # 150 steps at 0.02 s
    adds_up(result)
    splits = [e["split"] for e in read_metrics(str(tmp_path))]
    assert splits == ["attempt", "clock", "goodput"]
    end = read_metrics(str(tmp_path))[-1]
    assert end["goodput"] == pytest.approx(3 / 34) and end["time"] == 5124.0 and end["clock"]["eval"] == 3.0


def test_a_loop_call_that_never_returned_waited_for_a_lost_peer(tmp_path, monkeypatch):
    fake = FakeTime()
    monkeypatch.setattr(goodput_clock, "time", types.SimpleNamespace(perf_counter=fake.perf_counter, time=fake.time))
    clock_ = goodput_clock.GoodputClock(MetricWriter(str(tmp_path), enabled=True, sinks=[]), process_start=5090.0)
    clock_.started_training(0)
    clock_.loop_call(110.0, 4.0, 50)
    clock_.before_call(50, 115.0)  # 1 s of actions, then a call that raised 30 s later (a peer stopped answering)
    fake.now = 145.0
    totals = clock_.totals()
    assert totals["stalled"] == 30.0 and totals["other"] == 1.0
    result = clock_.close(50)
    assert result.seconds["restart"] == pytest.approx(30.0)  # detecting the loss, as the launcher's restart
    adds_up(result)


def test_the_writer_keeps_records_out_of_the_sinks_and_returns_what_a_resume_drops(tmp_path):
    seen = []

    class Recording(sink.Sink):
        def write_scalars(self, step, split, metrics):
            seen.append(dict(metrics))

    writer = MetricWriter(str(tmp_path), enabled=True, sinks=[Recording()])
    writer.write(10, "train", {"loss": 1.0}, record={"time": 7.0})
    writer.write(20, "train", {"loss": 0.5}, record={"time": 8.0})
    assert seen == [{"loss": 1.0}, {"loss": 0.5}]
    assert read_metrics(str(tmp_path))[0] == {"step": 10, "split": "train", "loss": 1.0, "time": 7.0}
    assert writer.truncate_after(10) == [{"step": 20, "split": "train", "loss": 0.5, "time": 8.0}]
    assert [e["step"] for e in read_metrics(str(tmp_path))] == [10]


# ---------------------------------------------------------------------- real runs
MLP = os.path.join(ROOT, "configs", "mlp.py")
SMALL = ["--config.train.steps=60", "--config.train.steps_per_loop=10", "--config.train.log_every_steps=10",
         "--config.train.checkpoint_every_steps=20", "--config.train.eval_every_steps=60", "--config.export=False",
         "--config.distribution.strategy=default"]
ENV = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", GCE_METADATA_IP="127.0.0.1:9")


class SignalSelfOnce(mwloop.Action):
    """At step 30 (after the checkpoint of 20 and the log of 30) the chief sends itself `signum`, once."""
    at_steps = (30,)
    signum = signal.SIGKILL

    def __call__(self, run, step):
        marker = os.path.join(run.workdir, f"signalled-{self.signum}")
        if not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), self.signum)


class KillSelfOnce(SignalSelfOnce):
    """SIGKILL: no `finally` runs, no end record."""


class PreemptSelfOnce(SignalSelfOnce):
    """SIGTERM, a notice: it saves and exits 42."""
    signum = signal.SIGTERM


def main(workdir: str, *extra: str) -> subprocess.CompletedProcess:
    return warm_main.run([f"--config={MLP}", f"--workdir={workdir}", *SMALL, *extra], env=ENV, timeout=300)


def report_command(workdir: str, *flags: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "mwloop.goodput", workdir, *flags], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done


def figures_add_up(figures: dict) -> None:
    attributed = figures["productive_s"] + sum(figures[f"{c}_s"] for c in goodput.CAUSES if c != "unaccounted")
    assert attributed == pytest.approx(figures["wall_s"], rel=0.02), figures
    assert attributed + figures["unaccounted_s"] == pytest.approx(figures["wall_s"], abs=1e-6)


@pytest.mark.slow
def test_a_run_writes_its_goodput_and_the_command_reads_it_back(tmp_path):
    workdir = str(tmp_path / "run")
    done = main(workdir)
    assert done.returncode == 0, done.stderr[-3000:]
    [event] = [e for e in read_metrics(workdir) if e["split"] == "goodput"]
    assert event["step"] == 60 and event["attempts"] == 1 and event["lost_steps"] == 0
    # Start-up is counted (forked from a warm server, it has no TensorFlow import of its own: well under 1 s).
    assert event["productive_s"] > 0 and event["compile_s"] > 0 and event["startup_s"] > 0
    figures_add_up(event)
    assert "  goodput        " in done.stderr and f"python -m mwloop.goodput {workdir}" in done.stderr
    assert os.path.isdir(os.path.join(workdir, "summaries", "goodput"))  # TensorBoard's goodput/...
    shown = report_command(workdir)
    assert shown.stdout.startswith(f"goodput of {workdir}: ") and "attempt 1: from step 0" in shown.stdout
    assert json.loads(report_command(workdir, "--json").stdout) == pytest.approx(
        {k: v for k, v in event.items() if k not in ("step", "split", "time", "clock")})


@pytest.mark.slow
def test_a_sigkilled_run_is_read_back_from_its_workdir_alone_and_its_rerun_counts_the_loss(tmp_path):
    workdir = str(tmp_path / "run")
    killed = main(workdir, "--config.actions=('tests.test_goodput:KillSelfOnce',)")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert not [e for e in read_metrics(workdir) if e["split"] == "goodput"]  # no finally ran
    result = goodput.report(read_metrics(workdir))
    assert not result.attempts[0].ended and result.lost_steps == 10  # the log of 30 after the checkpoint of 20
    adds_up(result)
    assert "no end record (killed)" in report_command(workdir).stdout

    done = main(workdir, "--config.actions=('tests.test_goodput:KillSelfOnce',)")  # resumes from ckpt-20
    assert done.returncode == 0, done.stderr[-3000:]
    [event] = [e for e in read_metrics(workdir) if e["split"] == "goodput"]
    assert event["attempts"] == 2 and event["lost_steps"] == 10 and event["lost_s"] > 0
    assert event["restart_s"] > 0  # the killed process's end to the rerun's start
    figures_add_up(event)
    assert json.loads(report_command(workdir, "--json").stdout)["lost_steps"] == 10


@pytest.mark.slow
def test_a_preempted_attempt_writes_its_end_record_and_loses_nothing(tmp_path):
    workdir = str(tmp_path / "run")
    preempted = main(workdir, "--config.actions=('tests.test_goodput:PreemptSelfOnce',)")
    assert preempted.returncode == 42, preempted.stderr[-3000:]
    [end] = [e for e in read_metrics(workdir) if e["split"] == "goodput"]
    assert end["attempts"] == 1 and end["lost_steps"] == 0  # saved at the step it stopped
    done = main(workdir, "--config.actions=('tests.test_goodput:PreemptSelfOnce',)")
    assert done.returncode == 0, done.stderr[-3000:]
    ends = [e for e in read_metrics(workdir) if e["split"] == "goodput"]
    assert [e["step"] for e in ends] == [end["step"], 60] and ends[-1]["attempts"] == 2
    assert ends[-1]["lost_s"] == 0 and ends[-1]["restart_s"] > 0
    figures_add_up(ends[-1])


def test_records_without_a_step_or_time_are_left_out_with_a_warning():
    broken = [{k: v for k, v in SECOND[0].items() if k != "step"}, {**SECOND[1], "time": None}, *SECOND[2:]]
    result = goodput.report(FIRST + broken)  # before: KeyError: 'step'
    assert result.skipped == {"attempt": 1, "train": 1} and len(result.attempts) == 1
    assert goodput.format_report(result).splitlines()[-1] == \
        "warning: 2 record(s) without a time or step left out (1 attempt, 1 train)"
    assert 0 < result.goodput <= 1  # its attempt unknown, the second clock's time is partly unattributed
    assert result.productive + sum(result.seconds.values()) == pytest.approx(result.wall, abs=1e-6)


def test_hosts_whose_clocks_disagree_are_said_and_no_share_passes_100_percent():
    behind = [{**event, "time": event["time"] - 60.0} for event in SECOND]  # the second chief's clock: 60 s behind
    behind[0]["clock"] = {**behind[0]["clock"], "process_start": 1030.0 - 60.0}
    result = goodput.report(FIRST + behind)  # before: 300.8% and a restart of -52.0 s
    assert result.skew == [(2, pytest.approx(53.0))]
    assert result.wall == pytest.approx(23.0 + 30.0) and 0 < result.goodput <= 1  # each attempt's own span
    assert result.seconds["restart"] == 0.0 and min(result.seconds.values()) >= -1e-6
    text = goodput.format_report(result)
    assert "warning: the hosts' wall clocks disagree: attempt 2 started 53.0 s before attempt 1's last record; the " \
           "gaps between attempts (restarts) are left out, the figures cover the attempts' own durations" in text
    assert goodput.report(FIRST + SECOND).skew == []  # one clock: no warning
    adds_up(result)


def test_a_reader_that_goes_away_ends_the_report_quietly(tmp_path):
    from mwloop.artifacts import files
    with open(tmp_path / files.METRICS, "w") as f:
        f.writelines(json.dumps(event) + "\n" for event in FIRST + SECOND)
    for args, stream, code in (([str(tmp_path)], "stdout", 0), (["--json", str(tmp_path)], "stdout", 0),
                               ([str(tmp_path / "none")], "stderr", 2)):
        read, write = os.pipe()
        os.close(read)  # the reader is gone before the first line
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, stream: write}
        done = subprocess.run([sys.executable, "-m", "mwloop.goodput", *args], timeout=60, cwd=ROOT, **pipes)
        os.close(write)
        other = done.stderr if stream == "stdout" else done.stdout
        assert done.returncode == code and not other, other  # before: a BrokenPipeError traceback
