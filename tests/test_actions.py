"""Periodic actions and the Trainer: user actions, best checkpoint, early stopping, warm start, several
eval sets, EMA evals, and their bad input."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import mwloop
from mwloop.artifacts import checkpoint
from mwloop.errors import UserError
from mwloop.run import actions, train
from tests import warm_main
from tests.helpers import ROOT, load_config, read_metrics, visible

pytestmark = pytest.mark.slow  # Trainer runs, warm starts and a 2-worker launcher run

QUICK = {"distribution.strategy": "default", "train.steps": 100, "train.steps_per_loop": 10,
         "train.log_every_steps": 20, "train.eval_every_steps": 20, "train.checkpoint_every_steps": 50}


def mlp(**overrides):
    return load_config("mlp", **{**QUICK, **overrides})


def evals(workdir, split="eval") -> dict[int, dict]:
    return {e["step"]: e for e in read_metrics(workdir) if e["split"] == split}


class Recorder(mwloop.Action):
    """Records the steps it runs at."""

    def __init__(self, **schedule):
        super().__init__(**schedule)
        self.steps: list[int] = []

    def __call__(self, run, step):
        self.steps.append(step)
        assert step < 20 or run.metrics["train"]["loss"] > 0  # the latest logged train metrics (every 20)


def test_a_python_script_drives_the_trainer_with_its_own_actions(tmp_path):
    every_7, at_5 = Recorder(every_steps=7), Recorder(at_steps=(5, 33))
    with mwloop.Trainer(mlp(**{"train.steps": 40}), str(tmp_path), actions=[every_7, at_5]) as trainer:
        assert trainer.train(until_step=30) == 30
        assert trainer.train() == 40
        results = trainer.evaluate()
        exported = trainer.export()
    assert every_7.steps == [7, 14, 21, 28, 35] and at_5.steps == [5, 33]  # loop calls end where they are due
    assert set(results) == {"eval"} and results["eval"]["examples"] == 359
    assert os.path.isdir(exported) and exported == str(tmp_path / "export" / "40")
    assert checkpoint.saved_checkpoints(str(tmp_path / "checkpoints"))[0].endswith("ckpt-40")


class Snoop(mwloop.Action):
    """Reaches for what an action may not touch (the Trainer's checkpointer), or sets an attribute on its run."""

    def __init__(self, reach):
        super().__init__(at_steps=(5,))
        self.reach = reach

    def __call__(self, run, step):
        self.reach(run)


def test_an_action_sees_its_run_only_through_its_context(tmp_path):
    seen = {}

    def allowed(run):
        seen.update(step=run.step, is_chief=run.is_chief, worker=run.worker, splits=run.eval_splits,
                    workdir=run.workdir, layers=len(run.model.layers), broadcast=run.broadcast(True),
                    iterations=int(run.optimizer.iterations.numpy()))

    with mwloop.Trainer(mlp(**{"train.steps": 10}), str(tmp_path / "a"), actions=[Snoop(allowed)],
                        preemption=False) as trainer:
        trainer.train()
    assert seen == {"step": 5, "is_chief": True, "worker": 0, "splits": ["eval"], "workdir": str(tmp_path / "a"),
                    "layers": seen["layers"], "broadcast": True, "iterations": 5} and seen["layers"] > 0
    for reach, message in ((lambda run: run.checkpointer, "not 'checkpointer'"), (lambda run: run.state, "not 'state'"),
                           (lambda run: run.strategy, "not 'strategy'"),
                           (lambda run: setattr(run, "metrics", {}), "cannot set 'metrics'")):
        with mwloop.Trainer(mlp(**{"train.steps": 10}), str(tmp_path / message.split("'")[1]),
                            actions=[Snoop(reach)], preemption=False) as trainer:
            with pytest.raises(AttributeError, match=message):
                trainer.train()
    assert "evaluate" in mwloop.ActionContext.__doc__ and "checkpointer" not in dir(mwloop.ActionContext)


def test_best_checkpoint_holds_the_weights_of_the_best_eval(tmp_path):
    """Mode min on accuracy peaks (at its lowest) at the first eval, long before the end: the best
    checkpoint holds that step's weights, and evaluating it gives that eval's figures again."""
    workdir = str(tmp_path / "run")
    train.train_and_evaluate(mlp(**{"best_checkpoint.metric": "eval/accuracy", "best_checkpoint.mode": "min",
                                    "best_checkpoint.export": True}), workdir)
    by_step = evals(workdir)
    best_step = min(by_step, key=lambda s: (by_step[s]["accuracy"], s))
    assert best_step < 100 and by_step[best_step]["accuracy"] < by_step[100]["accuracy"]
    assert os.listdir(os.path.join(workdir, "best_checkpoint")) != []
    assert {f.split(".")[0] for f in os.listdir(os.path.join(workdir, "best_checkpoint")) if f != "checkpoint"} \
        == {f"ckpt-{best_step}"}
    assert checkpoint.saved_checkpoints(os.path.join(workdir, "checkpoints"))[0].endswith("ckpt-100")  # its own
    again = train.train_and_evaluate(mlp(**{"eval.checkpoint": "best"}), workdir, mode="eval")
    print(f"best step {best_step}: accuracy {by_step[best_step]['accuracy']:.4f}; evaluated again "
          f"{again['accuracy']:.4f}; last step {by_step[100]['accuracy']:.4f}")
    assert again["accuracy"] == by_step[best_step]["accuracy"] and again["loss"] == by_step[best_step]["loss"]
    assert visible(os.path.join(workdir, "export_best")) == sorted([str(best_step), "latest"])


def test_warm_start_begins_at_the_other_runs_accuracy_with_its_own_step_0(tmp_path, caplog):
    source = str(tmp_path / "source")
    trained = train.train_and_evaluate(mlp(**{"train.steps": 200}), source)
    fine_tune = {"train.steps": 10, "train.eval_every_steps": 10, "optimizer.learning_rate": 1e-4,
                 "init_checkpoint": source}
    target = str(tmp_path / "target")
    warm = train.train_and_evaluate(mlp(**fine_tune), target)
    cold = train.train_and_evaluate(mlp(**dict(fine_tune, init_checkpoint="")), str(tmp_path / "cold"))
    print(f"source eval accuracy {trained['accuracy']:.4f}; warm-started after 10 steps {warm['accuracy']:.4f}; "
          f"from scratch {cold['accuracy']:.4f}")
    assert abs(warm["accuracy"] - trained["accuracy"]) < 0.02 and cold["accuracy"] < trained["accuracy"] - 0.2
    assert [e["step"] for e in read_metrics(target) if e["split"] == "eval"] == [10]
    # A resume of its own ignores init_checkpoint.
    with caplog.at_level("INFO", logger="absl"):
        train.train_and_evaluate(mlp(**dict(fine_tune, **{"train.steps": 20, "train.allow_changed": "train.steps"})),
                                 target)
    assert "resumed from step 10" in caplog.text and "warm start" not in caplog.text


def test_warm_start_of_a_subset_and_its_errors(tmp_path):
    source = str(tmp_path / "source")
    train.train_and_evaluate(mlp(**{"train.steps": 20}), source, mode="train")
    wider = {"model.hidden": (64,), "train.steps": 10, "init_checkpoint": source}
    with pytest.raises(UserError, match=r"warm start: hidden_0/kernel is \(64, 64\) here but \(64, 32\).*include"):
        train.train_and_evaluate(mlp(**wider), str(tmp_path / "a"), mode="train")
    with pytest.raises(UserError, match=r"init_checkpoint=.*nope.*is not a checkpoint"):
        train.train_and_evaluate(mlp(**{"init_checkpoint": str(tmp_path / "nope")}), str(tmp_path / "b"))
    with pytest.raises(UserError, match=r"init_checkpoint_include='zzz' matches none"):
        train.train_and_evaluate(mlp(**{"init_checkpoint": source, "init_checkpoint_include": "zzz"}),
                                 str(tmp_path / "c"))
    # A fine-tuning run with another head (20 classes' worth of logits would differ too): the hidden layer
    # comes from the source, the output layer keeps its fresh weights (the pattern is on Keras weight paths).
    with mwloop.Trainer(mlp(**{"init_checkpoint": source, "init_checkpoint_include": "^hidden_0/"}),
                        str(tmp_path / "d")) as trainer:
        loaded = {v.path: v.numpy() for v in trainer.state.model.weights}
    reader = tf.train.load_checkpoint(os.path.join(source, "checkpoints", "ckpt-20"))
    stored = [reader.get_tensor(k) for k in reader.get_variable_to_shape_map() if "VARIABLE_VALUE" in k]
    assert sorted(loaded) == ["hidden_0/bias", "hidden_0/kernel", "logits/bias", "logits/kernel"]
    assert any(np.array_equal(loaded["hidden_0/kernel"], s) for s in stored)
    assert not any(np.array_equal(loaded["logits/kernel"], s) for s in stored)


def test_a_checkpoint_read_outside_mwloop_as_docs_actions_md_says(tmp_path):
    """docs/actions.md, "Reading a checkpoint outside mwloop": the N-th trainable weight is stored as
    optimizer/_trainable_variables/N (no model/ key), and tf.train.Checkpoint(model=...) of a freshly built
    model reads every weight by the object graph."""
    source = str(tmp_path / "source")
    config = mlp(**{"train.steps": 20})
    train.train_and_evaluate(config, source, mode="train")
    with mwloop.Trainer(config, source) as trainer:  # resumes at step 20: the weights of the checkpoint
        trained = {v.path: v.numpy() for v in trainer.state.model.weights}
    reader = tf.train.load_checkpoint(os.path.join(source, "checkpoints"))
    keys = reader.get_variable_to_shape_map()
    assert not [k for k in keys if k.startswith("model/")]  # the MLP has no non-trainable weights
    from mwloop.task import resolve
    model = resolve(config.task, config).build_model()  # as a user's script builds its task's model
    tf.train.Checkpoint(model=model).read(os.path.join(source, "checkpoints", "ckpt-20")).expect_partial()
    assert {v.path for v in model.weights} == set(trained) == {"hidden_0/kernel", "hidden_0/bias", "logits/kernel",
                                                               "logits/bias"}
    for i, variable in enumerate(model.trainable_variables):
        stored = reader.get_tensor(f"optimizer/_trainable_variables/{i}/.ATTRIBUTES/VARIABLE_VALUE")
        assert np.array_equal(stored, trained[variable.path]) and np.array_equal(stored, variable.numpy())


def test_two_eval_sets_and_ema_figures_side_by_side(tmp_path):
    workdir = str(tmp_path / "run")
    results = train.train_and_evaluate(mlp(**{"dataset.train_eval_examples": 200, "optimizer.ema": True,
                                              "optimizer.ema_momentum": 0.9}), workdir)
    at_40 = {e["split"]: e for e in read_metrics(workdir) if e["step"] == 40 and e["split"].startswith("eval")}
    print({split: round(e["accuracy"], 4) for split, e in at_40.items()})
    assert set(at_40) == {"eval", "eval_train", "eval_ema", "eval_train_ema"}
    assert at_40["eval"]["examples"] == 359 and at_40["eval_train"]["examples"] == 200
    assert at_40["eval"]["loss"] != at_40["eval_ema"]["loss"]  # two sets of weights
    assert all(os.path.isdir(os.path.join(workdir, "summaries", s)) for s in at_40)
    assert results == {k: v for k, v in evals(workdir, "eval_ema")[100].items() if k not in ("step", "split")}


def test_periodic_ema_eval_leaves_training_bitwise_unchanged(tmp_path):
    """Swapping the averages in and out is exact: a run with periodic EMA evals trains the same weights."""
    ema = {"optimizer.ema": True, "optimizer.ema_momentum": 0.9, "train.steps": 40}
    with mwloop.Trainer(mlp(**ema), str(tmp_path / "a")) as a:
        a.train()
    with mwloop.Trainer(mlp(**dict(ema, **{"train.eval_every_steps": 0})), str(tmp_path / "b")) as b:
        b.train()
    assert a.last_eval_step == 40 and all(np.array_equal(x.numpy(), y.numpy())
                                          for x, y in zip(a.state.model.weights, b.state.model.weights))


@pytest.mark.parametrize("overrides, message", [
    ({"actions": ("tests.nope:Action",)}, r"config.actions='tests.nope:Action' does not resolve"),
    ({"actions": ("json:dumps",)}, r"config.actions has 'json:dumps', which is not a subclass of mwloop.Action"),
    ({"early_stopping.metric": "test/accuracy"}, r"no eval produces split 'test'; this run evaluates eval"),
    ({"early_stopping.metric": "accuracy"}, r"name an eval metric as 'SPLIT/NAME'"),
    ({"early_stopping.metric": "eval/acc"}, r"the eval produced accuracy, examples, loss under 'eval'"),
    ({"early_stopping.metric": "eval/loss", "early_stopping.patience": 0}, r"patience=0"),
    ({"best_checkpoint.metric": "eval/loss", "best_checkpoint.mode": "lowest"},
     r"config.best_checkpoint.mode='lowest'; use one of max, min"),
    ({"eval.checkpoint": "best"}, None),
])
def test_bad_action_settings_are_one_line_errors(tmp_path, overrides, message):
    if message is None:  # --mode=eval of the best checkpoint of a run that kept none
        train.train_and_evaluate(mlp(**{"train.steps": 10}), str(tmp_path), mode="train")
        with pytest.raises(UserError, match=r"no best checkpoint in .*best_checkpoint; set "
                                            r"config.best_checkpoint.metric"):
            train.train_and_evaluate(mlp(**overrides), str(tmp_path), mode="eval")
        return
    with pytest.raises(UserError, match=message) as error:
        train.train_and_evaluate(mlp(**overrides), str(tmp_path))
    assert "\n" not in str(error.value)


def test_early_stopping_in_train_mode_is_refused():
    with pytest.raises(UserError, match=r"early_stopping.metric='eval/loss' needs evals during training"):
        actions.built_in(mlp(**{"early_stopping.metric": "eval/loss"}), evaluate=False)


def test_two_workers_user_actions_early_stopping_and_second_based_checkpoints(tmp_path):
    """Through the launcher: a chief-only action (every ~0 s) runs on the chief only, an all-workers one
    (every 20 steps) on both; early stopping stops both workers at the same step, which then saves,
    exports and says why; checkpoints every few milliseconds by the chief's clock never desynchronise
    the workers' saves (a collective)."""
    config_file = tmp_path / "config.py"
    config_file.write_text(
        "from mwloop.config.base import load\n\n\n"
        "def get_config(arg=None):\n"
        f"    c = load({os.path.join(ROOT, 'configs', 'mlp.py')!r})\n"
        "    c.weight_norm_every_secs = 0.001\n"
        "    return c\n")
    workdir = tmp_path / "run"
    overrides = {"train.steps": 200, "train.steps_per_loop": 10, "train.log_every_steps": 20,
                 "train.eval_every_steps": 20, "train.checkpoint_every_steps": 0, "train.checkpoint_every_secs": 0.001,
                 "early_stopping.metric": "eval/accuracy", "early_stopping.mode": "max",
                 "early_stopping.min_delta": 1.0, "early_stopping.patience": 2,
                 "actions": '("examples.actions:LogWeightNorm","examples.actions:RecordSteps")'}
    env = warm_main.serving(dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", GCE_METADATA_IP="127.0.0.1:9"))
    run = subprocess.run([sys.executable, "-m", "mwloop.launch", "--num_workers=2", "--", f"--config={config_file}",
                          f"--workdir={workdir}", *(f"--config.{k}={v}" for k, v in overrides.items())],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-5000:]
    for worker in (0, 1):
        assert re.search(rf"\[worker {worker}\] .*stopping at step 60: early stopping", run.stderr), worker
        with open(workdir / f"steps-{worker}.txt") as f:
            assert [json.loads(line)["step"] for line in f] == [20, 40, 60]
    norms = re.findall(r"\[worker (\d)\] .*weight norm", run.stderr)
    assert len(norms) >= 3 and set(norms) == {"0"}, norms  # the chief only
    events = read_metrics(workdir)
    stop = [e for e in events if e["split"] == "stop"]
    print(stop)
    assert stop == [{"step": 60, "split": "stop", "reason": stop[0]["reason"]}]
    assert "has not improved by more than 1 for 2 evals" in stop[0]["reason"]
    assert max(e["step"] for e in events) == 60 and any(e["split"] == "weights" for e in events)
    assert os.path.exists(workdir / "checkpoints" / "ckpt-60.index") and os.path.isdir(workdir / "export")
    saves = len([1 for f in os.listdir(workdir / "checkpoints") if f.endswith(".index")])
    assert saves == 3  # max_to_keep of the many second-based saves
