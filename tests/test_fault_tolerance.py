"""Fault tolerance on one process: preemption, NaN losses, broken checkpoints, the workdir lock."""

import logging as pylogging
import os
import random
import signal
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from mwloop import checkpoint, train, workdir_lock
from tests.helpers import ROOT, load_config, read_metrics


def mlp_config(**overrides):
    return load_config("mlp", **{"distribution.strategy": "default", "train.eval_every_steps": 0, **overrides})


def checkpoint_weights(prefix: str) -> dict[str, np.ndarray]:
    reader = tf.train.load_checkpoint(prefix)
    return {n: reader.get_tensor(n) for n in reader.get_variable_to_shape_map() if n.startswith(("model/", "step/"))}


def test_nan_loss_fails_naming_the_step_and_saves_nothing_after_it(tmp_path):
    workdir = str(tmp_path / "run")
    with pytest.raises(FloatingPointError, match="non-finite loss at step 130;"):
        train.train_and_evaluate(mlp_config(nan_at_steps=(130,)), workdir)
    saved = checkpoint.saved_checkpoints(os.path.join(workdir, "checkpoints"))
    assert [os.path.basename(p) for p in saved] == ["ckpt-100"]
    for name, value in checkpoint_weights(saved[0]).items():
        assert np.all(np.isfinite(value)), name


def test_nan_loss_skip_skips_and_counts_the_update(tmp_path):
    workdir = str(tmp_path / "run")
    results = train.train_and_evaluate(mlp_config(nan_at_steps=(57, 130), on_nonfinite="skip"), workdir)
    assert results["accuracy"] > 0.85
    final = [e for e in read_metrics(workdir) if e["split"] == "train"][-1]
    assert final["step"] == 200 and final["skipped_nonfinite"] == 2 and np.isfinite(final["loss"])
    for name, value in checkpoint_weights(os.path.join(workdir, "checkpoints", "ckpt-200")).items():
        assert np.all(np.isfinite(value)), name


def test_corrupt_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
    workdir = str(tmp_path / "run")
    train.train_and_evaluate(mlp_config(), workdir, mode="train")
    data_file = os.path.join(workdir, "checkpoints", "ckpt-200.data-00000-of-00001")
    with open(data_file, "r+b") as f:
        f.truncate(os.path.getsize(data_file) // 2)
    with caplog.at_level(pylogging.INFO, logger="absl"):
        train.train_and_evaluate(mlp_config(**{"train.steps": 300}), workdir, mode="train")
    assert "ckpt-200 is unreadable" in caplog.text and "falling back to" in caplog.text
    assert "ckpt-100" in caplog.text and "resumed from step 100" in caplog.text
    assert tf.train.latest_checkpoint(os.path.join(workdir, "checkpoints")).endswith("ckpt-300")


def test_checkpoint_of_another_model_is_a_clear_error(tmp_path):
    workdir = str(tmp_path / "run")
    train.train_and_evaluate(mlp_config(**{"train.steps": 100}), workdir, mode="train")
    with pytest.raises(checkpoint.CheckpointError, match="does not match this model"):
        train.train_and_evaluate(mlp_config(**{"model.hidden": (16,)}), workdir, mode="train")


def test_a_live_run_holds_the_workdir_and_a_dead_ones_lock_is_taken_over(tmp_path):
    workdir = str(tmp_path / "run")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from mwloop import workdir_lock; "
         "h = workdir_lock.acquire(sys.argv[1]); print('locked', flush=True); time.sleep(120)", workdir],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(workdir_lock.WorkdirBusyError, match=f"pid {holder.pid}"):
            train.train_and_evaluate(mlp_config(), workdir)
    finally:
        holder.kill()
        holder.wait()
    handle = workdir_lock.acquire(workdir)  # the dead run's lock is free
    handle.close()


def test_sigterm_saves_at_the_current_step_exits_42_and_resumes_exactly(tmp_path):
    overrides = ["--config.train.steps=6000", "--config.train.steps_per_loop=10", "--config.train.log_every_steps=500",
                 "--config.train.eval_every_steps=0", "--config.train.checkpoint_every_steps=2000",
                 "--config.deterministic=True", "--config.distribution.strategy=default"]
    preempted = str(tmp_path / "preempted")
    command = [sys.executable, "-m", "mwloop.main", "--config=configs/mlp.py", "--mode=train"] + overrides
    proc = subprocess.Popen(command + [f"--workdir={preempted}"], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    log = []
    for line in proc.stderr:
        log.append(line)
        if "step 1000/6000" in line:
            proc.send_signal(signal.SIGTERM)
            break
    log += proc.stderr.readlines()
    assert proc.wait(timeout=60) == 42, "".join(log[-20:])
    saved_step = int(checkpoint.saved_checkpoints(os.path.join(preempted, "checkpoints"))[0].rsplit("-", 1)[1])
    assert saved_step >= 1000 and f"saving a checkpoint at step {saved_step}" in "".join(log)

    resumed = subprocess.run(command + [f"--workdir={preempted}"], cwd=ROOT, capture_output=True, text=True,
                             timeout=120)
    assert resumed.returncode == 0 and f"resumed from step {saved_step}" in resumed.stderr  # 0 steps lost
    uninterrupted = str(tmp_path / "uninterrupted")
    subprocess.run(command + [f"--workdir={uninterrupted}"], cwd=ROOT, capture_output=True, timeout=120, check=True)
    want = checkpoint_weights(os.path.join(uninterrupted, "checkpoints", "ckpt-6000"))
    got = checkpoint_weights(os.path.join(preempted, "checkpoints", "ckpt-6000"))
    assert want.keys() == got.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_sigkill_of_a_worker_then_restart_ends_bitwise_equal(tmp_path):
    """Two kill points: a random worker is SIGKILLed at a random step under the launcher
    (one restart allowed); the resumed run ends with the uninterrupted run's weights."""
    from tests.stress import reliability
    rng = random.Random(int(os.environ.get("MWLOOP_KILL_SEED", "0")))
    reliability.run_uninterrupted(str(tmp_path / "reference"), num_workers=2)
    reference = reliability.final_state(str(tmp_path / "reference"))
    for _ in range(2):
        kill_step, equal = reliability.trial(str(tmp_path), reference, 2, rng)
        assert equal, f"killed at step >= {kill_step}: final weights differ from the uninterrupted run"


def test_sigkill_with_gradient_accumulation_then_restart_ends_bitwise_equal(tmp_path):
    """k=4 micro-batches per update on 2 workers: a loop call ends on an update boundary, so a checkpoint
    never holds half an accumulation, and the feed resumes at micro-step step * k."""
    from tests.stress import reliability
    accumulate = ["--config.optimizer.gradient_accumulation_steps=4"]
    reliability.run_uninterrupted(str(tmp_path / "reference"), num_workers=2, extra_args=accumulate)
    reference = reliability.final_state(str(tmp_path / "reference"))
    kill_step, equal = reliability.trial(str(tmp_path), reference, 2, random.Random(15), extra_args=accumulate)
    assert equal, f"killed at step >= {kill_step}: final weights differ from the uninterrupted run"


def test_resume_with_another_number_of_workers(tmp_path):
    """In-memory data resumes with any number of workers; file-backed data refuses."""
    from mwloop import state
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
