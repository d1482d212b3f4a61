"""train_and_evaluate end to end on configs/mlp.py: outputs, resume, clear errors."""

import logging as pylogging
import os
import shutil

import numpy as np
import pytest
import tensorflow as tf

from mwloop import data
from mwloop.errors import UserError
from mwloop.run import train
from tests import warm_main
from tests.helpers import ROOT, load_config, read_metrics


def mlp_config(**overrides):
    return load_config("mlp", **{"distribution.strategy": "default", **overrides})


def weights(workdir: str, step: int) -> dict[str, np.ndarray]:
    reader = tf.train.load_checkpoint(os.path.join(workdir, "checkpoints", f"ckpt-{step}"))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
            if name.startswith(("model/", "optimizer/", "step/"))}


@pytest.mark.slow
def test_train_and_evaluate_writes_outputs(tmp_path):
    workdir = str(tmp_path / "run")
    results = train.train_and_evaluate(mlp_config(), workdir)
    assert results["accuracy"] > 0.85 and results["examples"] == 359
    assert sorted(os.listdir(workdir)) == [".lock", "checkpoints", "config.json", "export", "metrics.jsonl",
                                           "summaries"]
    assert sorted(os.listdir(os.path.join(workdir, "summaries"))) == ["eval", "goodput", "train"]
    events = read_metrics(workdir)
    train_events = [e for e in events if e["split"] == "train"]
    eval_events = [e for e in events if e["split"] == "eval"]
    assert [e["step"] for e in train_events] == [50, 100, 150, 200]
    assert [e["step"] for e in eval_events] == [100, 200]
    for event in train_events:
        assert {"loss", "accuracy", "examples_per_sec", "learning_rate"} <= set(event)
        assert event["examples_per_sec"] > 0 and event["examples"] == 50 * 64
    assert eval_events[-1]["accuracy"] == results["accuracy"]
    assert tf.train.latest_checkpoint(os.path.join(workdir, "checkpoints")).endswith("ckpt-200")


@pytest.mark.slow
def test_resume_continues_to_the_same_end(tmp_path, caplog):
    """A run stopped at step k and rerun ends with the weights of an uninterrupted run."""
    config = mlp_config(**{"train.checkpoint_every_steps": 60, "train.max_to_keep": 10, "deterministic": True,
                           "train.eval_every_steps": 0})
    full = str(tmp_path / "full")
    train.train_and_evaluate(config, full, mode="train")
    # The interrupted run: only what the full run had saved at step 60 survives.
    stopped = str(tmp_path / "stopped")
    os.makedirs(os.path.join(stopped, "checkpoints"))
    for name in os.listdir(os.path.join(full, "checkpoints")):
        if name.startswith("ckpt-60."):
            shutil.copy(os.path.join(full, "checkpoints", name), os.path.join(stopped, "checkpoints"))
    with open(os.path.join(stopped, "checkpoints", "checkpoint"), "w") as f:
        f.write('model_checkpoint_path: "ckpt-60"\nall_model_checkpoint_paths: "ckpt-60"\n')
    with caplog.at_level(pylogging.INFO, logger="absl"):
        train.train_and_evaluate(config, stopped, mode="train")
    assert "resumed from step 60" in caplog.text
    want, got = weights(full, 200), weights(stopped, 200)
    assert want.keys() == got.keys() and len(want) >= 9  # kernels, biases, momenta, iterations, step
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)

    caplog.clear()
    with caplog.at_level(pylogging.INFO, logger="absl"):
        train.train_and_evaluate(config, stopped, mode="train")
    assert "nothing to train" in caplog.text
    assert tf.train.latest_checkpoint(os.path.join(stopped, "checkpoints")).endswith("ckpt-200")


@pytest.mark.slow
def test_mirrored_two_replicas_trains(tmp_path, mirrored_strategy):
    config = mlp_config(**{"distribution.strategy": "mirrored", "train.steps": 60, "train.eval_every_steps": 0})
    results = train.train_and_evaluate(config, str(tmp_path / "run"), strategy=mirrored_strategy)
    assert results["examples"] == 359 and results["accuracy"] > 0.5


def test_batch_that_does_not_divide_is_an_error_before_anything_is_written(tmp_path, mirrored_strategy):
    workdir = str(tmp_path / "run")
    config = mlp_config(**{"distribution.strategy": "mirrored", "train.global_batch_size": 63})
    with pytest.raises(ValueError, match=r"global_batch_size=63 does not divide among 2 replicas"):
        train.train_and_evaluate(config, workdir, strategy=mirrored_strategy)
    assert not os.path.exists(workdir)


def test_missing_data_dir_is_an_error(tmp_path):
    config = mlp_config(**{"dataset.data_dir": str(tmp_path / "nope")})
    with pytest.raises(UserError, match="does not exist"):
        train.train_and_evaluate(config, str(tmp_path / "run"))


@pytest.mark.slow
def test_main_reports_unknown_config_key_in_one_line(tmp_path):
    workdir = tmp_path / "run"
    proc = warm_main.run(["--config=configs/mlp.py", f"--workdir={workdir}", "--config.train.stepz=3"], timeout=120)
    assert proc.returncode == 2  # errors.USER_ERROR
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: unknown config key 'stepz' (did you mean 'steps'?)"), proc.stderr
    assert not workdir.exists()


@pytest.mark.slow
def test_main_without_workdir_trains_in_runs_config_name(tmp_path):
    """README's first command gives no --workdir: the run goes to runs/<config.name> under the current folder."""
    proc = warm_main.run([f"--config={os.path.join(ROOT, 'configs', 'mlp.py')}", "--config.train.steps=20",
                          "--config.train.steps_per_loop=10", "--config.export=False"],
                         cwd=str(tmp_path), env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert os.path.exists(tmp_path / "runs" / "mlp" / "checkpoints" / "ckpt-20.index")


@pytest.mark.slow
def test_exported_model_predicts_like_the_trained_model(tmp_path):
    workdir = str(tmp_path / "run")
    config = mlp_config(**{"train.steps": 100})
    results = train.train_and_evaluate(config, workdir)
    exported = tf.saved_model.load(os.path.join(workdir, "export", "100"))  # TF Serving's <base>/<version>
    source = data.get_source(config.dataset)
    evaluation = next(iter(source.eval_dataset_fn(1000)(tf.distribute.InputContext())))
    probabilities = exported.serve(evaluation["image"]).numpy()
    assert probabilities.shape == (1000, 10)
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-5)
    correct = (probabilities.argmax(1) == evaluation["label"].numpy()) * evaluation["mask"].numpy()
    assert correct.sum() / evaluation["mask"].numpy().sum() == pytest.approx(results["accuracy"], abs=1e-9)

    images = tf.reshape(evaluation["image"][:4], (4, 8, 8, 1))
    encoded = tf.stack([tf.io.encode_png(tf.cast(tf.round(image * 255.0), tf.uint8)) for image in images])
    from_bytes = exported.serve_bytes(encoded).numpy()
    np.testing.assert_allclose(from_bytes, probabilities[:4], atol=0.02)
    assert (from_bytes.argmax(1) == probabilities[:4].argmax(1)).all()
