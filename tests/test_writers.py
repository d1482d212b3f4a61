"""The chief's writer: metrics.jsonl plus sinks behind one interface; a failing sink; reruns add no history."""

from __future__ import annotations

import glob
import logging as pylogging
import os

import pytest
import tensorflow as tf

from mwloop.artifacts import goodput, sink, writers
from mwloop.errors import UserError
from mwloop.run import train
from tests.helpers import load_config, read_metrics


class Recording(sink.Sink):
    """Keeps what it is given; raises on `fail_at` (a fallible sink, as a tracking server is)."""
    name, fallible = "Recording", True

    def __init__(self, fail_at: int | None = None):
        self.calls: list[tuple] = []
        self.fail_at = fail_at

    def start(self, events):
        self.calls.append(("start", len(events)))

    def write_scalars(self, step, split, metrics):
        if step == self.fail_at:
            raise ConnectionError("connection refused\nsecond line")
        self.calls.append(("scalars", step, split, dict(metrics)))

    def checkpointed(self, step):
        self.calls.append(("checkpointed", step))

    def close(self, status):
        self.calls.append(("close", status))


def test_sinks_get_every_event_and_one_that_fails_warns_once_and_is_dropped(tmp_path, caplog):
    ok, failing = Recording(), Recording(fail_at=2)
    writer = writers.MetricWriter(str(tmp_path), enabled=True, sinks=[ok, failing])
    with caplog.at_level(pylogging.WARNING, logger="absl"):
        for step in (1, 2, 3):
            writer.write(step, "train", {"loss": 1.0 / step})
        writer.truncate_after(3)
        writer.close("FINISHED", checkpointed_step=3)
    assert [e["step"] for e in read_metrics(str(tmp_path))] == [1, 2, 3]  # metrics.jsonl has everything
    assert ok.calls == [("start", 0), ("scalars", 1, "train", {"loss": 1.0}), ("scalars", 2, "train", {"loss": 0.5}),
                        ("scalars", 3, "train", {"loss": 1 / 3}), ("checkpointed", 3), ("checkpointed", 3),
                        ("close", "FINISHED")]
    assert failing.calls == [("start", 0), ("scalars", 1, "train", {"loss": 1.0})]  # nothing after it failed
    warnings = [r.getMessage() for r in caplog.records if "Recording failed" in r.getMessage()]
    assert len(warnings) == 1 and "(ConnectionError: connection refused);" in warnings[0]


def test_other_workers_write_nothing_and_unknown_writers_are_one_line_errors(tmp_path):
    config = load_config("mlp")
    assert writers.make_sinks(config, str(tmp_path), enabled=False) == []
    assert [type(s).__name__ for s in writers.make_sinks(config, str(tmp_path))] == ["TensorBoardSink"]
    config.writers = ("tensorboard", "wandb")
    with pytest.raises(UserError, match=r"^config.writers has 'wandb'; use any of 'tensorboard', 'mlflow'"):
        writers.make_sinks(config, str(tmp_path), enabled=False)


def scalar_steps(logdir: str, tag: str) -> list[int]:
    """The steps of every `tag` scalar in the TensorBoard event files of `logdir`."""
    return sorted(event.step for path in glob.glob(os.path.join(logdir, "events.out.tfevents.*"))
                  for event in tf.compat.v1.train.summary_iterator(path)
                  for value in event.summary.value if value.tag == tag)


@pytest.mark.slow
def test_rerunning_a_finished_run_adds_no_eval_to_the_history(tmp_path, caplog):
    """A train-only run rerun as train_and_eval evaluates its last checkpoint once; rerunning that again
    evaluates nothing new (same figures back, same metrics.jsonl and TensorBoard) and says so."""
    workdir = str(tmp_path / "run")
    config = load_config("mlp", **{"distribution.strategy": "default", "train.steps": 40, "train.log_every_steps": 20,
                                   "train.eval_every_steps": 0, "train.checkpoint_every_steps": 20, "export": False})
    train.train_and_evaluate(config, workdir, mode="train")
    first = train.train_and_evaluate(config, workdir)  # nothing to train: evaluates step 40 once
    events = read_metrics(workdir)
    assert [(e["split"], e["step"]) for e in events if e["split"] not in goodput.RECORDS] == [
        ("train", 20), ("train", 40), ("eval", 40)]
    with caplog.at_level(pylogging.INFO, logger="absl"):
        again = train.train_and_evaluate(config, workdir)
    assert again == first and again["examples"] == 359
    assert read_metrics(workdir) == events
    assert scalar_steps(os.path.join(workdir, "summaries", "eval"), "loss") == [40]
    assert "step 40 was evaluated already" in caplog.text and "nothing new to evaluate" in caplog.text
