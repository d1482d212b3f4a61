"""The Trainer's schedule with a fake loop and a fake clock: no TensorFlow, no processes.

Two workers are simulated in lockstep: the chief's schedule runs each step first and records what it
broadcasts; the other worker's broadcast returns the chief's values, as the all-reduce would.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mwloop.errors import UserError
from mwloop.run.schedule import Schedule, Triggers
from tests.helpers import ROOT


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Recorder(Triggers):
    """An action that records the steps it ran at; `stop_at` asks for a stop there."""

    def __init__(self, name: str, log: list, clock: FakeClock, stop_at: int | None = None, **triggers):
        for key in ("after_eval", "may_stop", "every_call"):
            if key in triggers:
                setattr(self, key, triggers.pop(key))
        super().__init__(clock=clock, **triggers)
        self.name, self.log, self.stop_at = name, log, stop_at


class Worker:
    """One worker's fake loop around a Schedule: runs calls of at most steps_per_loop steps to `until`."""

    def __init__(self, actions, *, chief: bool, num_workers: int, clock: FakeClock, broadcasts: list):
        self.chief, self.clock, self.broadcasts = chief, clock, broadcasts
        self.schedule = Schedule(actions, chief=chief, num_workers=num_workers, broadcast=self.broadcast,
                                 clock=clock)
        self.stop_reason, self.last_eval_step, self.ran, self.sent = None, None, [], []

    def broadcast(self, values: list[float]) -> list[bool]:
        if self.chief:
            self.broadcasts.append(values)
            self.sent.append(values)
        else:
            values = self.broadcasts.pop(0)  # what the chief sent at this same point
        return [v > 0.5 for v in values]

    def call(self, action: Recorder, step: int) -> None:
        self.ran.append((step, action.name))
        if action.name == "eval":
            self.last_eval_step = step
        if action.stop_at == step:
            self.stop_reason = f"{action.name} asked"

    def run(self, step: int, final: bool) -> bool:
        stopping = self.schedule.run(step, final=final, call=lambda a: self.call(a, step),
                                     last_eval_step=lambda: self.last_eval_step, stop_reason=lambda: self.stop_reason)
        self.stop_reason = (self.stop_reason or "the chief stopped") if stopping else None
        return stopping


def drive(workers: list[Worker], until: int, steps_per_loop: int, seconds_per_step: float = 0.0,
          clocks: list[FakeClock] | None = None) -> int:
    """The fake loop: every worker ends each call at the same step (as the Trainer's), clocks advance."""
    step = 0
    while step < until:
        stop = workers[0].schedule.call_end(step, until, steps_per_loop)
        assert all(w.schedule.call_end(step, until, steps_per_loop) == stop for w in workers)
        for clock in clocks or []:
            clock.now += (stop - step) * seconds_per_step
        step = stop
        stopping = [w.run(step, final=step == until) for w in workers]
        assert len(set(stopping)) == 1, "every worker must decide alike"
        if stopping[0]:
            break
    return step


def test_calls_end_where_a_step_trigger_is_due():
    clock, log = FakeClock(), []
    worker = Worker([Recorder("log", log, clock, every_steps=30), Recorder("save", log, clock, at_steps=(45,))],
                    chief=True, num_workers=1, clock=clock, broadcasts=[])
    ends, step = [], 0
    while step < 100:
        step = worker.schedule.call_end(step, 100, steps_per_loop=20)
        ends.append(step)
    assert ends == [20, 30, 45, 60, 80, 90, 100]


def test_step_triggers_at_end_and_chief_only_actions():
    clock, log = FakeClock(), []
    actions = [Recorder("log", log, clock, every_steps=25, all_workers=True, at_end=True),
               Recorder("chief_note", log, clock, every_steps=50),
               Recorder("final", log, clock, at_end=True, all_workers=True)]
    broadcasts: list = []
    chief = Worker(actions, chief=True, num_workers=2, clock=clock, broadcasts=broadcasts)
    other = Worker(actions, chief=False, num_workers=2, clock=clock, broadcasts=broadcasts)
    assert drive([chief, other], until=110, steps_per_loop=40) == 110
    assert chief.ran == [(25, "log"), (50, "log"), (50, "chief_note"), (75, "log"), (100, "log"),
                         (100, "chief_note"), (110, "log"), (110, "final")]
    assert other.ran == [(s, n) for s, n in chief.ran if n != "chief_note"]
    assert chief.sent == [], "no time trigger or stop to agree on: no broadcast at all"


def test_seconds_are_the_chiefs_clock_for_actions_every_worker_runs():
    chief_clock, other_clock, log = FakeClock(), FakeClock(), []
    broadcasts: list = []

    def actions(clock):
        return [Recorder("eval", log, clock, every_secs=10.0, all_workers=True),
                Recorder("chief_timer", log, clock, every_secs=10.0)]

    chief = Worker(actions(chief_clock), chief=True, num_workers=2, clock=chief_clock, broadcasts=broadcasts)
    other = Worker(actions(other_clock), chief=False, num_workers=2, clock=other_clock, broadcasts=broadcasts)
    other_clock.now += 7.0  # the other worker's clock runs ahead: alone it would eval at other steps
    drive([chief, other], until=100, steps_per_loop=10, seconds_per_step=0.4, clocks=[chief_clock, other_clock])
    chief_evals = [s for s, n in chief.ran if n == "eval"]
    assert chief_evals == [30, 60, 90]  # 4 s per call: due every 10 s of the chief's clock, checked at call ends
    assert [s for s, n in other.ran if n == "eval"] == chief_evals
    assert [s for s, n in chief.ran if n == "chief_timer"] == [30, 60, 90]
    assert not [n for _, n in other.ran if n == "chief_timer"]
    # one value per call (the shared eval's trigger), each consumed by the other worker
    assert len(chief.sent) == 10 and all(len(b) == 1 for b in chief.sent) and not broadcasts


def test_a_stop_is_the_chiefs_decision_and_the_end_actions_run_once():
    clock, log = FakeClock(), []
    broadcasts: list = []

    def actions(stop_at):
        return [Recorder("eval", log, clock, every_steps=20, all_workers=True, at_end=True),
                Recorder("early_stop", log, clock, stop_at=stop_at, after_eval=True, may_stop=True,
                         all_workers=True),
                Recorder("save", log, clock, every_steps=50, at_end=True, all_workers=True)]

    chief = Worker(actions(stop_at=60), chief=True, num_workers=2, clock=clock, broadcasts=broadcasts)
    other = Worker(actions(stop_at=40), chief=False, num_workers=2, clock=clock, broadcasts=broadcasts)
    assert drive([chief, other], until=200, steps_per_loop=10) == 60  # the worker's own wish at 40 is overruled
    for worker in (chief, other):
        assert worker.ran[-3:] == [(60, "eval"), (60, "early_stop"), (60, "save")]  # save: at_end, once
        assert [s for s, n in worker.ran if n == "eval"] == [20, 40, 60]
    assert chief.stop_reason == "early_stop asked" and other.stop_reason == "the chief stopped"
    assert len(chief.sent) == 3 and not broadcasts  # one agreement at each step where early_stop was due: 20, 40, 60


def test_a_single_worker_stops_without_any_broadcast():
    clock, log = FakeClock(), []
    worker = Worker([Recorder("stopper", log, clock, every_steps=10, stop_at=30, may_stop=True),
                     Recorder("final", log, clock, at_end=True)],
                    chief=True, num_workers=1, clock=clock, broadcasts=[])
    assert drive([worker], until=100, steps_per_loop=10) == 30
    assert worker.ran == [(10, "stopper"), (20, "stopper"), (30, "stopper"), (30, "final")]


def test_every_call_actions_and_the_clock_restarts_when_an_action_runs():
    clock, log = FakeClock(), []
    timer = Recorder("timer", log, clock, every_secs=5.0)
    worker = Worker([Recorder("watch", log, clock, every_call=True), timer], chief=True, num_workers=1,
                    clock=clock, broadcasts=[])
    drive([worker], until=60, steps_per_loop=10, seconds_per_step=0.3, clocks=[clock])
    assert [s for s, n in worker.ran if n == "watch"] == [10, 20, 30, 40, 50, 60]
    assert [s for s, n in worker.ran if n == "timer"] == [20, 40, 60]  # 3 s per call: 6 s > 5 s, then again
    assert timer.last_time == clock.now


def test_negative_intervals_are_one_line_errors():
    with pytest.raises(UserError, match=r"every_steps=-1, every_secs=0.0; use 0 \(never\) or a positive interval"):
        Triggers(every_steps=-1)


@pytest.mark.slow
def test_the_schedule_needs_no_tensorflow():
    code = "import sys, mwloop.run.schedule; assert 'tensorflow' not in sys.modules, 'tensorflow was imported'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, env=dict(os.environ, PYTHONPATH=ROOT))
