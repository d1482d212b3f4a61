"""TensorBoard's HParams dashboard for a sweep: the experiment (every swept key, every train/eval metric) at the
sweep directory, one session per trial in its own directory. Written with tensorboard's protos alone: no
TensorFlow.
"""

from __future__ import annotations

import glob
import os
import time
from typing import Any

from mwloop.sweep.report import PointResult, metric_columns
from mwloop.sweep.values import format_value

# Marks the event files the sweep writes, so a rerun replaces only those.
HPARAMS_SUFFIX = ".sweep_hparams"


def _hparam_value(value: Any) -> bool | float | str:
    """HParams take bool, number or string: a tuple becomes its text."""
    if isinstance(value, bool) or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        # The dashboard stores numbers as float64 anyway.
        return float(value)
    return format_value(value)


def _write_events(logdir: str, summary) -> None:
    """One event file holding `summary`. (tensorboard's EventFileWriter would import TensorFlow: seconds.)"""
    import socket

    from tensorboard.compat.proto import event_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter

    # A rerun replaces the sweep's own files, never the run's summaries.
    for old in glob.glob(os.path.join(logdir, f"events.out.tfevents.*{HPARAMS_SUFFIX}")):
        os.remove(old)
    now = time.time()
    path = os.path.join(logdir, f"events.out.tfevents.{int(now):010d}.{socket.gethostname()}{HPARAMS_SUFFIX}")
    writer = RecordWriter(open(path, "wb"))
    writer.write(event_pb2.Event(wall_time=now, file_version="brain.Event:2").SerializeToString())
    writer.write(event_pb2.Event(wall_time=now, summary=summary).SerializeToString())
    writer.close()


def write_hparams(sweep_dir: str, results: list[PointResult], keys: list[str]) -> None:
    """TensorBoard HParams: the experiment at `sweep_dir`, one session per point at `sweep_dir/<point>`.

    The session metrics are the scalars each run already writes under
    `<point>/summaries/<split>`, so nothing is copied.
    """
    # summary_v2 is what hparams.api exports, without importing TensorFlow.
    from tensorboard.plugins.hparams import summary_v2 as hp

    hparams = {}
    for key in keys:
        values = sorted({_hparam_value(r.values[key]) for r in results if key in r.values})
        hparams[key] = hp.HParam(key, hp.Discrete(values))
    metrics = [hp.Metric(name.split("/", 1)[1], group=f"summaries/{name.split('/', 1)[0]}", display_name=name,
                         dataset_type=hp.Metric.VALIDATION if name.startswith("eval/") else hp.Metric.TRAINING)
               for name in metric_columns(results) if name.split("/", 1)[0] in ("train", "eval", "cost", "export")]
    _write_events(sweep_dir, hp.hparams_config_pb(list(hparams.values()), metrics))
    for r in results:
        # A trial that failed before it ran has no directory.
        if r.status != "waiting" and os.path.isdir(r.workdir):
            session = {hparams[k]: _hparam_value(r.values[k]) for k in keys if k in r.values}
            _write_events(r.workdir, hp.hparams_pb(session, trial_id=r.name))
