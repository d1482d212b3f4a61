"""The TensorBoard sink (the default of `config.writers`): scalars under `workdir/summaries/<split>`."""

from __future__ import annotations

import os

import tensorflow as tf

from mwloop.artifacts.sink import Sink


class TensorBoardSink(Sink):
    """Scalars under `workdir/summaries/<split>`."""
    name = "tensorboard"

    def __init__(self, workdir: str):
        self.workdir = workdir
        self._summary_writers: dict[str, tf.summary.SummaryWriter] = {}

    def write_scalars(self, step: int, split: str, metrics: dict[str, float]) -> None:
        if split not in self._summary_writers:
            self._summary_writers[split] = tf.summary.create_file_writer(
                os.path.join(self.workdir, "summaries", split))
        with self._summary_writers[split].as_default(step=int(step)):
            for name, value in metrics.items():
                tf.summary.scalar(name, value)

    def flush(self) -> None:
        for writer in self._summary_writers.values():
            writer.flush()

    def close(self, status: str) -> None:
        for writer in self._summary_writers.values():
            writer.close()
        self._summary_writers.clear()
