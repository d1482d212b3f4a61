"""TinyTask reading its training data from records on disk (`Task.train_records`), for runs in processes.

    --config=tests/records_task.py:DIR     DIR: a folder written by `python -m mwloop.data.convert` (DIR/train)

`write_records(DIR)` writes one from the tiny task's arrays. `OwnFiles` is the same task with its own
`train_dataset` that shards by worker, the kind an elastic job refuses.
"""

from __future__ import annotations

import os

import numpy as np
import tensorflow as tf

import mwloop
from mwloop.data import convert
from tests.tiny_task import TinyTask, arrays, tiny_config

NUM_RECORDS = 600


def write_records(folder: str) -> str:
    """The tiny task's features as a records dataset in FOLDER/train; returns FOLDER."""
    os.makedirs(folder, exist_ok=True)
    np.savez(os.path.join(folder, "tiny.npz"), **arrays(NUM_RECORDS, seed=0))
    convert.convert(os.path.join(folder, "tiny.npz"), folder, validation_fraction=0, records_per_file=128,
                    progress=False)
    return folder


class RecordsTask(TinyTask):
    """TinyTask, trained from records on disk."""
    _opened = None

    def train_arrays(self):
        return None

    def train_records(self):
        if self._opened is None:
            self._opened = mwloop.open_dataset(os.path.join(self.config.dataset.data_dir, "train"))
        return self._opened


class OwnFiles(TinyTask):
    """TinyTask with its own train_dataset that reads a worker's share of the data."""

    def train_arrays(self):
        return None

    def train_dataset(self, ctx, *, global_batch_size, seed, start_step):
        data = tf.data.Dataset.from_tensor_slices(arrays(256, seed=0)).shard(ctx.num_input_pipelines,
                                                                               ctx.input_pipeline_id)
        return data.repeat().batch(ctx.get_per_replica_batch_size(global_batch_size), drop_remainder=True)


def get_config(arg: str | None = None):
    task = OwnFiles if arg == "own" else RecordsTask
    config = tiny_config(task, **{"distribution.strategy": "auto"})
    config.dataset.data_dir = arg if task is RecordsTask else None
    return config
