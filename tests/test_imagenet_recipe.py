"""The imagenet recipe at tiny size on generated JPEGs: it trains, and its export predicts like the model."""

import glob
import os

import numpy as np
import pytest
import tensorflow as tf

from mwloop.data import make_tfrecords
from mwloop.run import state, train
from mwloop.tasks.classification import ImageClassification
from tests.helpers import load_config
from tests.image_folders import make_fake_image_folders

pytestmark = pytest.mark.slow  # trains and exports a ResNet on TFRecords (about 30 s)


def tiny_imagenet_config(data_dir: str):
    return load_config("resnet", "imagenet", **{
        "dataset.data_dir": data_dir, "dataset.image_size": 32, "dataset.num_classes": 3,
        "dataset.shuffle_buffer": 16, "model.blocks": (1, 1), "model.width": 8,
        "train.global_batch_size": 8, "train.steps": 6, "train.steps_per_loop": 3, "train.log_every_steps": 3,
        "train.eval_every_steps": 0, "train.checkpoint_every_steps": 3, "eval.global_batch_size": 8,
        "optimizer.warmup_steps": 2, "distribution.strategy": "default"})


def test_imagenet_recipe_trains_and_exports(tmp_path):
    folders, records = str(tmp_path / "folders"), str(tmp_path / "records")
    make_fake_image_folders(folders, num_classes=3, per_class=8, size=40)
    make_tfrecords.convert(folders, records, shards=2, validation_fraction=0.25, progress=False)
    config = tiny_imagenet_config(records)
    assert config.mixed_precision == "mixed_bfloat16" and config.train.label_smoothing == 0.1
    workdir = str(tmp_path / "run")
    results = train.train_and_evaluate(config, workdir)
    assert results["examples"] == 6 and np.isfinite(results["loss"])

    task = ImageClassification(config)
    source = task.source
    run = state.create(config, tf.distribute.get_strategy(), task)
    tf.train.Checkpoint(model=run.model).restore(tf.train.latest_checkpoint(f"{workdir}/checkpoints")).expect_partial()
    encoded = tf.constant([open(f, "rb").read() for f in sorted(glob.glob(f"{folders}/*/*"))[:4]])
    images = tf.stack([source.decode_image(e) for e in encoded])
    want = tf.nn.softmax(tf.cast(run.model(images, training=False), tf.float32)).numpy()
    exported = tf.saved_model.load(os.path.join(workdir, "export", "latest"))
    np.testing.assert_allclose(exported.serve(images).numpy(), want, atol=1e-6)
    np.testing.assert_allclose(exported.serve_bytes(encoded).numpy(), want, atol=1e-6)
