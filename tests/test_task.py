"""The Task seam: user tasks outside mwloop/ train, resume, export; N replicas equal 1; bad tasks fail in one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import mwloop
import mwloop.testing
from configs import regression as regression_config
from examples.regression import Regression
from mwloop import task as task_lib
from mwloop import testing
from mwloop.config import base as config_base
from mwloop.run import train
from tests import warm_main
from tests.helpers import ROOT, load_config, read_metrics

EXAMPLES = os.path.join(ROOT, "examples")


def quickstart_config(**overrides):
    config = config_base.load(os.path.join(EXAMPLES, "quickstart.py"))
    config.update_from_flattened_dict({"distribution.strategy": "default", **overrides})
    return config


def main(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3")
    return warm_main.run(list(args), env=env, timeout=timeout)


# ---------------------------------------------------------------------------- user tasks train

@pytest.mark.slow
def test_a_task_defined_in_its_config_file_trains_resumes_and_serves(tmp_path):
    workdir = str(tmp_path / "run")
    results = train.train_and_evaluate(quickstart_config(), workdir)
    assert results["examples"] == 114 and results["accuracy"] > 0.9
    first_train = next(e for e in read_metrics(workdir) if e["split"] == "train")
    assert {"loss", "accuracy", "examples_per_sec"} <= set(first_train)
    exported = tf.saved_model.load(os.path.join(workdir, "export", "latest"))
    task = task_lib.resolve(quickstart_config().task, quickstart_config())
    evaluation = task.eval_arrays()
    logits = exported.serve(evaluation["inputs"]).numpy()[:, 0]
    assert ((logits > 0) == (evaluation["label"] > 0.5)).mean() == pytest.approx(results["accuracy"], abs=1e-9)
    again = train.train_and_evaluate(quickstart_config(), workdir)  # resumes at the end: nothing to train
    assert again["accuracy"] == results["accuracy"]


@pytest.mark.slow
def test_regression_reports_r2_from_sums_and_resumes_exactly(tmp_path):
    config = load_config("regression", **{"distribution.strategy": "default", "deterministic": True})
    results = train.train_and_evaluate(config, str(tmp_path / "full"))
    assert results["r2"] > 0.4 and results["examples"] == 88
    assert results["mse"] == pytest.approx(results["loss"], rel=1e-6)  # the loss is the squared error
    # R^2 over the eval set, from the exported model, as scikit-learn would compute it.
    task = task_lib.resolve(config.task, config)
    evaluation = task.eval_arrays()
    exported = tf.saved_model.load(str(tmp_path / "full" / "export" / "latest"))  # held: a temporary's variables die
    predictions = exported.serve(evaluation["inputs"]).numpy()[:, 0]
    residual = np.sum((predictions - evaluation["target"]) ** 2)
    total = np.sum((evaluation["target"] - evaluation["target"].mean()) ** 2)
    assert 1 - residual / total == pytest.approx(results["r2"], abs=1e-5)


@pytest.mark.slow
def test_regression_resumed_mid_run_ends_bitwise_equal(tmp_path):
    config = load_config("regression", **{"distribution.strategy": "default", "deterministic": True,
                                          "train.eval_every_steps": 0, "export": False})
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    train.train_and_evaluate(config, str(full), mode="train")
    (resumed / "checkpoints").mkdir(parents=True)
    for path in (full / "checkpoints").glob("ckpt-200.*"):  # what a run killed before step 400 had saved
        shutil.copy(path, resumed / "checkpoints")
    train.train_and_evaluate(config, str(resumed), mode="train")
    want, got = (tf.train.load_checkpoint(str(d / "checkpoints" / "ckpt-400")) for d in (full, resumed))
    names = [n for n in want.get_variable_to_shape_map() if n.startswith(("model/", "optimizer/"))]
    assert len(names) >= 8
    for name in names:
        np.testing.assert_array_equal(got.get_tensor(name), want.get_tensor(name), err_msg=name)


@pytest.mark.slow
def test_two_workers_train_a_task_defined_in_its_config_file(tmp_path):
    workdir = tmp_path / "run"
    env = warm_main.serving(dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3", GCE_METADATA_IP="127.0.0.1:9"))
    proc = subprocess.run([sys.executable, "-m", "mwloop.launch", "--num_workers=2", "--",
                           "--config=examples/quickstart.py", f"--workdir={workdir}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = [e for e in read_metrics(str(workdir)) if e["split"] == "eval"][-1]
    assert final["step"] == 300 and final["examples"] == 114 and final["accuracy"] > 0.9
    assert "[worker 1]" in proc.stderr + proc.stdout and (workdir / "checkpoints" / "ckpt-300.index").exists()


@pytest.mark.slow
def test_sequence_model_learns_the_additions(tmp_path):
    config = load_config("sequence", **{"distribution.strategy": "default", "train.steps": 300,
                                        "train.log_every_steps": 100, "train.eval_every_steps": 300,
                                        "train.checkpoint_every_steps": 300, "dataset.train_size": 2048})
    results = train.train_and_evaluate(config, str(tmp_path / "run"))
    assert results["examples"] == 512
    assert results["token_accuracy"] > 0.3, results  # chance is 1/14; the most common token 0.12
    assert results["perplexity"] == pytest.approx(np.exp(results["loss"]), rel=1e-6)


@pytest.mark.slow
def test_mirrored_two_replicas_train_a_user_task(tmp_path, mirrored_strategy):
    config = quickstart_config(**{"distribution.strategy": "mirrored"})
    results = train.train_and_evaluate(config, str(tmp_path / "run"), strategy=mirrored_strategy)
    assert results["examples"] == 114 and results["accuracy"] > 0.9


# ---------------------------------------------------------------------------- N replicas equal 1

@pytest.mark.slow
def test_two_replicas_train_like_one():
    """docs/tasks.md's user test, as written there."""
    task = Regression(regression_config.get_config())
    batch = {k: v[:32] for k, v in task.train_arrays().items()}  # a global batch of 32
    figures = mwloop.testing.assert_replicas_agree(task, batch, num_replicas=2, num_steps=3)
    assert figures["loss"] < 1e-5  # every reported metric agrees too (figures["r2"], ...)
    assert mwloop.testing.assert_loss_scaled_by_global_batch(task, batch, num_replicas=2) < 1e-6


def uneven_padding_batch(task) -> dict[str, np.ndarray]:
    """A global batch whose first half (replica 0) holds short sequences, the second half long ones."""
    tokens = task.train_arrays()["tokens"]
    lengths = (tokens != 0).sum(1)
    short, long = tokens[lengths <= 8][:8], tokens[lengths >= 12][:8]
    assert len(short) == len(long) == 8
    return {"tokens": np.concatenate([short, long])}


@pytest.mark.slow
def test_sequence_loss_is_normalised_by_the_global_token_count_whatever_the_padding():
    """The classic bug -- each replica dividing by its own token count -- would weigh replica 0's few
    tokens as much as replica 1's many; mwloop divides by the global count (one all-reduce)."""
    # SGD: Adam divides by the gradient's own scale, so a gradient that is zero in theory (the attention's
    # key bias) turns float noise of 1e-9 into full-size steps of either sign.
    config = load_config("sequence", **{"dataset.train_size": 512, "model.num_layers": 1, "optimizer.name": "sgd",
                                        "optimizer.learning_rate": 0.1, "optimizer.schedule": "constant",
                                        "optimizer.warmup_steps": 0, "optimizer.momentum": 0.0})
    task = task_lib.resolve(config.task, config)
    batch = uneven_padding_batch(task)
    weights = (batch["tokens"][:, 1:] != 0).sum(1)
    assert weights[:8].sum() * 1.4 < weights[8:].sum(), "the replicas' shards must differ in padding"
    figures = testing.assert_replicas_agree(task, batch, num_replicas=2, num_steps=2, rtol=1e-6)
    assert set(figures) >= {"weights", "loss", "token_accuracy", "perplexity"}
    assert testing.assert_loss_scaled_by_global_batch(task, batch) < 1e-6

    class PerReplicaTokenMean(type(task)):
        """The bug, written on purpose: each replica's mean over its own real tokens (then averaged)."""
        loss_normalization = "batch"

        def loss(self, batch, outputs):
            losses, weights = super().loss(batch, outputs)
            return losses * tf.cast(tf.size(weights), tf.float32) / tf.reduce_sum(weights), weights

    with pytest.raises(AssertionError, match="2 replicas differ from 1"):
        testing.assert_replicas_agree(PerReplicaTokenMean(config), batch, num_replicas=2, rtol=1e-6)
    with pytest.raises(AssertionError, match="not scaled by the global count"):
        testing.assert_loss_scaled_by_global_batch(PerReplicaTokenMean(config), batch)


# ---------------------------------------------------------------------------- a custom step

class TwoOptimizers(task_lib.Task):
    """A custom train step: the hidden layer by the run's optimizer, the head by a second one (checkpointed)."""

    def train_arrays(self):
        rng = np.random.default_rng(0)
        x = rng.standard_normal((64, 4)).astype(np.float32)
        return {"inputs": x, "target": x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32)}

    def build_model(self):
        model = keras.Sequential([keras.Input((4,), name="inputs"), keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.Dense(1)])
        self.head_optimizer = keras.optimizers.SGD(0.05)
        self.head_optimizer.build(model.layers[-1].trainable_variables)
        return model

    def checkpoint_items(self):
        return {"head_optimizer": self.head_optimizer}

    def train_step(self, model, optimizer, batch, global_batch_size):
        with tf.GradientTape() as tape:
            losses = tf.square(model(batch["inputs"], training=True)[:, 0] - batch["target"])
            loss, sums = mwloop.weighted_loss(losses, None, global_batch_size)
        body, head = model.layers[0].trainable_variables, model.layers[-1].trainable_variables
        grads = tape.gradient(loss, body + head)
        optimizer.apply_gradients(zip(grads[:len(body)], body))
        self.head_optimizer.apply_gradients(zip(grads[len(body):], head))
        return sums


def two_optimizers_config(**overrides):
    config = config_base.base_config(task=TwoOptimizers)
    config.update_from_flattened_dict({"distribution.strategy": "default", "train.global_batch_size": 16,
                                       "train.steps": 40, "train.steps_per_loop": 10, "train.log_every_steps": 20,
                                       "train.checkpoint_every_steps": 20, "optimizer.schedule": "constant",
                                       "optimizer.learning_rate": 0.05, "optimizer.momentum": 0.0, **overrides})
    return config


def test_a_custom_train_step_with_a_second_optimizer_trains_and_is_checkpointed(tmp_path):
    workdir = str(tmp_path / "run")
    train.train_and_evaluate(two_optimizers_config(), workdir, mode="train")
    losses = [e["loss"] for e in read_metrics(workdir) if e["split"] == "train"]
    assert len(losses) == 2 and losses[1] < losses[0]
    reader = tf.train.load_checkpoint(os.path.join(workdir, "checkpoints", "ckpt-40"))
    iterations = [n for n in reader.get_variable_to_shape_map() if n.startswith("task/head_optimizer/")
                  and "iteration" in n]
    assert iterations and int(reader.get_tensor(iterations[0])) == 40


@pytest.mark.slow
def test_a_custom_train_step_on_two_replicas_equals_one():
    figures = testing.assert_replicas_agree(TwoOptimizers(two_optimizers_config()),
                                            TwoOptimizers(None).train_arrays(), num_replicas=2, num_steps=3)
    assert figures["weights"] < 1e-5


class ManySums(TwoOptimizers):
    """Twelve metric sums: more than the 8 entries the loop's vector used to start with (then it traced again)."""
    train_step = task_lib.Task.train_step

    def loss(self, batch, outputs):
        return tf.square(outputs[:, 0] - batch["target"])

    def metric_sums(self, batch, outputs, weights):
        error = tf.abs(outputs[:, 0] - batch["target"]) * weights
        return {f"error_{p}": tf.reduce_sum(error ** p) for p in range(12)}

    def eval_arrays(self):
        return {k: v[:20] for k, v in self.train_arrays().items()}


@pytest.mark.slow
def test_a_step_with_more_sums_than_the_first_slots_trains_and_evaluates(tmp_path, mirrored_strategy):
    config = two_optimizers_config(**{"distribution.strategy": "mirrored"})
    config.task = ManySums
    results = train.train_and_evaluate(config, str(tmp_path / "run"), strategy=mirrored_strategy)
    assert results["examples"] == 20
    last = [e for e in read_metrics(str(tmp_path / "run")) if e["split"] == "train"][-1]
    assert last["examples"] == 20 * 16 and last["loss"] > 0


# ---------------------------------------------------------------------------- bad tasks: one line each

class NoModel(task_lib.Task):
    def train_arrays(self):
        return {"inputs": np.zeros((8, 2), np.float32)}

    def loss(self, batch, outputs):
        return outputs[:, 0]


class ScalarLoss(TwoOptimizers):
    train_step = task_lib.Task.train_step  # mwloop's step

    def loss(self, batch, outputs):
        return tf.reduce_mean(tf.square(outputs[:, 0] - batch["target"]))


class VectorMetric(ScalarLoss):
    def loss(self, batch, outputs):
        return tf.square(outputs[:, 0] - batch["target"])

    def metric_sums(self, batch, outputs, weights):
        return {"error": tf.abs(outputs[:, 0] - batch["target"]) * weights}


class WrongBatchSize(VectorMetric):
    metric_sums = task_lib.Task.metric_sums

    def train_arrays(self):
        return None

    def train_dataset(self, ctx, *, global_batch_size, seed, start_step):
        data = TwoOptimizers(None).train_arrays()
        return tf.data.Dataset.from_tensor_slices(data).repeat().batch(global_batch_size, drop_remainder=True)


@pytest.mark.parametrize("task, message", [
    (NoModel, "task NoModel does not define build_model"),
    (ScalarLoss, "task ScalarLoss: loss returned a scalar; return per-example values"),
    (VectorMetric, "task VectorMetric: metric_sums sum 'error' has shape (8,); metric sums must be scalars"),
    (WrongBatchSize, "WrongBatchSize.train_dataset yields batches of 16 where the per-replica batch size is 8"),
    ("examples.regresion:Regression", "config.task='examples.regresion:Regression' does not resolve"),
    ("examples.regression:Regresion", "module 'examples.regression' has no 'Regresion'"),
])
def test_a_broken_task_is_a_one_line_error_before_training(tmp_path, mirrored_strategy, task, message):
    config = two_optimizers_config(**{"distribution.strategy": "mirrored"})
    if isinstance(task, str):
        config = load_config("regression", task=task)
    else:
        config.task = task
    workdir = tmp_path / "run"
    with pytest.raises(task_lib.TaskError) as error:
        train.train_and_evaluate(config, str(workdir), strategy=mirrored_strategy)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert not (workdir / "checkpoints").exists() or not os.listdir(workdir / "checkpoints")


@pytest.mark.slow
def test_the_command_line_prints_a_broken_task_in_one_line(tmp_path):
    proc = main("--config=configs/regression.py", "--config.task=examples.regression:Nope",
                f"--workdir={tmp_path / 'run'}")
    assert proc.returncode == 2  # errors.USER_ERROR
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: config.task='examples.regression:Nope' does not resolve: module 'examples.regression' has no "
        "'Nope'; use 'package.module:Class' importable from the working directory or an installed package")


# ---------------------------------------------------------------------------- mistakes in the user's own code

class MaskKeyInEval(Regression):
    """Eval arrays with a key of mwloop's own: "mask" (mwloop's eval padding mask would replace it)."""

    def eval_arrays(self):
        arrays = dict(super().eval_arrays())
        arrays["mask"] = np.ones((len(arrays["target"]), 4), np.float32)
        return arrays


class EvalOnlyTypo(Regression):
    """A mistake that only eval traces (forward with training=False)."""

    def forward(self, model, batch, training):
        return model(batch["inputs"] if training else batch["input"], training=training)


@pytest.mark.parametrize("task, message", [
    (MaskKeyInEval, "MaskKeyInEval.eval_arrays has a key 'mask', which mwloop sets to the eval padding mask"),
    (EvalOnlyTypo, "task EvalOnlyTypo.forward raised KeyError: 'input' at "),
])
def test_an_eval_mistake_is_an_error_before_any_update(tmp_path, task, message):
    """Not after training with nothing saved: the eval step is traced (and eval arrays checked) at start."""
    workdir = tmp_path / "run"
    with pytest.raises(task_lib.TaskError) as error:
        train.train_and_evaluate(regression_config_of(task), str(workdir))
    assert message in str(error.value) and "\n" not in str(error.value)
    assert not workdir.exists()  # refused before anything was written, no update lost


def regression_config_of(task: type, **overrides):
    """configs/regression.py's settings for another task class (a config whose task is the class itself)."""
    config = config_base.base_config(task=task)
    source = regression_config.get_config()
    for key in ("dataset", "model", "train", "eval", "optimizer"):
        config[key] = source[key]
    config.update_from_flattened_dict({"distribution.strategy": "default", **overrides})
    return config


TYPO_CONFIG = '''
import tensorflow as tf
from configs import regression
from examples.regression import Regression
from mwloop import base_config


class Typo(Regression):
    def forward(self, model, batch, training):
        return {"value": model(batch["inputs"], training=training)[:, 0]}

    def loss(self, batch, outputs):
        return tf.square(outputs["valeu"] - batch["target"])


def get_config(arg=None):
    config, source = base_config(task=Typo), regression.get_config()
    for key in ("dataset", "model", "train", "eval", "optimizer"):
        config[key] = source[key]
    config.distribution.strategy = "default"
    return config
'''


@pytest.mark.slow
def test_a_typo_in_the_loss_is_one_line_naming_method_line_and_keys(tmp_path):
    path = tmp_path / "typo_config.py"
    path.write_text(TYPO_CONFIG)
    proc = main(f"--config={path}", f"--workdir={tmp_path / 'run'}")
    assert proc.returncode == 2, proc.stderr[-2000:]  # errors.USER_ERROR
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: task Typo.loss raised KeyError: 'valeu' at ")
    assert f"{path}:13 (return tf.square(outputs[\"valeu\"] - batch[\"target\"]))" in last
    assert "outputs has keys ['value']" in last and "batch has keys ['inputs', " in last
    assert "Traceback" not in proc.stderr
