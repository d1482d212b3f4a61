"""The run's directory is its truth (issue 31, item 4; the planted state file of item 8): a workdir removed or
locked anew by another run stops the run in one line before it saves or writes anything; the config a
checkpoint was trained with is kept beside it; a planted `checkpoint` state file deletes nothing outside."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import tensorflow as tf

from mwloop.artifacts import checkpoint, files, resume_check, workdir_lock
from mwloop.artifacts.writers import MetricWriter
from tests.helpers import load_config


def checkpointer(workdir: str, max_to_keep: int = 2, **guards) -> checkpoint.Checkpointer:
    return checkpoint.Checkpointer(tf.distribute.get_strategy(), workdir, chief=True, max_to_keep=max_to_keep,
                                   weight=tf.Variable(1.0), **guards)


def test_a_removed_workdir_is_noticed_before_a_save(tmp_path):
    workdir = str(tmp_path / "run")
    lock = workdir_lock.acquire(workdir)
    saver = checkpointer(workdir, why_lost=lambda: workdir_lock.lost(workdir, lock))
    saver.save(10)
    shutil.rmtree(workdir)
    with pytest.raises(workdir_lock.WorkdirLostError, match=r"was removed while this run trained; stopping "
                                                            r"without saving the checkpoint of step 20"):
        saver.save(20)
    assert not os.path.exists(workdir)  # nothing made again
    lock.close()


def test_a_workdir_locked_anew_by_a_second_run_is_not_written(tmp_path):
    workdir = str(tmp_path / "run")
    first = workdir_lock.acquire(workdir)
    shutil.rmtree(workdir)
    second = workdir_lock.acquire(workdir)  # a second run in the same directory, after the rm -rf
    assert workdir_lock.lost(workdir, second) is None
    why = workdir_lock.lost(workdir, first)
    assert why and "changed hands" in why and f"pid {os.getpid()}" in why
    writer = MetricWriter(workdir, enabled=True, sinks=[])
    writer.why_lost = lambda: workdir_lock.lost(workdir, first)
    writer.write(5, "train", {"loss": 1.0})  # written nowhere; the next save stops the run (every worker)
    writer.write_event(5, "stop", {"reason": "x"})
    assert not os.path.exists(os.path.join(workdir, files.METRICS))
    saver = checkpointer(workdir, why_lost=writer.why_lost)
    with pytest.raises(workdir_lock.WorkdirLostError, match="changed hands while this run trained"):
        saver.save(10)
    assert not os.path.exists(os.path.join(workdir, "checkpoints"))
    first.close()
    second.close()


def test_the_config_is_kept_beside_each_checkpoint_and_rotated_with_it(tmp_path):
    workdir = str(tmp_path / "run")
    saver = checkpointer(workdir, max_to_keep=2, config_record=json.dumps({"train": {"steps": 30}}))
    for step in (10, 20, 30):
        saver.save(step)
    names = sorted(os.listdir(os.path.join(workdir, "checkpoints")))
    assert [n for n in names if n.endswith(".config.json")] == ["ckpt-20.config.json", "ckpt-30.config.json"]
    os.makedirs(workdir, exist_ok=True)
    assert files.trained_to_the_end(workdir)  # no config.json: the checkpoint's own config says 30


def test_the_resume_check_uses_the_checkpoints_config_when_config_json_is_gone(tmp_path):
    workdir = str(tmp_path / "run")
    config = load_config("mlp", **{"train.steps": 40})
    saver = checkpointer(workdir, config_record=config.to_json_best_effort(indent=2, sort_keys=True))
    saver.save(20)
    assert not os.path.exists(os.path.join(workdir, files.CONFIG))  # deleted before the resume
    other = load_config("mlp", **{"train.steps": 40, "train.global_batch_size": 128})
    with pytest.raises(Exception, match=r"train\.global_batch_size: 64 -> 128"):
        resume_check.check(other, workdir, 20, checkpoint=os.path.join(workdir, "checkpoints", "ckpt-20"))


def test_a_planted_state_file_never_makes_the_rotation_delete_outside(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    victims = {name: outside / name for name in ("model.index", "model.data-00000-of-00001")}
    for path in victims.values():
        path.write_text("precious")
    workdir = str(tmp_path / "run")
    os.makedirs(os.path.join(workdir, "checkpoints"))
    prefix = str(outside / "model")
    with open(os.path.join(workdir, "checkpoints", "checkpoint"), "w") as f:
        # With timestamps newer than the last preserved one, TensorFlow's manager would delete what it names.
        f.write(f'model_checkpoint_path: "{prefix}"\nall_model_checkpoint_paths: "{prefix}"\n'
                f"all_model_checkpoint_timestamps: {time.time() - 10}\nlast_preserved_timestamp: {time.time() - 99}\n")
    saver = checkpointer(workdir, max_to_keep=1)
    for step in (10, 20, 30):
        saver.save(step)
    assert all(path.read_text() == "precious" for path in victims.values())
    assert [files.checkpoint_step(p) for p in checkpoint.saved_checkpoints(os.path.join(workdir, "checkpoints"))] \
        == [30]


def test_checkpoints_found_at_a_resume_are_rotated_away_again(tmp_path):
    # The rewritten state file once had no timestamps: TensorFlow then keeps every recovered checkpoint for
    # good, and a resumed run kept max_to_keep + the ones it found (the fault suite's resume_extend_allowed).
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    for step in (20, 40):
        for suffix in (".index", ".data-00000-of-00001"):
            (directory / f"ckpt-{step}{suffix}").write_text("")
    checkpoint._rewrite_state(str(directory))
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(v=tf.Variable(1.0)), str(directory), max_to_keep=2)
    manager.save(checkpoint_number=60)
    assert sorted(p.name for p in directory.glob("ckpt-*.index")) == ["ckpt-40.index", "ckpt-60.index"]
    manager.save(checkpoint_number=80)
    assert sorted(p.name for p in directory.glob("ckpt-*.index")) == ["ckpt-60.index", "ckpt-80.index"]
