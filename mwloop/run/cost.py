"""What a run costs: the metrics a sweep trades accuracy against, recorded in every sweep trial without being
asked (the agent sets config.record_cost; any run may).

A hook (`mwloop.run.hooks`) that the chief's writer turns into `cost` events of metrics.jsonl (so a sweep ranks
by "cost/params", "cost/examples_per_sec", ...):

- at the start of training: `params`, the model's weight count;
- at the end of the run: `examples_per_sec`, the median rate of this process's loop calls after its first (which
  traces and compiles), and the peak memory: `peak_memory_mb`, the largest peak TensorFlow reports over its GPUs
  (`tf.config.experimental.get_memory_info`; it reports none for CPUs), and `peak_rss_mb`, the process's peak
  resident memory as the OS reports it (what a CPU run costs).

The exported endpoint's latency is the export's own figure (`artifacts/export.py`, `export/latency_ms`). Nothing
here runs per step: one number per loop call, a few calls at the end.
"""

from __future__ import annotations

import resource
import statistics
import sys

import keras
import tensorflow as tf
from absl import logging

from mwloop.artifacts.writers import MetricWriter
from mwloop.run.hooks import Hook, LoopCall

SPLIT = "cost"


def peak_memory_mb() -> dict[str, float]:
    """{"peak_rss_mb": the process's peak resident memory} and, when TensorFlow reports one for a GPU,
    {"peak_memory_mb": the largest device peak}."""
    # Linux reports kilobytes, macOS bytes.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2 ** 20 if sys.platform == "darwin" else 2 ** 10)
    peaks = {"peak_rss_mb": round(rss, 1)}
    devices = []
    for device in tf.config.list_logical_devices("GPU"):
        try:
            devices.append(tf.config.experimental.get_memory_info(device.name)["peak"])
        # A device TensorFlow keeps no statistics for.
        except (ValueError, tf.errors.OpError):
            continue
    if devices:
        peaks["peak_memory_mb"] = round(max(devices) / 2 ** 20, 1)
    return peaks


class CostRecorder(Hook):
    """Records `cost` events: the weight count when training starts, the steady rate and peak memory at the end."""

    def __init__(self, writer: MetricWriter, model: keras.Model):
        self.writer, self.model = writer, model
        self.rates: list[float] = []
        self._calls = 0
        self._started = False

    def train_started(self, step: int, dropped_events: list[dict]) -> None:
        # Once per process: a Trainer may train in several calls (train(until_step=...)).
        if not self._started:
            self.writer.write(step, SPLIT, {"params": float(self.model.count_params())})
        self._started = True

    def after_call(self, call: LoopCall) -> None:
        self._calls += 1
        # The first call of a process traces the loop: not steady.
        if self._calls > 1 and call.seconds > 0:
            self.rates.append(call.sums.get("examples", 0.0) / call.seconds)

    def closing(self, step: int) -> None:
        # A run that never trained (a failed start, --mode=eval) writes nothing it did not write already.
        if not self._started:
            return
        try:
            metrics = peak_memory_mb()
            if self.rates:
                metrics["examples_per_sec"] = statistics.median(self.rates)
            self.writer.write(step, SPLIT, metrics)
        # The run's end must not fail on a figure (a full disk is reported by the writer itself).
        except Exception as e:
            logging.warning("could not record the run's cost: %s", e)
