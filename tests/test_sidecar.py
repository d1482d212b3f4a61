"""Side-car evaluation beside a training process, and the evaluator task of TF_CONFIG."""

import json
import os
import subprocess

import pytest

from mwloop.run import train
from tests import warm_main
from tests.helpers import load_config, read_metrics

pytestmark = pytest.mark.slow  # mwloop.main processes, and a training run beside the side-car

TRAIN_ARGS = ["--config=configs/mlp.py", "--mode=train", "--config.train.steps=3000",
              "--config.train.steps_per_loop=10", "--config.train.checkpoint_every_steps=500",
              "--config.train.max_to_keep=10", "--config.distribution.strategy=default"]


def test_continuous_eval_evaluates_new_checkpoints_until_the_last(tmp_path):
    workdir = str(tmp_path / "run")
    trainer = warm_main.popen([f"--workdir={workdir}"] + TRAIN_ARGS, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        config = load_config("mlp", **{"train.steps": 3000, "eval.continuous_timeout_s": 120.0,
                                       "distribution.strategy": "default"})
        results = train.train_and_evaluate(config, workdir, mode="continuous_eval")
    finally:
        assert trainer.wait(timeout=120) == 0
    steps = [e["step"] for e in read_metrics(workdir) if e["split"] == "eval"]
    assert steps[-1] == 3000 and steps == sorted(set(steps)), steps
    assert set(steps) <= set(range(500, 3001, 500))
    assert results["examples"] == 359 and results["accuracy"] > 0.9


def test_evaluator_task_runs_the_side_car(tmp_path):
    """An `evaluator` task in TF_CONFIG evaluates instead of training (here: a finished run)."""
    workdir = str(tmp_path / "run")
    # The finished run, trained here (no TensorFlow start-up): the evaluator task is what runs as a process.
    train.train_and_evaluate(load_config("mlp", **{"train.steps": 200, "distribution.strategy": "default"}), workdir,
                             mode="train")
    tf_config = {"cluster": {"chief": ["localhost:1"], "worker": ["localhost:2"], "evaluator": ["localhost:3"]},
                 "task": {"type": "evaluator", "index": 0}}
    proc = warm_main.run([f"--workdir={workdir}", "--config=configs/mlp.py", "--config.train.steps=200"],
                         timeout=120, env=dict(os.environ, TF_CONFIG=json.dumps(tf_config)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "continuous_eval with" in proc.stderr and "eval of ckpt-200 at step 200" in proc.stderr


def test_continuous_eval_stops_when_the_trainer_is_gone_before_train_steps(tmp_path, caplog):
    """A trainer that ended early (early stopping, an error, a kill): its lock is free, no checkpoint comes."""
    import time
    workdir = str(tmp_path / "run")
    short = {"train.steps": 40, "train.steps_per_loop": 10, "train.checkpoint_every_steps": 20,
             "train.eval_every_steps": 0, "distribution.strategy": "default", "export": False}
    train.train_and_evaluate(load_config("mlp", **short), workdir, mode="train")
    waiting = load_config("mlp", **dict(short, **{"train.steps": 2000, "eval.trainer_gone_s": 1.0}))
    started = time.monotonic()
    with caplog.at_level("INFO", logger="absl"):
        results = train.train_and_evaluate(waiting, workdir, mode="continuous_eval")
    assert time.monotonic() - started < 30 and "the trainer is gone" in caplog.text
    assert results["examples"] == 359
    assert [e["step"] for e in read_metrics(workdir) if e["split"] == "eval"] == [40]
