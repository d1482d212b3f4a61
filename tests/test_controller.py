"""The controller runs loop calls and actions and knows no policy by name; policies reach it as hooks.

A fake train loop (Python, no TensorFlow function) stands in for `loops.make_train_loop`, so each claim is
about the controller alone: where loop calls end, what hooks are told and when, how a stop is decided, and
how the non-finite guard (one hook) fails or counts. And the commands' one table of exit codes.
"""

from __future__ import annotations

import contextlib
import types

import pytest
import tensorflow as tf

from mwloop import errors
from mwloop.cluster.peers import PeerLost
from mwloop.loop.ps import ParameterServerLost
from mwloop.run import actions as actions_lib
from mwloop.run.controller import Controller
from mwloop.run.hooks import Hook, Hooks, LoopCall
from mwloop.run.nonfinite import NonfiniteGuard
from mwloop.run.schedule import Schedule

FINE = {"nonfinite": 0.0, "first_nonfinite": float("inf"), "skipped": 0.0}


class FakeLoop:
    """A train loop of `num_steps` steps: sums of 1.0 loss per step; `bad` steps (1-based) are non-finite."""

    def __init__(self, bad: tuple[int, ...] = (), skipped: bool = False):
        self.step, self.bad, self.skipped, self.calls = 0, bad, skipped, []

    def __call__(self, train_input, num_steps: tf.Tensor):
        n = int(num_steps)
        first, self.step = self.step, self.step + n
        self.calls.append((first, self.step))
        bad = [s for s in self.bad if first < s <= self.step]
        status = dict(FINE) if not bad else {"nonfinite": float(len(bad)), "first_nonfinite": float(bad[0] - first - 1),
                                             "skipped": float(len(bad)) if self.skipped else 0.0}
        return {"loss_sum": float(n), "examples": float(n)}, status


class Recorder(Hook):
    """Records every moment it is told of."""

    def __init__(self):
        self.told = []

    def before_call(self, step, started):
        self.told.append(("before", step))

    def after_call(self, call: LoopCall):
        self.told.append(("after", call.first_step, call.end_step, call.sums["examples"]))

    @contextlib.contextmanager
    def section(self, cause):
        self.told.append(("enter", cause))
        yield
        self.told.append(("exit", cause))


class Every(actions_lib.Action):
    def __init__(self, seen, **triggers):
        super().__init__(**triggers)
        self.seen = seen

    def __call__(self, run, step):
        self.seen.append(step)


class StopAt(actions_lib.Action):
    may_stop = True

    def __init__(self, controller_of, at):
        super().__init__(at_steps=(at,))
        self.controller_of = controller_of

    def __call__(self, run, step):
        self.controller_of().request_stop(f"enough at {step}")


def make(actions, hooks=(), num_workers=1):
    step = tf.Variable(0, dtype=tf.int64)
    context = types.SimpleNamespace(writer=types.SimpleNamespace(write_event=lambda *a: None))
    schedule = Schedule(actions, chief=True, num_workers=num_workers, broadcast=lambda values: values)
    return Controller(step=step, actions=actions, schedule=schedule, context=context, hooks=Hooks(hooks),
                      num_workers=num_workers)


def test_loop_calls_end_where_actions_are_due_and_hooks_see_each_call():
    seen, recorder, loop = [], Recorder(), FakeLoop()
    controller = make([Every(seen, every_steps=30)], hooks=[recorder])
    reached = controller.train(loop, None, start=0, until=100, total=100, steps_per_loop=40)
    assert reached == 100 and int(controller.step.numpy()) == 100
    assert loop.calls == [(0, 30), (30, 60), (60, 90), (90, 100)]
    assert seen == [30, 60, 90]
    assert recorder.told == [("before", 0), ("after", 0, 30, 30.0), ("before", 30), ("after", 30, 60, 30.0),
                             ("before", 60), ("after", 60, 90, 30.0), ("before", 90), ("after", 90, 100, 10.0)]


def test_a_stop_requested_by_an_action_ends_training_there():
    controller_box = []
    controller = make([StopAt(lambda: controller_box[0], at=20)])
    controller_box.append(controller)
    assert controller.train(FakeLoop(), None, start=0, until=100, total=100, steps_per_loop=10) == 20
    assert controller.stop_reason == "enough at 20"


def test_a_stop_from_an_action_that_does_not_declare_it_is_refused_on_several_workers():
    class Rogue(actions_lib.Action):
        all_workers = True

        def __call__(self, run, step):
            controller.request_stop("mine")

    controller = make([Rogue(every_steps=10)], num_workers=2)
    with pytest.raises(errors.UserError, match="Rogue asked to stop training but does not declare may_stop = True"):
        controller.train(FakeLoop(), None, start=0, until=30, total=30, steps_per_loop=10)


def test_hooks_reach_only_the_moments_a_hook_defines_and_sections_nest():
    class AfterOnly(Hook):
        def __init__(self):
            self.calls = 0

        def after_call(self, call):
            self.calls += 1

    after_only, recorder = AfterOnly(), Recorder()
    hooks = Hooks([after_only, recorder])
    assert hooks._defining["after_call"] == [after_only.after_call, recorder.after_call]
    assert hooks._defining["before_call"] == [recorder.before_call] and hooks._defining["closing"] == []
    with hooks.section("checkpoint"):
        recorder.told.append("inside")
    assert recorder.told == [("enter", "checkpoint"), "inside", ("exit", "checkpoint")]


def test_the_nonfinite_guard_fails_naming_the_step_or_counts_skipped_updates():
    model = types.SimpleNamespace(weights=[tf.Variable([1.0, 2.0])])
    failing = make([], hooks=[NonfiniteGuard(model, skip=False, fix=", or skip")])
    with pytest.raises(FloatingPointError, match=r"^non-finite loss at step 27; lower the learning rate, or skip$"):
        failing.train(FakeLoop(bad=(27,)), None, start=0, until=50, total=50, steps_per_loop=10)
    assert int(failing.step.numpy()) == 20  # the call that saw it did not count as trained
    guard = NonfiniteGuard(model, skip=True, fix="")
    skipping = make([], hooks=[guard])
    assert skipping.train(FakeLoop(bad=(5, 17, 18), skipped=True), None, start=0, until=30, total=30,
                          steps_per_loop=10) == 30
    assert guard.skipped_updates == 3


def test_the_nonfinite_guard_refuses_to_save_weights_that_are_not_finite():
    weights = tf.Variable([1.0, 2.0])
    guard = NonfiniteGuard(types.SimpleNamespace(weights=[weights]), skip=False, fix="")
    guard.before_save(10)
    weights.assign([1.0, float("nan")])
    with pytest.raises(FloatingPointError, match="weights are not finite at step 20; not saving a checkpoint"):
        guard.before_best_save(20)


def test_one_table_gives_every_command_its_exit_code():
    assert errors.exit_code(errors.UserError("x")) == errors.USER_ERROR
    assert errors.exit_code(FloatingPointError("non-finite loss")) == errors.USER_ERROR
    assert errors.exit_code(PeerLost("worker 1 went away")) == 1
    assert errors.exit_code(ParameterServerLost("ps 0 went away")) == 1
    assert errors.exit_code(RuntimeError("a bug")) is None  # internal: it keeps its traceback
