"""Fault tolerance on one process: preemption, NaN losses, broken checkpoints, the workdir lock."""

import json
import logging as pylogging
import os
import random
import signal
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from mwloop.artifacts import checkpoint, resume_check, workdir_lock
from mwloop.run import train
from tests import warm_main
from tests.helpers import ROOT, load_config, read_metrics


def mlp_config(**overrides):
    return load_config("mlp", **{"distribution.strategy": "default", "train.eval_every_steps": 0, **overrides})


def checkpoint_weights(prefix: str) -> dict[str, np.ndarray]:
    """The model's weights, the optimizer's slots and the step (Keras 3 keeps the trainable weights under
    optimizer/_trainable_variables: "model/" alone would hold no MLP weight)."""
    reader = tf.train.load_checkpoint(prefix)
    return {n: reader.get_tensor(n) for n in reader.get_variable_to_shape_map()
            if n.startswith(("model/", "optimizer/", "step/"))}


@pytest.mark.slow
def test_nan_loss_fails_naming_the_step_and_saves_nothing_after_it(tmp_path):
    workdir = str(tmp_path / "run")
    with pytest.raises(FloatingPointError, match="non-finite loss at step 130;"):
        train.train_and_evaluate(mlp_config(nan_at_steps=(130,)), workdir)
    saved = checkpoint.saved_checkpoints(os.path.join(workdir, "checkpoints"))
    assert [os.path.basename(p) for p in saved] == ["ckpt-100"]
    for name, value in checkpoint_weights(saved[0]).items():
        assert np.all(np.isfinite(value)), name


@pytest.mark.slow
def test_nan_loss_skip_skips_and_counts_the_update(tmp_path):
    workdir = str(tmp_path / "run")
    results = train.train_and_evaluate(mlp_config(nan_at_steps=(57, 130), on_nonfinite="skip"), workdir)
    assert results["accuracy"] > 0.85
    final = [e for e in read_metrics(workdir) if e["split"] == "train"][-1]
    assert final["step"] == 200 and final["skipped_nonfinite"] == 2 and np.isfinite(final["loss"])
    for name, value in checkpoint_weights(os.path.join(workdir, "checkpoints", "ckpt-200")).items():
        assert np.all(np.isfinite(value)), name


@pytest.mark.slow
def test_corrupt_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
    workdir = str(tmp_path / "run")
    train.train_and_evaluate(mlp_config(), workdir, mode="train")
    data_file = os.path.join(workdir, "checkpoints", "ckpt-200.data-00000-of-00001")
    with open(data_file, "r+b") as f:
        f.truncate(os.path.getsize(data_file) // 2)
    with caplog.at_level(pylogging.INFO, logger="absl"):
        longer = mlp_config(**{"train.steps": 300, "train.allow_changed": "train.steps"})
        train.train_and_evaluate(longer, workdir, mode="train")
    assert "ckpt-200 is unreadable" in caplog.text and "falling back to" in caplog.text
    assert "ckpt-100" in caplog.text and "resumed from step 100" in caplog.text
    assert tf.train.latest_checkpoint(os.path.join(workdir, "checkpoints")).endswith("ckpt-300")


@pytest.mark.slow
def test_checkpoint_of_another_model_is_a_clear_error(tmp_path):
    workdir = str(tmp_path / "run")
    train.train_and_evaluate(mlp_config(**{"train.steps": 100}), workdir, mode="train")
    with pytest.raises(checkpoint.CheckpointError, match="does not match this model"):
        train.train_and_evaluate(mlp_config(**{"model.hidden": (16,)}), workdir, mode="train")


@pytest.mark.slow
def test_a_live_run_holds_the_workdir_and_a_dead_ones_lock_is_taken_over(tmp_path):
    workdir = str(tmp_path / "run")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from mwloop.artifacts import workdir_lock; "
         "h = workdir_lock.acquire(sys.argv[1]); print('locked', flush=True); time.sleep(120)", workdir],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert workdir_lock.is_held(workdir)  # asked without taking it (the side-car's question)
        with pytest.raises(workdir_lock.WorkdirBusyError, match=f"pid {holder.pid}"):
            train.train_and_evaluate(mlp_config(), workdir)
    finally:
        holder.kill()
        holder.wait()
    assert not workdir_lock.is_held(workdir)
    handle = workdir_lock.acquire(workdir)  # the dead run's lock is free
    handle.close()


def _recorded(tmp_path, **overrides) -> str:
    """A workdir whose config.json records the mlp run with `overrides`."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "config.json").write_text(mlp_config(**overrides).to_json_best_effort())
    return str(workdir)


@pytest.mark.parametrize("key, old, new", [
    ("train.global_batch_size", 64, 128), ("train.steps", 200, 400), ("seed", 0, 1),
    ("dataset.eval_fraction", 0.2, 0.3),
    ("optimizer.learning_rate", 0.1, 0.05), ("optimizer.schedule", "cosine", "linear"), ("model.hidden", (32,), (64,)),
    ("train.label_smoothing", 0.0, 0.1), ("mixed_precision", "float32", "mixed_bfloat16")])
def test_a_resume_with_settings_that_change_the_run_is_refused_naming_old_new_and_the_flag(tmp_path, key, old, new):
    workdir = _recorded(tmp_path, **{key: old})
    config = mlp_config(**{key: new})
    with pytest.raises(resume_check.UserError) as error:
        resume_check.check(config, workdir, 100)
    shown = [resume_check.show(v) for v in (list(old) if isinstance(old, tuple) else old,
                                             list(new) if isinstance(new, tuple) else new)]
    assert f"{key}: {shown[0]} -> {shown[1]}" in str(error.value) and f"allow_changed={key}" in str(error.value)
    config.train.allow_changed = key.split(".")[0]  # a prefix allows the keys under it
    resume_check.check(config, workdir, 100)


@pytest.mark.parametrize("key, old, new", [
    ("train.steps_per_loop", 20, 7), ("optimizer.gradient_accumulation_steps", 1, 4), ("train.log_every_steps", 50, 5),
    ("train.eval_every_steps", 100, 0), ("train.checkpoint_every_steps", 100, 30),
    ("distribution.strategy", "auto", "default"), ("early_stopping.patience", 3, 9),
    ("writers", ("tensorboard",), ("tensorboard", "mlflow")), ("export_keep", 3, 5),
    ("train.async_checkpoint", False, True)])  # it changes no update (issue 43)  # MLflow on for a run: caught up
def test_settings_that_do_not_change_the_math_pass(tmp_path, key, old, new):
    resume_check.check(mlp_config(**{key: new}), _recorded(tmp_path, **{key: old}), 100)


def test_train_steps_passes_with_a_constant_schedule_and_a_checkpoint_past_it_is_an_error(tmp_path):
    constant = {"optimizer.schedule": "constant"}
    workdir = _recorded(tmp_path, **constant, **{"train.steps": 200})
    resume_check.check(mlp_config(**constant, **{"train.steps": 500}), workdir, 200)  # same rate at every step
    with pytest.raises(resume_check.UserError, match=r"at step 200, past config.train.steps=100; set "
                                                     r"--config.train.steps=200 or more"):
        resume_check.check(mlp_config(**constant, **{"train.steps": 100}), workdir, 200)


@pytest.mark.slow
def test_an_allowed_change_is_recorded_before_config_json_is_rewritten(tmp_path):
    workdir = str(tmp_path / "run")
    train.train_and_evaluate(mlp_config(**{"train.steps": 40, "train.checkpoint_every_steps": 40}), workdir,
                             mode="train")
    with pytest.raises(resume_check.UserError, match="train.global_batch_size: 64 -> 128"):
        train.train_and_evaluate(mlp_config(**{"train.steps": 40, "train.global_batch_size": 128}), workdir)
    assert json.load(open(os.path.join(workdir, "config.json")))["train"]["global_batch_size"] == 64  # untouched
    train.train_and_evaluate(mlp_config(**{"train.steps": 60, "train.global_batch_size": 128,
                                           "train.allow_changed": "train.global_batch_size,train.steps"}), workdir,
                             mode="train")
    resume = [e for e in read_metrics(workdir) if e["split"] == "resume"]
    assert resume == [{"step": 40, "split": "resume", "changed": {
        "train.global_batch_size": {"old": 64, "new": 128}, "train.steps": {"old": 40, "new": 60}}}]
    assert json.load(open(os.path.join(workdir, "config.json")))["train"]["global_batch_size"] == 128


@pytest.mark.slow
def test_sigterm_saves_at_the_current_step_exits_42_and_resumes_exactly(tmp_path):
    settings = {"train.steps": 3000, "train.steps_per_loop": 10, "train.log_every_steps": 500,
                "train.eval_every_steps": 0, "train.checkpoint_every_steps": 2000, "deterministic": True,
                "distribution.strategy": "default"}
    preempted = str(tmp_path / "preempted")
    args = ["--config=configs/mlp.py", "--mode=train", *(f"--config.{k}={v}" for k, v in settings.items()),
            f"--workdir={preempted}"]
    proc = warm_main.popen(args)
    log = []
    for line in proc.stderr:
        log.append(line)
        if "step 1000/3000" in line:
            proc.send_signal(signal.SIGTERM)
            break
    log += proc.stderr.readlines()
    assert proc.wait(timeout=60) == 42, "".join(log[-20:])
    saved_step = int(checkpoint.saved_checkpoints(os.path.join(preempted, "checkpoints"))[0].rsplit("-", 1)[1])
    assert saved_step >= 1000 and f"saving a checkpoint at step {saved_step}" in "".join(log)

    resumed = warm_main.run(args, timeout=120)
    assert resumed.returncode == 0 and f"resumed from step {saved_step}" in resumed.stderr  # 0 steps lost
    # The uninterrupted run trains here, with the same settings: bitwise the same, without a third start-up.
    uninterrupted = str(tmp_path / "uninterrupted")
    train.train_and_evaluate(mlp_config(**settings), uninterrupted, mode="train")
    want = checkpoint_weights(os.path.join(uninterrupted, "checkpoints", "ckpt-3000"))
    got = checkpoint_weights(os.path.join(preempted, "checkpoints", "ckpt-3000"))
    assert want.keys() == got.keys() and len(want) >= 9  # 4 weights, their momenta, iterations, step
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.slow
def test_sigkill_with_gradient_accumulation_then_restart_ends_bitwise_equal(tmp_path):
    """A worker SIGKILLed at a random step under the launcher (one restart allowed); the resumed run ends with
    the uninterrupted run's weights, bitwise. With k=4 micro-batches per update on 2 workers: a loop call ends on
    an update boundary, so a checkpoint never holds half an accumulation, and the feed resumes at micro-step
    step * k. (The suite's one kill-and-compare trial: the plain update's restart path is the same one, and
    test_multiworker kills and preempts plain runs; `python -m tests.stress.reliability --trials=N` tries more.)"""
    from tests import warm_main
    from tests.stress import reliability
    accumulate = ["--config.optimizer.gradient_accumulation_steps=4"]
    # The launchers fork their warm-start servers from the test's (no TensorFlow import of their own).
    env = warm_main.serving(dict(os.environ))
    reliability.run_uninterrupted(str(tmp_path / "reference"), num_workers=2, extra_args=accumulate, env=env)
    reference = reliability.final_state(str(tmp_path / "reference"))
    kill_step, equal = reliability.trial(str(tmp_path), reference, 2, random.Random(15), extra_args=accumulate,
                                         env=env)
    assert equal, f"killed at step >= {kill_step}: final weights differ from the uninterrupted run"


def test_resume_with_another_number_of_workers(tmp_path):
    """In-memory data resumes with any number of workers; file-backed data refuses."""
    from mwloop.run import state
    from mwloop.tasks.classification import ImageClassification
    config = mlp_config()
    strategy = tf.distribute.get_strategy()
    task = ImageClassification(config)
    run = state.create(config, strategy, task)
    run.input_pipelines.assign(2)  # as if two workers wrote the checkpoint
    state.check_input_pipelines(run, task, strategy)
    assert int(run.input_pipelines.numpy()) == 1
    run.input_pipelines.assign(2)

    class FileBacked(ImageClassification):
        def train_arrays(self):
            return None

    with pytest.raises(ValueError, match=r"written by 2 worker\(s\) and this run has 1; .* run with 2"):
        state.check_input_pipelines(run, FileBacked(config), strategy)


def test_a_lost_peer_is_named_from_the_collective_error():
    from mwloop.cluster import peers
    unhealthy = tf.errors.UnavailableError(None, None, (
        "Collective ops is aborted by: Error reported from /job:worker/task:1: The following tasks are unhealthy "
        "(stopped sending heartbeats):\n/job:worker/replica:0/task:1\nThe tasks have crashed."))
    assert peers.who(unhealthy) == "worker 1"
    line = peers.message(unhealthy, "/nonexistent")
    assert line.startswith("worker 1 stopped answering (UnavailableError") and "\n" not in line


def test_disk_errors_become_one_line_naming_path_cause_and_the_checkpoint_to_resume(tmp_path):
    from mwloop.artifacts import disk
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "ckpt-40.index").write_text("")
    error = tf.errors.ResourceExhaustedError(None, None, "{{function_node __wrapped__SaveV2}} /w/ckpt-60_temp/part; "
                                                         "No space left on device [Op:SaveV2]")
    with pytest.raises(disk.DiskError) as raised, disk.one_line_errors(str(tmp_path)):
        raise error
    assert str(raised.value) == (f"writing to --workdir={tmp_path} failed (/w/ckpt-60_temp/part; No space left on "
                                 f"device): free disk space, make it writable or raise the file-size limit; a rerun "
                                 f"resumes from ckpt-40")
    with pytest.raises(KeyError), disk.one_line_errors(str(tmp_path)):  # anything else keeps its traceback
        raise KeyError("x")


def test_a_label_outside_the_models_classes_is_one_line_naming_it():
    from mwloop.step import graph_checks

    @tf.function
    def step(labels):
        return graph_checks.assert_labels_in_range(labels, 10) * 2

    assert step(tf.constant([0, 9])).numpy().tolist() == [0, 18]
    with pytest.raises(graph_checks.DataCheckError, match=r"^label 12 is outside the model's 10 classes \(0\.\.9\)"), \
            graph_checks.one_line_errors():
        step(tf.constant([3, 12, -1]))


def test_in_memory_labels_are_checked_once_before_training():
    """In-memory labels are checked with numpy when the data loads (the step itself stays as fast as before);
    file-backed labels are checked in the step (test above)."""
    from mwloop.step import graph_checks
    from mwloop.tasks import classification
    classification._check_labels(np.arange(10), 10, "train")
    with pytest.raises(graph_checks.DataCheckError, match=r"^train label 12 is outside the model's 10 classes "
                                                          r"\(0\.\.9\)"):
        classification._check_labels(np.array([1, 12, -1]), 10, "train")
