"""Chief-only outputs: config.json, metrics.jsonl and TensorBoard summaries."""

from __future__ import annotations

import json
import os

import ml_collections
import tensorflow as tf


class MetricWriter:
    """Writes metric events on the chief; on other workers every method does nothing.

    Each event is one JSON line in `workdir/metrics.jsonl` and scalars under
    `workdir/summaries/<split>`.
    """

    def __init__(self, workdir: str, *, enabled: bool):
        self.enabled = enabled
        self.workdir = workdir
        self._summary_writers: dict[str, tf.summary.SummaryWriter] = {}
        if enabled:
            tf.io.gfile.makedirs(workdir)

    @property
    def metrics_path(self) -> str:
        return os.path.join(self.workdir, "metrics.jsonl")

    def write_config(self, config: ml_collections.ConfigDict) -> None:
        """Saves the resolved config as `workdir/config.json`."""
        if self.enabled:
            with tf.io.gfile.GFile(os.path.join(self.workdir, "config.json"), "w") as f:
                f.write(config.to_json_best_effort(indent=2, sort_keys=True) + "\n")

    def truncate_after(self, step: int) -> None:
        """Drops events past `step` (written by a run that died before its next checkpoint)."""
        if not (self.enabled and tf.io.gfile.exists(self.metrics_path)):
            return
        with tf.io.gfile.GFile(self.metrics_path) as f:
            lines = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
        with tf.io.gfile.GFile(self.metrics_path, "w") as f:
            f.write("".join(lines))

    def write(self, step: int, split: str, metrics: dict[str, float]) -> None:
        """Appends one event {step, split, **metrics} and writes its scalars."""
        if not self.enabled:
            return
        with tf.io.gfile.GFile(self.metrics_path, "a") as f:
            f.write(json.dumps({"step": int(step), "split": split, **metrics}) + "\n")
        if split not in self._summary_writers:
            self._summary_writers[split] = tf.summary.create_file_writer(
                os.path.join(self.workdir, "summaries", split))
        with self._summary_writers[split].as_default(step=int(step)):
            for name, value in metrics.items():
                tf.summary.scalar(name, value)

    def flush(self) -> None:
        for writer in self._summary_writers.values():
            writer.flush()

    def close(self) -> None:
        for writer in self._summary_writers.values():
            writer.close()
        self._summary_writers.clear()


def format_metrics(metrics: dict[str, float], skip: tuple[str, ...] = ()) -> str:
    """`name value` pairs for a log line, in the metrics' order ("loss 0.1234 accuracy 0.9876")."""
    return " ".join(f"{k} {v:.4g}" if abs(v) >= 1e4 else f"{k} {v:.4f}" for k, v in metrics.items()
                    if k not in skip)
