"""Chief-only outputs: config.json, metrics.jsonl, and the sinks every metric also goes to (TensorBoard by
default; MLflow with `config.writers`), each behind one small interface (sink.py), as CLU's MetricWriter."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import ml_collections
import tensorflow as tf
from absl import logging

from mwloop.artifacts import files, jsonl, tensorboard_sink
from mwloop.artifacts import sink as sink_lib
from mwloop.config import check as config_check


def make_sinks(config: ml_collections.ConfigDict, workdir: str, enabled: bool = True) -> list[sink_lib.Sink]:
    """The sinks config.writers names (default: TensorBoard) for the chief's writer (none when not `enabled`:
    the other workers; their config is checked all the same)."""
    # Also for callers that skipped config_check.check.
    config_check.check_writers(config.get("writers", ()))
    sinks: list[sink_lib.Sink] = []
    if not enabled:
        return sinks
    for name in config.get("writers", ("tensorboard",)):
        if name == "tensorboard":
            sinks.append(tensorboard_sink.TensorBoardSink(workdir))
        elif name == "mlflow":
            # Imports mlflow: only runs that use it pay for it.
            from mwloop.artifacts import mlflow_sink
            sinks.append(mlflow_sink.MlflowSink(config, workdir))
    return sinks


class MetricWriter:
    """Writes metric events on the chief; on other workers every method does nothing.

    Each event is one JSON line in `workdir/metrics.jsonl`, then goes to each sink (default: TensorBoard
    scalars under `workdir/summaries/<split>`).
    """

    def __init__(self, workdir: str, *, enabled: bool, sinks: Sequence[sink_lib.Sink] | None = None,
                 why_lost: Callable[[], str | None] | None = None):
        """`why_lost`: asked before metrics.jsonl is written: why the workdir is no longer this run's, or None."""
        self.enabled = enabled
        self.workdir = workdir
        default = [tensorboard_sink.TensorBoardSink(workdir)] if enabled and sinks is None else []
        self.sinks: list[sink_lib.Sink] = list(sinks if sinks is not None else default) if enabled else []
        self._started = False
        # Whether a torn last line of metrics.jsonl was looked for yet.
        self._tail_checked = False
        self.why_lost = why_lost
        self._lost = False
        if enabled:
            tf.io.gfile.makedirs(workdir)

    def _start(self) -> None:
        """Starts the sinks, once, with metrics.jsonl's events so far (after a resume's truncation)."""
        if not self._started:
            self._started = True
            events = self.read() if any(type(s).start is not sink_lib.Sink.start for s in self.sinks) else []
            self._each("start", events)

    def _each(self, method: str, *args) -> None:
        """Calls `method` on every sink (started first); a fallible sink that raises is warned of once and
        dropped for the rest of the run."""
        self._start()
        for sink in list(self.sinks):
            if not sink.fallible:
                getattr(sink, method)(*args)
                continue
            try:
                getattr(sink, method)(*args)
            except Exception as e:  # noqa: BLE001 - a tracking service down must not end the training
                self.sinks.remove(sink)
                logging.warning("%s failed (%s: %s); it gets nothing more from this run, which goes on: "
                                "metrics.jsonl has every event%s", sink.name, type(e).__name__,
                                str(e).strip().splitlines()[0][:300] if str(e) else "",
                                f"; {sink.catch_up}" if sink.catch_up else "")

    @property
    def metrics_path(self) -> str:
        return os.path.join(self.workdir, files.METRICS)

    def write_config(self, config: ml_collections.ConfigDict, keep_existing: bool = False) -> None:
        """Saves the resolved config as `workdir/config.json` (atomically: a crash keeps the old one); the
        sinks start (an MLflow run is created or resumed). `keep_existing`: an existing config.json stays
        (eval and export must not hide the trained run's settings from the next resume's check)."""
        if self.enabled:
            path = os.path.join(self.workdir, files.CONFIG)
            if not (keep_existing and tf.io.gfile.exists(path)):
                jsonl.replace_file(path, config.to_json_best_effort(indent=2, sort_keys=True) + "\n")
            self._start()

    def read(self) -> list[dict]:
        """The events of metrics.jsonl; a last line torn by a crash is skipped with a warning."""
        return jsonl.parse(self._text(), self.metrics_path)

    def _text(self) -> str:
        if not tf.io.gfile.exists(self.metrics_path):
            return ""
        with tf.io.gfile.GFile(self.metrics_path, "rb") as f:
            return f.read().decode(errors="replace")

    def _owned(self) -> bool:
        """Whether the workdir is still this run's. When it is not, nothing more is written (metrics.jsonl nor
        the sinks) and the run goes on to its next save, which stops every worker together in one line
        (checkpoint.Checkpointer): stopping here would stop the chief alone."""
        if self.why_lost is None or self._lost:
            return not self._lost
        if (why := self.why_lost()) is not None:
            self._lost = True
            logging.info("%s: writing no more metrics; the next save stops the run", why)
        return not self._lost

    def _rewrite(self, events: list[dict]) -> None:
        if not self._owned():
            return
        jsonl.replace_file(self.metrics_path, "".join(jsonl.dumps(event) + "\n" for event in events))

    def truncate_after(self, step: int) -> list[dict]:
        """Drops events past `step` (written by a run that died before its next checkpoint); returns them (their
        time is the goodput report's work lost to that crash)."""
        if not (self.enabled and tf.io.gfile.exists(self.metrics_path)):
            return []
        events = self.read()
        self._rewrite([event for event in events if event["step"] <= step])
        self._tail_checked = True  # the rewrite dropped any torn line
        self._each("truncate_after", int(step))
        self.checkpointed(step)
        return [event for event in events if event["step"] > step]

    def checkpointed(self, step: int) -> None:
        """A checkpoint of `step` exists: the sinks may publish the points up to it (the chief)."""
        if self.enabled:
            self._each("checkpointed", int(step))

    def write_export(self, directory: str, step: int) -> None:
        """Tells the sinks of an export (MLflow logs it as an artifact)."""
        if self.enabled:
            self._each("write_export", directory, int(step))

    def _drop_torn_tail(self) -> None:
        # A crash mid-append leaves a last line without its newline. Appending after it would make it a
        # malformed line in the middle of the file, which no reader may skip: rewrite the file without it.
        text = self._text()
        if text and not text.endswith("\n"):
            self._rewrite(jsonl.parse(text, self.metrics_path))

    def write(self, step: int, split: str, metrics: dict[str, float], record: dict | None = None) -> None:
        """Appends one event {step, split, **metrics, **record} and writes its scalars. `record`: fields for
        metrics.jsonl only, not scalars (`time`, the wall clock: files.ENVELOPE; the goodput clock's figures)."""
        if not self.enabled:
            return
        if not self._owned():
            return
        # First: a sink starting sees metrics.jsonl's history without this event.
        self._start()
        self._append({"step": int(step), "split": split, **metrics, **(record or {})})
        self._each("write_scalars", int(step), split, metrics)

    def _append(self, event: dict) -> None:
        if not self._owned():
            return
        # Once per writer: only a crash before it started can tear a line.
        if not self._tail_checked:
            self._drop_torn_tail()
            self._tail_checked = True
        # One whole line per write call, in strict JSON (a NaN metric is null, flagged).
        with tf.io.gfile.GFile(self.metrics_path, "a") as f:
            f.write(jsonl.dumps(event) + "\n")

    def write_event(self, step: int, split: str, fields: dict) -> None:
        """Appends one event {step, split, **fields} to metrics.jsonl only (fields need not be numbers)."""
        if not self.enabled:
            return
        self._append({"step": int(step), "split": split, **fields})

    def flush(self) -> None:
        if self.enabled:
            self._each("flush")

    def close(self, status: str = "FINISHED", checkpointed_step: int | None = None) -> None:
        """Ends the sinks: points up to `checkpointed_step` (the newest checkpoint) are published first, later
        ones dropped (the rerun writes them again)."""
        if not (self.enabled and self._started):
            return
        if checkpointed_step is not None:
            self._each("checkpointed", int(checkpointed_step))
        self._each("close", status)
        self._started = False  # a later write starts them again


def format_metrics(metrics: dict[str, float], skip: tuple[str, ...] = ()) -> str:
    """`name value` pairs for a log line, in the metrics' order ("loss 0.1234 accuracy 0.9876")."""
    return " ".join(f"{k} {v:.4g}" if abs(v) >= 1e4 else f"{k} {v:.4f}" for k, v in metrics.items()
                    if k not in skip)
