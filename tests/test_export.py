"""Exports in TF Serving's layout: `DIR/export/<step>`, checked with TensorFlow's own saved_model_cli; a failed
export (a full disk) leaves the earlier version loadable."""

from __future__ import annotations

import contextlib
import glob
import os
import resource
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import mwloop
from mwloop import data
from mwloop.artifacts import export
from mwloop.run import train
from tests.helpers import ROOT, load_config, read_metrics, visible

pytestmark = pytest.mark.slow  # trains, exports and runs saved_model_cli / mwloop.main processes


def mlp_config(**overrides):
    return load_config("mlp", **{"distribution.strategy": "default", "train.steps": 40, "train.steps_per_loop": 20,
                                 "train.log_every_steps": 20, "train.eval_every_steps": 40,
                                 "train.checkpoint_every_steps": 20, **overrides})


def saved_model_cli(*args: str) -> subprocess.CompletedProcess:
    """TensorFlow's saved_model_cli (installed beside this Python) with `args`."""
    command = os.path.join(os.path.dirname(sys.executable), "saved_model_cli")
    if not os.path.exists(command):
        command = [sys.executable, "-m", "tensorflow.python.tools.saved_model_cli"]
    proc = subprocess.run([*([command] if isinstance(command, str) else command), *args], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_saved_model_cli_runs_the_served_signature_like_the_model(tmp_path):
    """`saved_model_cli run` on DIR/export/<step> (what TF Serving loads) gives the trained model's
    probabilities, and their accuracy is the eval's; `serving_default` is the first endpoint."""
    workdir = str(tmp_path / "run")
    with mwloop.Trainer(mlp_config(export_keep=2, record_cost=True), workdir) as trainer:
        versions = []
        for step in (20, 30, 40):  # three versions, keep 2
            trainer.train(until_step=step)
            versions.append(trainer.export())
        source = data.get_source(trainer.config.dataset)
        evaluation = next(iter(source.eval_dataset_fn(1000)(tf.distribute.InputContext())))
        want = tf.nn.softmax(trainer.state.model(evaluation["image"], training=False)).numpy()
    assert versions == [os.path.join(workdir, "export", s) for s in ("20", "30", "40")]
    assert visible(os.path.join(workdir, "export")) == ["30", "40", "latest"]  # no temporaries left
    assert os.readlink(os.path.join(workdir, "export", "latest")) == "40"
    assert export.versions(os.path.join(workdir, "export")) == [40, 30]

    shown = saved_model_cli("show", "--dir", versions[-1], "--tag_set", "serve").stdout
    assert {"serve", "serve_bytes", "serving_default"} <= {line.split('"')[1] for line in shown.splitlines()
                                                            if line.startswith("SignatureDef key:")}, shown
    images = str(tmp_path / "images.npy")
    np.save(images, evaluation["image"].numpy())
    outdir = str(tmp_path / "outputs")
    saved_model_cli("run", "--dir", versions[-1], "--tag_set", "serve", "--signature_def", "serve",
                    "--inputs", f"images={images}", "--outdir", outdir)
    [output] = glob.glob(os.path.join(outdir, "*.npy"))
    served = np.load(output)
    np.testing.assert_allclose(served, want, atol=1e-6)
    mask = evaluation["mask"].numpy()
    accuracy = ((served.argmax(1) == evaluation["label"].numpy()) * mask).sum() / mask.sum()
    [last_eval] = [e for e in read_metrics(workdir) if e["split"] == "eval" and e["step"] == 40]
    assert accuracy == pytest.approx(last_eval["accuracy"], abs=1e-9)
    # What the run cost, recorded unasked (mwloop.run.cost): a sweep may trade accuracy against it.
    events = read_metrics(workdir)
    assert [e["step"] for e in events if e["split"] == "export" and e["latency_ms"] > 0] == [20, 30, 40]
    start, end = [e for e in events if e["split"] == "cost"]
    assert (start["step"], start["params"]) == (0, trainer.state.model.count_params())
    assert end["step"] == 40 and end["peak_rss_mb"] > 100 and end["examples_per_sec"] > 0


def test_signature_names_are_those_docs_serving_md_gives(tmp_path):
    """docs/serving.md: inputs are named by their TensorSpec (else the argument), outputs by a dict's keys, else
    output_0, output_1, ...; the dual encoder's endpoints `query` and `document`, the first also serving_default,
    and Task's default `serve` on its dict-in, dict-out model."""
    from examples.retrieval import DualEncoder

    class Endpoints(DualEncoder):
        def serving_endpoints(self, model):
            d = self.config.dataset
            query, document = model.get_layer("query_tower"), model.get_layer("document_tower")
            specs = [tf.TensorSpec([None, d.query_dim], tf.float32, name="query"),
                     tf.TensorSpec([None, d.document_dim], tf.float32, name="document")]
            return {**super().serving_endpoints(model),
                    "both": (lambda q, doc: {"query": query(q), "document": document(doc)}, specs),
                    "pair": (lambda q, doc: (query(q), document(doc)), specs),
                    "unnamed": (lambda x: query(x), [tf.TensorSpec([None, d.query_dim], tf.float32)])}

    class Default(DualEncoder):
        serving_endpoints = mwloop.Task.serving_endpoints

    def names(task):
        loaded = tf.saved_model.load(export.export(task.build_model(), task, str(tmp_path / type(task).__name__), 1))
        return {name: (sorted(f.structured_input_signature[1]), sorted(f.structured_outputs))
                for name, f in loaded.signatures.items()}

    config = load_config("retrieval")
    assert names(Endpoints(config)) == {
        "query": (["query"], ["output_0"]), "document": (["document"], ["output_0"]),
        "serving_default": (["query"], ["output_0"]),
        "both": (["document", "query"], ["document", "query"]),
        "pair": (["document", "query"], ["output_0", "output_1"]),
        "unnamed": (["x"], ["output_0"])}
    assert names(Default(config)) == {name: (["document", "query"], ["document", "query"])
                                      for name in ("serve", "serving_default")}


@contextlib.contextmanager
def small_disk(path: str, size_mb: int):
    """A tmpfs of `size_mb` at `path` (root only); yields "tmpfs", or None when it cannot be mounted."""
    os.makedirs(path)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", path],
                                           capture_output=True).returncode:
        yield None
        return
    try:
        yield "tmpfs"
    finally:
        subprocess.run(["umount", "-l", path], check=False)


def test_an_export_that_fills_the_disk_leaves_the_previous_version_loadable(tmp_path):
    """--mode=export on a full disk (a small tmpfs, filled; or, without root, a file-size limit) fails in one
    line naming the intact version; that version still loads and serves what it served before."""
    trained = str(tmp_path / "trained")
    train.train_and_evaluate(mlp_config(), trained, mode="train")
    previous = os.path.join(trained, "export", "40")
    probe = np.random.default_rng(0).random((5, 64), dtype=np.float32)
    loaded = tf.saved_model.load(previous)  # held: a temporary's variables die
    before = loaded.serve(probe).numpy()
    with small_disk(str(tmp_path / "disk"), 16) as disk:
        workdir = str(tmp_path / "disk" / "run")
        shutil.copytree(trained, workdir)
        os.remove(os.path.join(workdir, ".lock"))
        limit = None
        if disk:  # fill all but 64 KB: enough for config.json, not for a SavedModel
            stat = os.statvfs(workdir)
            with open(os.path.join(tmp_path / "disk", "filler"), "wb") as f:
                f.write(b"\0" * (stat.f_bavail * stat.f_frsize - 64 * 1024))
        else:
            limit = 32 * 1024  # no single file over 32 KB (saved_model.pb is larger)

        def limit_files():
            if limit:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        proc = subprocess.run(
            [sys.executable, "-m", "mwloop.main", f"--config={os.path.join(ROOT, 'configs', 'mlp.py')}",
             f"--workdir={workdir}", "--mode=export", "--config.distribution.strategy=default"],
            cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=300,
            preexec_fn=limit_files)
        print(f"full disk by {disk or 'RLIMIT_FSIZE'}: exit {proc.returncode}; {proc.stderr.strip().splitlines()[-1]}")
        assert proc.returncode == 2, proc.stderr[-3000:]
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("error: exporting step 40 to ") and "the last good export" in last and \
            f"{workdir}/export/40 is intact" in last, proc.stderr[-3000:]
        assert visible(os.path.join(workdir, "export")) == ["40", "latest"]  # the temporary is gone
        reloaded = tf.saved_model.load(os.path.join(workdir, "export", "latest"))
        after = reloaded.serve(probe).numpy()
        np.testing.assert_array_equal(after, before)
