"""Files mwloop appends to or rewrites survive a crash mid-write: torn last lines, failed rewrites."""

from __future__ import annotations

import csv
import errno
import json
import logging as pylogging
import os
import subprocess
import sys

import pytest
import tensorflow as tf

from helpers import ROOT, load_config, read_metrics
from mwloop import sweep
from mwloop.artifacts import goodput, jsonl
from mwloop.artifacts.jsonl import replace_file
from mwloop.artifacts.writers import MetricWriter
from mwloop.run import train
from mwloop.sweep import runner

EVENTS = [{"step": 1, "split": "train", "loss": 2.5}, {"step": 2, "split": "train", "loss": 1.5},
          {"step": 2, "split": "eval", "loss": 1.75}]
TORN = '{"step": 3, "split": "tra'  # what a crash mid-append leaves: no closing brace, no newline


def write_lines(path, lines: list[str], tail: str = "") -> None:
    with open(path, "w") as f:
        f.write("".join(line + "\n" for line in lines) + tail)


def strict_read(path) -> list[dict]:
    """Every line must be whole: what the files look like after mwloop repaired them."""
    with open(path) as f:
        text = f.read()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


@pytest.fixture
def absl_warnings(caplog):
    with caplog.at_level(pylogging.WARNING, logger="absl"):
        yield caplog


# ---------------------------------------------------------------------------- reading

def test_torn_last_line_is_skipped_with_a_warning_naming_the_file(tmp_path, absl_warnings):
    path = tmp_path / "metrics.jsonl"
    write_lines(path, [json.dumps(e) for e in EVENTS] + [""], tail=TORN)  # a blank line is no line
    assert jsonl.read(str(path)) == EVENTS
    assert f"{path} line 5 is incomplete (a crash mid-write?); ignoring it" in absl_warnings.text
    absl_warnings.clear()
    write_lines(path, [json.dumps(e) for e in EVENTS])
    assert jsonl.read(str(path)) == EVENTS and not absl_warnings.text


def test_malformed_middle_line_is_an_error_naming_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_lines(path, [json.dumps(EVENTS[0]), TORN + json.dumps(EVENTS[1]), json.dumps(EVENTS[2])])
    with pytest.raises(jsonl.CorruptFileError, match=f"^{path} line 2 is not a JSON object .*delete line 2$"):
        jsonl.read(str(path))
    marker = tmp_path / "sweep.json"
    marker.write_text('{"status": "do')
    with pytest.raises(jsonl.CorruptFileError, match=f"^{marker} is not a whole JSON object"):
        jsonl.read_json(str(marker))


# ---------------------------------------------------------------------------- rewriting

def test_failed_rewrite_keeps_the_original(tmp_path, monkeypatch):
    path = tmp_path / "results.csv"
    path.write_text("old content\n")
    with pytest.raises(OSError, match="No space"), jsonl.atomic_open(str(path)) as f:
        f.write("half of the new ")
        f.flush()  # the new bytes are on disk, in the temporary file
        raise OSError(errno.ENOSPC, "No space left on device")
    assert path.read_text() == "old content\n" and os.listdir(tmp_path) == ["results.csv"]

    # MetricWriter's rewrites: the write dies after the data, before the rename.
    workdir = tmp_path / "run"
    writer = MetricWriter(str(workdir), enabled=True)
    original = "".join(json.dumps(e) + "\n" for e in EVENTS)
    (workdir / "metrics.jsonl").write_text(original)
    (workdir / "config.json").write_text('{"old": 1}\n')

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(OSError):
        writer.truncate_after(1)
    with pytest.raises(OSError):
        writer.write_config(load_config("mlp"))
    assert (workdir / "metrics.jsonl").read_text() == original
    assert (workdir / "config.json").read_text() == '{"old": 1}\n'
    assert sorted(os.listdir(workdir)) == ["config.json", "metrics.jsonl"]  # no temporary file left behind
    monkeypatch.undo()
    writer.truncate_after(1)
    assert strict_read(workdir / "metrics.jsonl") == EVENTS[:1]


def test_rewrite_on_a_gfile_filesystem_replaces_the_file():
    path = "ram://test_files/config.json"
    replace_file(path, "old\n")
    replace_file(path, "new\n")
    with tf.io.gfile.GFile(path) as f:
        assert f.read() == "new\n"
    assert tf.io.gfile.listdir("ram://test_files") == ["config.json"]


# ---------------------------------------------------------------------------- MetricWriter

def test_append_after_a_torn_line_starts_on_a_fresh_line(tmp_path, absl_warnings):
    workdir = tmp_path / "run"
    workdir.mkdir()
    write_lines(workdir / "metrics.jsonl", [json.dumps(e) for e in EVENTS[:2]], tail=TORN)
    writer = MetricWriter(str(workdir), enabled=True)
    writer.write(3, "train", {"loss": 1.25})
    writer.write(4, "train", {"loss": 1.0})
    writer.close()
    assert strict_read(workdir / "metrics.jsonl") == EVENTS[:2] + [
        {"step": 3, "split": "train", "loss": 1.25}, {"step": 4, "split": "train", "loss": 1.0}]
    assert "metrics.jsonl line 3 is incomplete" in absl_warnings.text


def test_truncate_after_drops_later_events_and_a_torn_line(tmp_path, absl_warnings):
    workdir = tmp_path / "run"
    workdir.mkdir()
    write_lines(workdir / "metrics.jsonl", [json.dumps(e) for e in EVENTS], tail=TORN)
    writer = MetricWriter(str(workdir), enabled=True)
    writer.truncate_after(1)
    assert strict_read(workdir / "metrics.jsonl") == EVENTS[:1]
    assert f"{workdir / 'metrics.jsonl'} line 4 is incomplete" in absl_warnings.text


@pytest.mark.slow
def test_resume_over_a_torn_metrics_line(tmp_path, caplog):
    """The run died writing a line after its checkpoint at step 20: the rerun warns, drops it and goes on."""
    def config(steps: int):
        return load_config("mlp", **{"distribution.strategy": "default", "train.steps": steps,
                                     "train.steps_per_loop": 20, "train.log_every_steps": 20,
                                     "train.checkpoint_every_steps": 20, "train.eval_every_steps": 0,
                                     "export": False, "optimizer.schedule": "constant"})
    workdir = str(tmp_path / "run")
    train.train_and_evaluate(config(20), workdir, mode="train")
    metrics = os.path.join(workdir, "metrics.jsonl")
    with open(metrics, "a") as f:
        f.write(TORN)
    with caplog.at_level(pylogging.INFO, logger="absl"):
        train.train_and_evaluate(config(40), workdir, mode="train")
    assert "resumed from step 20" in caplog.text
    # Line 5: after the first run's attempt record, train event, clock and goodput records.
    assert f"{metrics} line 5 is incomplete (a crash mid-write?); ignoring it" in caplog.text
    assert [(e["step"], e["split"]) for e in read_metrics(workdir) if e["split"] not in goodput.RECORDS] == [
        (20, "train"), (40, "train")]


# ---------------------------------------------------------------------------- sweeps

@pytest.mark.slow
def test_sweep_modules_do_not_import_tensorflow():
    code = "import sys, mwloop.sweep, mwloop.artifacts.jsonl; assert 'tensorflow' not in sys.modules, 'tensorflow'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, env=dict(os.environ, PYTHONPATH=ROOT))


@pytest.mark.slow
def test_sweep_resumes_over_torn_and_corrupt_files(tmp_path, monkeypatch, absl_warnings):
    """Trial directories of an earlier attempt with a torn metrics line, a corrupt one and a torn config.json:
    the sweep warns of each, keeps what is readable, and finishes (the study itself is SQLite: transactional).
    The agent follows the corrupt file without dying (it did: the trial then stayed "running" and the sweep
    exited 0)."""
    sweep_dir = tmp_path / "sweep"
    done, torn = sweep_dir / "learning_rate=0.03", sweep_dir / "learning_rate=0.3"
    done.mkdir(parents=True)
    torn.mkdir()
    write_lines(done / "metrics.jsonl", ['{"step": 40, "split": "eval", "accuracy": 0.875}'], tail=TORN)
    (torn / "config.json").write_text('{"dataset": {"name"')
    write_lines(torn / "metrics.jsonl", [json.dumps(EVENTS[0]), TORN, json.dumps(EVENTS[1])])
    # Each trial's "training": a process that succeeds at once (the files are what is under test).
    monkeypatch.setattr(runner, "command", lambda *args, **kwargs: [sys.executable, "-c", "pass"])

    failed = sweep.run_sweep(sweep_spec=os.path.join(ROOT, "experiments", "mlp_smoke.py"), sweep_dir=str(sweep_dir))

    assert failed == 1  # the corrupt file's readable lines hold no eval: that trial is failed, not crashed
    log = absl_warnings.text
    assert f"{done / 'metrics.jsonl'} line 2 is incomplete (a crash mid-write?); ignoring it" in log
    assert f"{torn / 'config.json'} is not a whole JSON object" in log
    assert f"{torn / 'metrics.jsonl'} line 2 is not a JSON object" in log
    with open(sweep_dir / "results.csv") as f:
        rows = {row["name"]: row for row in csv.DictReader(f)}
    assert rows["learning_rate=0.03"]["status"] == "complete" and rows["learning_rate=0.03"]["eval/accuracy"] == "0.875"
    assert rows["learning_rate=0.3"]["status"] == "failed"
    assert rows["learning_rate=0.3"]["error"] == ("the run wrote no eval/accuracy to metrics.jsonl (it wrote: "
                                                  "train/loss)")
    assert not any(name.endswith(".tmp") for name in os.listdir(sweep_dir))
