"""Chief-only outputs: config.json, metrics.jsonl and TensorBoard summaries."""

from __future__ import annotations

import os

import ml_collections
import tensorflow as tf

from mwloop import jsonl


class MetricWriter:
    """Writes metric events on the chief; on other workers every method does nothing.

    Each event is one JSON line in `workdir/metrics.jsonl` and scalars under
    `workdir/summaries/<split>`.
    """

    def __init__(self, workdir: str, *, enabled: bool):
        self.enabled = enabled
        self.workdir = workdir
        self._summary_writers: dict[str, tf.summary.SummaryWriter] = {}
        self._tail_checked = False  # whether a torn last line of metrics.jsonl was looked for yet
        if enabled:
            tf.io.gfile.makedirs(workdir)

    @property
    def metrics_path(self) -> str:
        return os.path.join(self.workdir, "metrics.jsonl")

    def write_config(self, config: ml_collections.ConfigDict) -> None:
        """Saves the resolved config as `workdir/config.json` (atomically: a crash keeps the old one)."""
        if self.enabled:
            replace_file(os.path.join(self.workdir, "config.json"),
                         config.to_json_best_effort(indent=2, sort_keys=True) + "\n")

    def read(self) -> list[dict]:
        """The events of metrics.jsonl; a last line torn by a crash is skipped with a warning."""
        return jsonl.parse(self._text(), self.metrics_path)

    def _text(self) -> str:
        if not tf.io.gfile.exists(self.metrics_path):
            return ""
        with tf.io.gfile.GFile(self.metrics_path, "rb") as f:
            return f.read().decode(errors="replace")

    def _rewrite(self, events: list[dict]) -> None:
        replace_file(self.metrics_path, "".join(jsonl.dumps(event) + "\n" for event in events))

    def truncate_after(self, step: int) -> None:
        """Drops events past `step` (written by a run that died before its next checkpoint)."""
        if not (self.enabled and tf.io.gfile.exists(self.metrics_path)):
            return
        self._rewrite([event for event in self.read() if event["step"] <= step])
        self._tail_checked = True  # the rewrite dropped any torn line

    def _drop_torn_tail(self) -> None:
        # A crash mid-append leaves a last line without its newline. Appending after it would make it a
        # malformed line in the middle of the file, which no reader may skip: rewrite the file without it.
        text = self._text()
        if text and not text.endswith("\n"):
            self._rewrite(jsonl.parse(text, self.metrics_path))

    def write(self, step: int, split: str, metrics: dict[str, float]) -> None:
        """Appends one event {step, split, **metrics} and writes its scalars."""
        if not self.enabled:
            return
        self._append({"step": int(step), "split": split, **metrics})
        if split not in self._summary_writers:
            self._summary_writers[split] = tf.summary.create_file_writer(
                os.path.join(self.workdir, "summaries", split))
        with self._summary_writers[split].as_default(step=int(step)):
            for name, value in metrics.items():
                tf.summary.scalar(name, value)

    def _append(self, event: dict) -> None:
        if not self._tail_checked:  # once per writer: only a crash before it started can tear a line
            self._drop_torn_tail()
            self._tail_checked = True
        with tf.io.gfile.GFile(self.metrics_path, "a") as f:  # one whole line per write call
            f.write(jsonl.dumps(event) + "\n")  # strict JSON: a NaN metric is null, flagged

    def write_event(self, step: int, split: str, fields: dict) -> None:
        """Appends one event {step, split, **fields} to metrics.jsonl only (fields need not be numbers)."""
        if not self.enabled:
            return
        self._append({"step": int(step), "split": split, **fields})

    def flush(self) -> None:
        for writer in self._summary_writers.values():
            writer.flush()

    def close(self) -> None:
        for writer in self._summary_writers.values():
            writer.close()
        self._summary_writers.clear()


def replace_file(path: str, text: str) -> None:
    """Replaces the file `path` with `text` in one step: if writing fails half-way, `path` keeps its old content."""
    if "://" not in path:  # local: jsonl.atomic_open fsyncs before the atomic rename
        with jsonl.atomic_open(path) as f:
            f.write(text)
        return
    tmp = path + ".tmp"  # GCS and other gfile filesystems: no fsync, but the rename only follows a whole write
    try:
        with tf.io.gfile.GFile(tmp, "w") as f:
            f.write(text)
        tf.io.gfile.rename(tmp, path, overwrite=True)
    except BaseException:
        if tf.io.gfile.exists(tmp):
            tf.io.gfile.remove(tmp)
        raise


def format_metrics(metrics: dict[str, float], skip: tuple[str, ...] = ()) -> str:
    """`name value` pairs for a log line, in the metrics' order ("loss 0.1234 accuracy 0.9876")."""
    return " ".join(f"{k} {v:.4g}" if abs(v) >= 1e4 else f"{k} {v:.4f}" for k, v in metrics.items()
                    if k not in skip)
