"""Mistakes in a config, a workdir or the data: one clear error before anything is trained or written."""

from __future__ import annotations

import json
import os

import pytest

from mwloop.artifacts import checkpoint
from mwloop.errors import UserError
from mwloop.run import train
from mwloop.task import TaskError
from tests.helpers import load_config


def mlp_config(**overrides):
    return load_config("mlp", **{"distribution.strategy": "default", "train.steps": 40,
                                 "train.log_every_steps": 20, "train.eval_every_steps": 40,
                                 "train.checkpoint_every_steps": 40, **overrides})


@pytest.mark.parametrize("overrides, message", [
    ({"train.steps": 0}, "config.train.steps=0; train for at least 1 step"),
    ({"train.steps": -5}, "config.train.steps=-5"),
    ({"train.steps_per_loop": 0}, "config.train.steps_per_loop=0"),
    ({"train.eval_every_steps": -1}, "config.train.eval_every_steps=-1"),
    ({"dataset.eval_fraction": 1.0}, "config.dataset.eval_fraction=1.0 leaves no training examples"),
    ({"dataset.eval_fraction": 0.0}, "eval_arrays has 0 examples: there is nothing to evaluate"),
])
def test_config_mistakes_fail_before_anything_is_written(tmp_path, overrides, message):
    workdir = tmp_path / "run"
    with pytest.raises((ValueError, TaskError)) as error:
        train.train_and_evaluate(mlp_config(**overrides), str(workdir))
    assert message in str(error.value) and "\n" not in str(error.value)
    assert not (workdir / "config.json").exists() and not (workdir / "checkpoints").exists()


@pytest.mark.slow
def test_no_eval_set_is_fine_for_a_training_run(tmp_path):
    assert train.train_and_evaluate(mlp_config(**{"dataset.eval_fraction": 0.0}), str(tmp_path / "run"),
                                    mode="train") == {}


@pytest.mark.parametrize("mode", ["export", "eval"])
def test_export_and_eval_of_an_empty_workdir_are_errors(tmp_path, mode):
    with pytest.raises(checkpoint.CheckpointError, match=f"--mode={mode}: no checkpoint in .* train first"):
        train.train_and_evaluate(mlp_config(), str(tmp_path / "typo"), mode=mode)
    assert not (tmp_path / "typo" / "export").exists()


def test_export_of_the_initial_weights_when_asked(tmp_path):
    train.train_and_evaluate(mlp_config(export_untrained=True), str(tmp_path / "run"), mode="export")
    assert (tmp_path / "run" / "export" / "0" / "saved_model.pb").exists()


@pytest.mark.slow
def test_continuous_eval_of_another_model_is_an_error_not_a_silent_eval(tmp_path):
    workdir = str(tmp_path / "run")
    train.train_and_evaluate(mlp_config(), workdir, mode="train")
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        trained = f.read()
    other = mlp_config(**{"model.hidden": (32, 16), "eval.continuous_timeout_s": 5.0})
    # Named before any checkpoint is read: the settings differ from the run's config.json (mwloop.cluster.agreement)
    with pytest.raises(UserError, match=r"the evaluator runs another run than the chief: model.hidden=\[32, 16\] "
                                        r"here, \[32\] in .*config.json"):
        train.train_and_evaluate(other, workdir, mode="continuous_eval")
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        assert f.read() == trained, "nothing may be appended to the run's metrics"


def test_continuous_eval_that_saw_no_checkpoint_is_an_error(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match="saw no checkpoint"):
        train.train_and_evaluate(mlp_config(**{"eval.continuous_timeout_s": 1.0}), str(tmp_path / "empty"),
                                 mode="continuous_eval")


def test_an_unwritable_checkpoint_directory_fails_at_start(tmp_path):
    """A path that cannot be a directory (here a file; a read-only mount alike) fails before training."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").write_text("not a directory")
    with pytest.raises(checkpoint.CheckpointError, match="cannot write checkpoints to .*checkpoints"):
        train.train_and_evaluate(mlp_config(), str(tmp_path / "run"))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_a_failed_save_names_its_cause_and_keeps_the_earlier_checkpoint(tmp_path, monkeypatch):
    workdir = tmp_path / "run"
    train.train_and_evaluate(mlp_config(), str(workdir), mode="train")
    original = checkpoint.Checkpointer._save

    def full_disk(self, step):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(checkpoint.Checkpointer, "_save", full_disk)
    with pytest.raises(checkpoint.CheckpointError) as error:
        longer = mlp_config(**{"train.steps": 80, "train.allow_changed": "train.steps"})
        train.train_and_evaluate(longer, str(workdir), mode="train")
    assert "saving the checkpoint of step 80" in str(error.value) and "No space left on device" in str(error.value)
    assert "resumes from ckpt-40" in str(error.value)
    monkeypatch.setattr(checkpoint.Checkpointer, "_save", original)
    assert checkpoint.saved_checkpoints(str(workdir / "checkpoints"))[0].endswith("ckpt-40")


def test_another_models_keys_are_named(tmp_path):
    config = load_config("resnet", "imagenet", **{"model.name": "resnet_small"})
    from mwloop import models
    with pytest.raises(ValueError, match=r"config.model has blocks, bn_momentum, width, which model 'resnet_small' "
                                         r"does not take \(it takes blocks_per_stage, sync_batch_norm, widths\)"):
        models.build(config.model, input_shape=(32, 32, 3), num_classes=10, weight_decay=0.0)


@pytest.mark.slow
def test_eval_keeps_the_trained_runs_config_on_record(tmp_path):
    """--mode=eval with other settings must not rewrite config.json: the next resume compares against it."""
    workdir = str(tmp_path / "run")
    train.train_and_evaluate(mlp_config(**{"train.steps": 20}), workdir, mode="train")
    train.train_and_evaluate(mlp_config(**{"train.steps": 20, "train.global_batch_size": 32}), workdir, mode="eval")
    with open(os.path.join(workdir, "config.json")) as f:
        assert json.load(f)["train"]["global_batch_size"] == 64
