"""The exported endpoint's latency on a fixed batch: what serving the model costs, measured as it is exported.

The endpoint is the export archive's own function (the undistributed copy of the model the SavedModel holds,
traced for the export), called on a batch of LATENCY_BATCH zeros shaped by its input signature: one call to warm
up, then the median of LATENCY_CALLS. No SavedModel is loaded, so the figure costs a few forward passes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

LATENCY_BATCH = 32
LATENCY_CALLS = 5


def fixed_batch(input_signature: Sequence, batch: int = LATENCY_BATCH) -> list | None:
    """Zeros for each spec of `input_signature`, `batch` rows; None when a spec has an unknown non-batch
    dimension or a dtype zeros cannot stand for (strings)."""
    def zeros(spec: tf.TensorSpec):
        dims = spec.shape.as_list() if spec.shape.rank is not None else None
        if not dims or any(d is None for d in dims[1:]) or spec.dtype == tf.string:
            raise ValueError(spec)
        return tf.zeros([batch, *dims[1:]], spec.dtype)
    try:
        return tf.nest.map_structure(zeros, list(input_signature))
    except ValueError:
        return None


def latency_ms(endpoint: Callable, input_signature: Sequence, batch: int = LATENCY_BATCH,
               calls: int = LATENCY_CALLS) -> float | None:
    """Median milliseconds of `endpoint` on a fixed batch (its outputs read back, so the work is done); None
    when its signature has no fixed batch (`fixed_batch`)."""
    args = fixed_batch(input_signature, batch)
    if args is None:
        return None

    def call() -> None:
        tf.nest.map_structure(np.asarray, endpoint(*args))
    call()
    seconds = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return round(statistics.median(seconds) * 1e3, 3)
