"""What a dataset is to mwloop: a `Source` of dataset_fn(input_context) factories, and helpers to build one."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from mwloop.data import pipeline
from mwloop.errors import UserError

DatasetFn = Callable[[tf.distribute.InputContext], tf.data.Dataset]


@dataclasses.dataclass(frozen=True)
class Source:
    """A dataset: its shapes and the dataset_fn factories the loop distributes.

    Attributes:
      train_dataset_fn: (global_batch_size, seed, start_step) -> dataset_fn.
      eval_dataset_fn: (global_batch_size) -> dataset_fn.
      decode_image: encoded bytes -> one eval input (serving).
      train_arrays: in memory: the loop may index them in the graph (feed.py).
      train_records: records by global index (`mwloop.data.indexed.OnDisk`): the loop builds their stream.
    """
    name: str
    input_shape: tuple[int, ...]
    num_classes: int
    num_train_examples: int
    num_eval_examples: int
    train_dataset_fn: Callable[..., DatasetFn]
    eval_dataset_fn: Callable[[int], DatasetFn]
    decode_image: Callable[[tf.Tensor], tf.Tensor] | None = None
    train_arrays: dict[str, np.ndarray] | None = None
    eval_arrays: dict[str, np.ndarray] | None = None
    train_records: Any = None


def arrays_source(name: str, train: dict[str, np.ndarray], evaluation: dict[str, np.ndarray],
                  num_classes: int, decode_image: Callable[[tf.Tensor], tf.Tensor] | None = None,
                  threads: int = 0) -> Source:
    """A Source over in-memory arrays {'image': ..., 'label': ...}; `threads` > 0: a private tf.data pool."""
    pipeline.check_tuning(threads=threads)

    def train_dataset_fn(global_batch_size: int, seed: int, start_step: int = 0) -> DatasetFn:
        return functools.partial(pipeline.array_train_dataset, train, global_batch_size=global_batch_size,
                                 seed=seed, start_step=start_step, threads=threads)

    def eval_dataset_fn(global_batch_size: int) -> DatasetFn:
        return functools.partial(pipeline.array_eval_dataset, evaluation, global_batch_size=global_batch_size,
                                 threads=threads)

    return Source(name, tuple(train["image"].shape[1:]), num_classes, len(train["label"]),
                  len(evaluation["label"]), train_dataset_fn, eval_dataset_fn, decode_image, train_arrays=train,
                  eval_arrays=evaluation)


def split(images: np.ndarray, labels: np.ndarray, eval_fraction: float, split_seed: int):
    """A fixed, seeded train/eval split of arrays."""
    if not 0 <= eval_fraction < 1:
        raise UserError(f"config.dataset.eval_fraction={eval_fraction} leaves no training examples; use a "
                         f"fraction in [0, 1) (0: no eval set)")
    order = np.random.default_rng(split_seed).permutation(len(labels))
    num_eval = int(round(len(labels) * eval_fraction))
    ev, tr = order[:num_eval], order[num_eval:]
    return {"image": images[tr], "label": labels[tr]}, {"image": images[ev], "label": labels[ev]}
