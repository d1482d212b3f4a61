"""What a run costs (mwloop.run.cost, artifacts/serving_latency.py), in-process: the weight count at the start,
the steady rate (the tracing call left out) and peak memory at the end, an endpoint's latency on a fixed batch."""

from __future__ import annotations

import keras
import tensorflow as tf

from mwloop.artifacts import serving_latency
from mwloop.run import cost
from mwloop.run.hooks import LoopCall


class ListWriter:
    def __init__(self):
        self.events = []

    def write(self, step, split, metrics, record=None):
        self.events.append({"step": step, "split": split, **metrics})


def test_the_cost_hook_records_params_then_the_steady_rate_and_peak_memory():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    writer = ListWriter()
    hook = cost.CostRecorder(writer, model)
    hook.closing(0)
    assert writer.events == []  # a run that never trained (a failed start) writes nothing
    hook.train_started(0, [])
    hook.train_started(1, [])  # a second train() call of the Trainer
    # The first call traces (slow); the steady ones run 100, 300 and 200 examples/s.
    for seconds, examples in ((10.0, 100.0), (1.0, 100.0), (1.0, 300.0), (1.0, 200.0)):
        hook.after_call(LoopCall(0, 1, 0.0, seconds, {"examples": examples}, {}))
    hook.closing(4)
    start, end = writer.events
    assert start == {"step": 0, "split": "cost", "params": 15.0}
    assert end["step"] == 4 and end["examples_per_sec"] == 200.0 and end["peak_rss_mb"] > 10
    assert ("peak_memory_mb" in end) == bool(tf.config.list_logical_devices("GPU"))  # TensorFlow reports GPUs only


def test_an_endpoint_latency_on_a_fixed_batch_and_signatures_without_one():
    seen = []

    @tf.function
    def endpoint(x):
        seen.append(x.shape)
        return x * 2
    latency = serving_latency.latency_ms(endpoint, [tf.TensorSpec([None, 4], tf.float32)])
    assert latency is not None and latency > 0 and seen == [tf.TensorShape([32, 4])]  # traced once
    assert serving_latency.fixed_batch([tf.TensorSpec([None, None], tf.float32)]) is None
    assert serving_latency.fixed_batch([tf.TensorSpec([None], tf.string)]) is None
    assert [t.shape for t in serving_latency.fixed_batch([{"a": tf.TensorSpec([None, 2], tf.int32)}], 3)[0]
            .values()] == [tf.TensorShape([3, 2])]
