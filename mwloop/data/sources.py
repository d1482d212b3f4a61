"""Datasets by name: each gives dataset_fn(input_context) factories for train and eval."""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Callable

import ml_collections
import numpy as np
import tensorflow as tf

from mwloop.data import pipeline

DatasetFn = Callable[[tf.distribute.InputContext], tf.data.Dataset]


@dataclasses.dataclass(frozen=True)
class Source:
    """A dataset: its shapes and the dataset_fn factories the loop distributes."""
    name: str
    input_shape: tuple[int, ...]
    num_classes: int
    num_train_examples: int
    num_eval_examples: int
    train_fn: Callable[..., DatasetFn]  # (global_batch_size, seed, start_step) -> dataset_fn
    eval_fn: Callable[[int], DatasetFn]  # (global_batch_size) -> dataset_fn
    decode_image: Callable[[tf.Tensor], tf.Tensor] | None = None  # encoded bytes -> one eval input (serving)
    train_arrays: dict[str, np.ndarray] | None = None  # in memory: the loop may index them in the graph (feed.py)
    eval_arrays: dict[str, np.ndarray] | None = None


def arrays_source(name: str, train: dict[str, np.ndarray], evaluation: dict[str, np.ndarray],
                  num_classes: int, decode_image: Callable[[tf.Tensor], tf.Tensor] | None = None,
                  threads: int = 0) -> Source:
    """A Source over in-memory arrays {'image': ..., 'label': ...}; `threads` > 0: a private tf.data pool."""
    pipeline.check_tuning(threads=threads)

    def train_fn(global_batch_size: int, seed: int, start_step: int = 0) -> DatasetFn:
        return functools.partial(pipeline.array_train_dataset, train, global_batch_size=global_batch_size,
                                 seed=seed, start_step=start_step, threads=threads)

    def eval_fn(global_batch_size: int) -> DatasetFn:
        return functools.partial(pipeline.array_eval_dataset, evaluation, global_batch_size=global_batch_size,
                                 threads=threads)

    return Source(name, tuple(train["image"].shape[1:]), num_classes, len(train["label"]),
                  len(evaluation["label"]), train_fn, eval_fn, decode_image, train_arrays=train,
                  eval_arrays=evaluation)


def split(images: np.ndarray, labels: np.ndarray, eval_fraction: float, split_seed: int):
    """A fixed, seeded train/eval split of arrays."""
    if not 0 <= eval_fraction < 1:
        raise ValueError(f"config.dataset.eval_fraction={eval_fraction} leaves no training examples; use a "
                         f"fraction in [0, 1) (0: no eval set)")
    order = np.random.default_rng(split_seed).permutation(len(labels))
    num_eval = int(round(len(labels) * eval_fraction))
    ev, tr = order[:num_eval], order[num_eval:]
    return {"image": images[tr], "label": labels[tr]}, {"image": images[ev], "label": labels[ev]}


def digits(cfg: ml_collections.ConfigDict) -> Source:
    """scikit-learn's 1,797 real 8x8 handwritten digits (shipped with the package, no download)."""
    from sklearn.datasets import load_digits  # imported here: only this source needs sklearn
    data = load_digits()
    images = (data.images.astype(np.float32) / 16.0)[..., None]
    if cfg.get("flatten", False):
        images = images.reshape(len(images), -1)
    labels = data.target.astype(np.int32)
    train, evaluation = split(images, labels, cfg.eval_fraction, cfg.split_seed)
    shape = images.shape[1:]

    def decode_image(encoded: tf.Tensor) -> tf.Tensor:
        """A grey PNG/JPEG of a digit (white ink on black, any size) as the model's input."""
        image = tf.image.resize(tf.image.decode_image(encoded, channels=1, expand_animations=False), (8, 8))
        return tf.reshape(image / 255.0, shape)

    return arrays_source("digits", train, evaluation, num_classes=10, decode_image=decode_image,
                         threads=cfg.get("threads", 0))


def synthetic(cfg: ml_collections.ConfigDict) -> Source:
    """Random images and labels of a given shape, for speed measurements (nothing to learn)."""
    shape, num_classes = tuple(cfg.image_shape), cfg.num_classes

    def make(seed: int, n: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        return {"image": rng.standard_normal((n, *shape), dtype=np.float32),
                "label": rng.integers(0, num_classes, n).astype(np.int32)}

    return arrays_source("synthetic", make(0, cfg.num_train_examples), make(1, cfg.num_eval_examples), num_classes,
                         threads=cfg.get("threads", 0))


def imagenet(cfg: ml_collections.ConfigDict) -> Source:
    """ImageNet-layout TFRecords in cfg.data_dir (see mwloop.data.imagenet)."""
    from mwloop.data import imagenet as imagenet_lib  # imported here: it is the only file-backed source
    return imagenet_lib.imagenet(cfg)


SOURCES: dict[str, Callable[[ml_collections.ConfigDict], Source]] = {
    "digits": digits, "synthetic": synthetic, "imagenet": imagenet}


def get_source(cfg: ml_collections.ConfigDict) -> Source:
    """The Source named by `cfg.name`; `cfg.data_dir`, when set, must exist."""
    data_dir = cfg.get("data_dir")
    if data_dir and not os.path.isdir(data_dir):
        raise FileNotFoundError(
            f"config.dataset.data_dir={data_dir!r} does not exist; point it at a data directory or unset it")
    if cfg.name not in SOURCES:
        raise ValueError(f"config.dataset.name={cfg.name!r} is unknown; use one of {', '.join(SOURCES)}")
    return SOURCES[cfg.name](cfg)
