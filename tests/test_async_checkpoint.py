"""Asynchronous checkpoints (config.train.async_checkpoint): what is written, and when anything may name it.

The writes are held back by a gate on TensorFlow's writing thread, so each test sees the moment a write is in
flight: the `checkpoint` pointer, the rotation and mwloop's lookup must still name the previous checkpoint.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import threading
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from mwloop import errors
from mwloop.artifacts import checkpoint, files
from mwloop.config import check as config_check
from mwloop.launcher import warm
from mwloop.run import preemption
from tests.helpers import ROOT, load_config


def _state():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(3)])
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    optimizer.build(model.trainable_variables)
    return {"model": model, "optimizer": optimizer, "step": tf.Variable(0, dtype=tf.int64)}


def _train(state, step: int) -> None:
    """Changes every weight and momentum in place, as an update does (while a write may be reading them)."""
    for v in [*state["model"].trainable_variables, *state["optimizer"].variables]:
        if "float" in str(v.dtype):
            v.assign_add(tf.random.normal(v.shape, dtype=v.dtype))
    state["step"].assign(step)


def _values(state) -> list[np.ndarray]:
    return [v.numpy() for v in [*state["model"].weights, *state["optimizer"].variables, state["step"]]]


def _checkpointer(workdir, state, max_to_keep=3, strategy=None, **guards) -> checkpoint.Checkpointer:
    return checkpoint.Checkpointer(strategy or tf.distribute.get_strategy(), str(workdir), chief=True,
                                   max_to_keep=max_to_keep, async_writes=True, **guards, **state)


@pytest.fixture
def gate(monkeypatch):
    """Holds every write of TensorFlow's asynchronous thread until `gate.set()` (set again at the end)."""
    event = threading.Event()
    write = tf.train.Checkpoint._write

    def held(self, *args, **kwargs):
        if "_async_save" in threading.current_thread().name:  # the helper's thread, not the caller's
            assert event.wait(30), "the test never opened the gate"
        return write(self, *args, **kwargs)

    monkeypatch.setattr(tf.train.Checkpoint, "_write", held)
    yield event
    event.set()


def _newest(workdir) -> tuple[str | None, int | None]:
    """(TensorFlow's pointer, mwloop's lookup by files) of the checkpoints directory."""
    directory = os.path.join(workdir, files.CHECKPOINTS)
    latest = tf.train.latest_checkpoint(directory)
    return (os.path.basename(latest) if latest else None), files.newest_checkpoint_step(str(workdir))


@pytest.mark.parametrize("replicas", [1, 2])
def test_successive_async_saves_of_keras_model_and_optimizer_restore_bitwise(tmp_path, replicas, request):
    """TensorFlow's one-liner fails here at the second save (Keras' _copy_trackable_to_cpu); each write must
    hold the state of its save call, not what training made of it while the write went on. Also with the
    mirrored variables of two local replicas."""
    strategy = request.getfixturevalue("mirrored_strategy") if replicas == 2 else tf.distribute.get_strategy()
    with strategy.scope():
        state = _state()
    saver = _checkpointer(tmp_path, state, strategy=strategy)
    expected = {}
    for step in (1, 2, 3):
        _train(state, step)
        expected[step] = _values(state)
        saver.save(step)
        _train(state, step + 100)  # training goes on while the write does
    assert saver.wait() == 3
    for step in (2, 3):
        fresh = _state()
        reader = tf.train.Checkpoint(**fresh)
        _ = reader.save_counter
        reader.read(os.path.join(tmp_path, "checkpoints", f"ckpt-{step}")).assert_consumed()
        for got, want in zip(_values(fresh), expected[step], strict=True):
            np.testing.assert_array_equal(got, want)
    # Each write's thread ended with it. (Other tests' warm-start servers keep a reader thread each: not counted.)
    assert len([t for t in threading.enumerate() if t.name != warm.REPLIES_THREAD]) < 10


def test_pointer_and_rotation_name_only_complete_checkpoints(tmp_path, gate):
    state = _state()
    saver = _checkpointer(tmp_path, state, max_to_keep=1, config_record="{}\n")
    saver.save(1)
    assert _newest(tmp_path) == (None, None) and not saver.done() and saver.checkpointed_step is None
    gate.set()
    assert saver.wait() == 1 and _newest(tmp_path) == ("ckpt-1", 1)
    gate.clear()
    saver.save(2)
    time.sleep(0.2)  # the write is held: nothing may move meanwhile, nor be rotated away
    assert _newest(tmp_path) == ("ckpt-1", 1) and saver.checkpointed_step == 1
    assert os.path.exists(os.path.join(tmp_path, "checkpoints", "ckpt-1.index"))
    assert os.path.exists(os.path.join(tmp_path, "checkpoints", "ckpt-2" + files.CHECKPOINT_CONFIG))  # first
    gate.set()
    assert saver.wait() == 2 and _newest(tmp_path) == ("ckpt-2", 2)
    assert checkpoint.saved_checkpoints(saver.directory) == [os.path.join(saver.directory, "ckpt-2")]
    assert not os.path.exists(os.path.join(saver.directory, "ckpt-1" + files.CHECKPOINT_CONFIG))  # gone with it


def test_next_save_waits_for_the_write_in_flight(tmp_path, gate):
    state = _state()
    saver = _checkpointer(tmp_path, state)
    saver.save(1)
    second = threading.Thread(target=saver.save, args=(2,))
    second.start()
    second.join(0.3)
    assert second.is_alive(), "the second save did not wait for the first write"
    gate.set()
    second.join(10)
    assert saver.wait() == 2
    assert [files.checkpoint_step(p) for p in checkpoint.saved_checkpoints(saver.directory)] == [2, 1]


def test_preemption_waits_for_the_write_in_flight_then_saves(tmp_path, gate):
    state = _state()
    saver = _checkpointer(tmp_path, state)
    saver.save(1)
    watcher = preemption.PreemptionWatcher(tf.distribute.get_strategy(), saver)
    watcher._own_code = errors.PREEMPTED  # as after a SIGTERM
    threading.Timer(0.3, gate.set).start()
    started = time.perf_counter()
    with pytest.raises(SystemExit) as exit_info:
        watcher.check(2)
    assert exit_info.value.code == errors.PREEMPTED and time.perf_counter() - started >= 0.25
    assert saver.done() and saver.checkpointed_step == 2 and _newest(tmp_path) == ("ckpt-2", 2)


def test_restore_waits_for_the_write_in_flight(tmp_path, gate):
    state = _state()
    saver = _checkpointer(tmp_path, state)
    _train(state, 5)
    saver.save(5)
    threading.Timer(0.3, gate.set).start()
    assert saver.restore() == os.path.join(saver.directory, "ckpt-5")


def test_failed_async_write_is_a_checkpoint_error_at_the_wait(tmp_path, monkeypatch):
    state = _state()
    saver = _checkpointer(tmp_path, state)
    write = tf.train.Checkpoint._write

    def failing(self, *args, **kwargs):
        if "_async_save" in threading.current_thread().name:
            raise tf.errors.ResourceExhaustedError(None, None, "No space left on device")
        return write(self, *args, **kwargs)

    monkeypatch.setattr(tf.train.Checkpoint, "_write", failing)
    saver.save(1)
    with pytest.raises(checkpoint.CheckpointError, match="step 1 .*failed .*resumes from the start"):
        saver.wait()


def test_async_checkpoint_is_refused_with_parameter_servers_only():
    config = load_config("mlp", **{"train.async_checkpoint": True})
    config_check.check_run(config, num_replicas=1)  # one process
    config_check.check_run(config, num_replicas=2, num_workers=2)  # MultiWorkerMirrored
    with pytest.raises(config_check.ConfigError, match=r"async_checkpoint=True does not work with parameter "
                                                       r"servers: .*; set config.train.async_checkpoint=False$"):
        config_check.check_run(config, num_replicas=2, parameter_server=True)


def test_trainer_tells_a_step_checkpointed_only_once_written_and_close_waits(tmp_path, gate):
    """The MLflow sink publishes points up to the step `writer.checkpointed` names: never one still being written."""
    import mwloop
    config = load_config("mlp", **{"distribution.strategy": "default", "train.async_checkpoint": True,
                                   "train.steps": 10, "writers": ()})
    told = []
    with mwloop.Trainer(config, str(tmp_path), evaluate=False, preemption=False) as trainer:
        trainer.writer.checkpointed = lambda step: told.append(
            (step, os.path.exists(os.path.join(tmp_path, "checkpoints", f"ckpt-{step}.index"))))
        trainer.save(5)
        assert told == [] and _newest(tmp_path) == (None, None)
        threading.Timer(0.3, gate.set).start()
    assert told == [(5, True)] and _newest(tmp_path) == ("ckpt-5", 5)


@pytest.mark.slow
def test_sigkill_during_an_async_write_then_a_rerun_resumes_complete_and_ends_bitwise_equal(tmp_path):
    """One trial of `python -m tests.stress.async_kill` (which runs 20): a real run killed a few ms into an
    asynchronous write leaves only complete checkpoints, and its rerun ends as an uninterrupted run."""
    from mwloop.run import train
    from tests.stress import async_kill
    # The uninterrupted run trains here, with the command's settings: bitwise the same, one start-up fewer.
    train.train_and_evaluate(load_config("mlp", **async_kill.SETTINGS, **{"distribution.strategy": "default"}),
                             str(tmp_path / "reference"), mode="train")
    reference = async_kill.final_state(str(tmp_path / "reference"))
    target, _, resumed, equal = async_kill.trial(str(tmp_path), reference, random.Random(3))
    assert equal, f"killed while writing ckpt-{target}, resumed from {resumed}: final weights differ"


@pytest.mark.slow
def test_two_workers_writing_asynchronously_resume_after_a_sigkill_bitwise_equal_to_synchronous(tmp_path):
    """MultiWorkerMirrored, every worker writing in the background (the chief into checkpoints/, worker 1 into a
    locked scratch directory kept until its write ended): worker 1 SIGKILLed between checkpoints, the launcher
    restarts both, and the job ends bitwise equal to an uninterrupted one with synchronous saves. No scratch
    directory is left (the restarted worker sweeps the killed one's), no step is logged twice."""
    from tests.test_multiworker import Watched, assert_chief_files_only, checkpoint_weights, env_for_workers, launcher
    # 300 steps, worker 1 killed at 180: four asynchronous saves done before it (40 to 160), one perhaps in flight.
    steps = {"train.steps": 300, "train.steps_per_loop": 20, "train.log_every_steps": 20,
             "train.checkpoint_every_steps": 40, "train.eval_every_steps": 0, "deterministic": True,
             "export": False}
    env = env_for_workers(tmp_path)
    reference = subprocess.run(launcher(tmp_path / "sync", **steps), env=env, cwd=ROOT, capture_output=True,
                               text=True, timeout=300)
    assert reference.returncode == 0, reference.stderr[-5000:]

    workdir = tmp_path / "async"
    job = Watched(launcher(workdir, max_restarts=1, **steps, **{"train.async_checkpoint": True}), env)
    worker1 = int(job.wait_for(r"started worker 1 \(pid (\d+)\)")[1])
    job.wait_for(r"\[worker 0\] .*step 180/300")
    os.kill(worker1, signal.SIGKILL)
    assert job.wait(timeout_s=300) == 0, job.output[-5000:]
    resumed = int(job.wait_for(r"\[worker 0\] .*resumed from step (\d+)")[1])
    assert 120 <= resumed < 300 and resumed % 40 == 0
    assert_chief_files_only(workdir, tmp_path)  # killed mid-write or not: its scratch directory was swept
    a, b = checkpoint_weights(workdir, 300), checkpoint_weights(tmp_path / "sync", 300)
    assert a.keys() == b.keys() and len(a) >= 4
    unequal = [name for name in a if not np.array_equal(a[name], b[name])]
    assert unequal == [], f"resumed from {resumed}: {unequal} differ from the synchronous run"
