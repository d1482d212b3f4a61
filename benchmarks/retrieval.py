"""The dual encoder (configs/retrieval.py) trained on 1 replica, 2 mirrored replicas and 2 workers (issue 30).

    python -m benchmarks.retrieval [--steps=300] [--workdir=DIR] [--overrides=KEY=VALUE,...]

Real runs of the shipped config, one process at a time: `python -m mwloop.main` on the default strategy (1
replica), on `mirrored` with the CPU split in 2 (`distribution.num_cpu_devices=2`), `python -m mwloop.launch
--num_workers=2 --max_restarts=0` (2 worker processes, MultiWorkerMirroredStrategy), and the local-negatives
variant (`model.negatives=local`) on 2 mirrored replicas and on 2 workers. For each: the final checkpoint's
largest weight difference relative to the largest weight of the 1-replica run's; the last eval's recall@1 and
recall@5 as the run reported them; recall@1 computed from the run's exported `query` and `document`
endpoints (each eval batch's documents ranked as the eval does: the same candidates, a copy of the own
document masked); and recall@1 of the run's checkpoint evaluated again on 1 replica (`--mode=eval` on a copy
of the workdir), where every query's candidates are its whole eval batch whatever the negatives setting.
With local negatives on 2 replicas each replica's eval ranks among its own half of a batch: its reported
recall is inflated, the endpoints' and the 1-replica columns are its true one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "retrieval.py")
MIRRORED = {"distribution.strategy": "mirrored", "distribution.num_cpu_devices": 2}
RUNS = {  # name -> (launcher?, overrides); the first is the reference
    "1 replica (default)": (False, {"distribution.strategy": "default"}),
    "2 mirrored replicas": (False, MIRRORED),
    "2 workers (launcher)": (True, {}),
    "local negatives, 2 mirrored": (False, {**MIRRORED, "model.negatives": "local"}),
    "local negatives, 2 workers": (True, {"model.negatives": "local"}),
}


def checkpoint_weights(workdir: str, step: int) -> dict:
    """The float weight tensors of a run's checkpoint ckpt-`step` (Keras 3 keeps them under
    optimizer/_trainable_variables: docs/actions.md)."""
    import numpy as np
    import tensorflow as tf
    reader = tf.train.load_checkpoint(os.path.join(str(workdir), "checkpoints", f"ckpt-{step}"))
    values = {name: np.asarray(reader.get_tensor(name)) for name in reader.get_variable_to_shape_map()}
    return {name: v for name, v in values.items() if "_trainable_variables" in name and v.dtype.kind == "f"}


def largest_relative_difference(a: dict, b: dict) -> float:
    """mwloop.testing.relative_difference over two checkpoints' weights (the same names, at least 8)."""
    from mwloop import testing
    assert a.keys() == b.keys() and len(b) >= 8, (sorted(a), sorted(b))
    return testing.relative_difference([a[k] for k in sorted(a)], [b[k] for k in sorted(b)])


def endpoint_recall(export_dir: str, config) -> dict[int, float]:
    """recall@k (each k of config.recall_at) of the eval pairs from a SavedModel's `query` and `document`
    endpoints: each eval batch's documents (config.eval.global_batch_size, the last batch partial) ranked by
    their dot product with each of its queries, another copy of the query's own document masked, ties
    favouring the own document: what examples/retrieval.py's eval computes on 1 replica. Checks that the
    embeddings are unit vectors."""
    import numpy as np
    import tensorflow as tf

    from examples.retrieval import MASKED, DualEncoder
    pairs = DualEncoder(config).eval_arrays()
    loaded = tf.saved_model.load(export_dir)
    queries = loaded.query(tf.constant(pairs["query"])).numpy()
    documents = loaded.document(tf.constant(pairs["document"])).numpy()
    for embeddings in (queries, documents):  # unit vectors: the dot product is the cosine the model trained on
        np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, rtol=1e-5)
    hits = {k: 0 for k in config.recall_at}
    size = config.eval.global_batch_size
    for start in range(0, len(queries), size):
        scores = queries[start:start + size] @ documents[start:start + size].T
        ids = pairs["doc_id"][start:start + size]
        own = np.eye(len(ids), dtype=bool)
        scores = np.where((ids[:, None] == ids[None, :]) & ~own, MASKED, scores)
        rank = (scores > scores[own][:, None]).sum(1)
        for k in hits:
            hits[k] += int((rank < k).sum())
    return {k: count / len(queries) for k, count in hits.items()}


def last_eval(workdir: str) -> dict:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        events = [json.loads(line) for line in f if line.strip()]
    return [e for e in events if e.get("split") == "eval"][-1]


def _flags(overrides: dict) -> list[str]:
    return [f"--config.{k}={v}" for k, v in overrides.items()]


def _run(command: list[str], log: str) -> float:
    env = dict(os.environ, PYTHONPATH=ROOT, GCE_METADATA_IP="127.0.0.1:9")
    started = time.perf_counter()
    with open(log, "w") as out:
        done = subprocess.run(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        with open(log) as f:
            sys.exit(f"exit {done.returncode}: {' '.join(command)}\n{f.read()[-3000:]}")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="train.steps (the config's: 300)")
    parser.add_argument("--workdir", default="", help="keep the runs here (default: a temporary directory)")
    parser.add_argument("--overrides", default="", help="KEY=VALUE,... for every run, e.g. optimizer.name=sgd")
    args = parser.parse_args()
    common = {"train.steps": args.steps, "train.checkpoint_every_steps": args.steps}
    common.update(dict(item.split("=", 1) for item in args.overrides.split(",") if item))
    directory = args.workdir or tempfile.mkdtemp(prefix="bench_retrieval_")
    os.makedirs(directory, exist_ok=True)

    from mwloop.config import base as config_base
    config = config_base.load(CONFIG, None, {k: v for k, v in common.items() if k.startswith(("dataset.", "eval."))})
    rows, reference = [], None
    for index, (name, (launcher, overrides)) in enumerate(RUNS.items()):
        workdir = os.path.join(directory, f"run{index}")
        shutil.rmtree(workdir, ignore_errors=True)
        start = [sys.executable, "-m", "mwloop.launch", "--num_workers=2", "--max_restarts=0", "--"] if launcher \
            else [sys.executable, "-m", "mwloop.main"]
        seconds = _run(start + [f"--config={CONFIG}", f"--workdir={workdir}", *_flags({**common, **overrides})],
                       workdir + ".log")
        # The checkpoint again on 1 replica, in a copy (--mode=eval appends its eval to metrics.jsonl).
        again = workdir + "_eval1"
        shutil.rmtree(again, ignore_errors=True)
        shutil.copytree(workdir, again)
        _run([sys.executable, "-m", "mwloop.main", f"--config={CONFIG}", f"--workdir={again}", "--mode=eval",
              *_flags({**common, "distribution.strategy": "default", "model.negatives": "global"})],
             again + ".log")
        weights = checkpoint_weights(workdir, args.steps)
        reference = reference or weights
        reported = last_eval(workdir)
        endpoints = endpoint_recall(os.path.join(workdir, "export", "latest"), config)
        rows.append((name, largest_relative_difference(weights, reference) if index else None,
                     reported["recall_at_1"], reported["recall_at_5"], endpoints[1], last_eval(again)["recall_at_1"],
                     reported["loss"], seconds))
        print(f"{name}: done in {seconds:.0f} s", file=sys.stderr, flush=True)

    print(f"configs/retrieval.py, {args.steps} steps" + (f", {args.overrides}" if args.overrides else "")
          + f"; runs in {directory}")
    print(f"{'run':<30} {'weights vs 1':>12} {'recall@1':>9} {'recall@5':>9} {'endpoints':>9} {'1-replica':>9} "
          f"{'eval loss':>9} {'wall s':>7}")
    for name, difference, recall, recall5, endpoints, again, loss, seconds in rows:
        print(f"{name:<30} {'-' if difference is None else f'{difference:.1e}':>12} {recall:>9.4f} {recall5:>9.4f} "
              f"{endpoints:>9.4f} {again:>9.4f} {loss:>9.4f} {seconds:>7.0f}", flush=True)


if __name__ == "__main__":
    main()
