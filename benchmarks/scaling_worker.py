"""One worker of benchmarks.scaling: mwloop's train loop on one pinned core, timed per window.

    python -m benchmarks.scaling_worker --case=mlp --out=FILE [--window_steps=N --windows=N]

Run by benchmarks.scaling, either alone (no TF_CONFIG: the default strategy,
the 1-worker baseline) or as one of the workers `mwloop.launch.launch(...,
module="benchmarks.scaling_worker")` starts (TF_CONFIG set: mwloop's
`distribute.create_strategy` makes a MultiWorkerMirroredStrategy).

Before TensorFlow is imported the process pins itself to core (task index mod
cores, or $SCALING_CORE) and asks for 1 intra-op and 1 inter-op thread. The per-worker batch is
the case's global batch (weak scaling: N workers train on N x B per step). With --k=K (gradient
accumulation) that batch is the per-worker micro-batch: each update takes K of them, so the
effective global batch is N x K x B and a step (an update) does K micro-steps and one all-reduce.

Each round: one window of `window_steps` train steps (mwloop's loop, fed by a
ResidentFeed, driven by a `Trainer` with periodic work off, as in
benchmarks/peers.py), then one window of `window_steps` standalone all-reduces
of the model's gradient shapes (a replica-context `all_reduce(SUM, ...)` of
one tensor per trainable variable, as Keras' optimizer does for the gradients
under a tf.distribute strategy), K per tf.function call in a tf.range loop,
then one window of all-reduces of a single float (the collective's latency).
The chief writes the per-window times to --out as JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time


def _task_index() -> int:
    raw = os.environ.get("TF_CONFIG")
    return json.loads(raw)["task"]["index"] if raw else 0


def _pin() -> int:
    core = int(os.environ.get("SCALING_CORE", _task_index())) % os.cpu_count()
    os.sched_setaffinity(0, {core})
    os.environ["TF_NUM_INTRAOP_THREADS"] = "1"
    os.environ["TF_NUM_INTEROP_THREADS"] = "1"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    return core


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--window_steps", type=int, required=True)
    parser.add_argument("--windows", type=int, default=5)
    parser.add_argument("--warmup_windows", type=int, default=1)
    parser.add_argument("--batch", type=int, default=0, help="per-worker batch (0: the case's global batch)")
    parser.add_argument("--bytes_per_pack", type=int, default=0, help="config.distribution.bytes_per_pack")
    parser.add_argument("--k", type=int, default=1, help="config.optimizer.gradient_accumulation_steps")
    args = parser.parse_args()
    core = _pin()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    import ml_collections
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    from benchmarks.peers import load_config
    from mwloop.cluster import distribute
    from mwloop.run.trainer import Trainer
    from mwloop.tasks.classification import ImageClassification

    strategy = distribute.create_strategy(ml_collections.ConfigDict(
        {"strategy": "auto", "num_cpu_devices": 0, "collective": "auto", "collective_timeout_s": 0.0,
         "bytes_per_pack": args.bytes_per_pack}))
    workers = distribute.num_workers(strategy)
    config = load_config(args.case)
    per_worker_batch = args.batch or config.train.global_batch_size
    global_batch = per_worker_batch * workers * args.k  # weak scaling; per update: k micro-batches per worker
    k = config.train.steps_per_loop
    if args.window_steps % k:
        raise SystemExit(f"--window_steps={args.window_steps} is not a multiple of K={k}")
    task = ImageClassification(config)
    # The Trainer as train.py builds it (its state, feed, loop and actions), periodic work off.
    config.train.update({"global_batch_size": global_batch, "steps": 10**9, "log_every_steps": 0,
                         "eval_every_steps": 0, "checkpoint_every_steps": 0})
    config.optimizer.gradient_accumulation_steps = args.k
    config.export = False
    trainer = Trainer(config, tempfile.mkdtemp(prefix="mwloop-scaling-"), strategy=strategy, task=task,
                      evaluate=False, preemption=False)  # no signal handlers (TensorFlow's, multi-worker) per window
    model = trainer.state.model

    def train_window(num_steps: int) -> float:
        t = time.perf_counter()
        trainer.train(trainer.step + num_steps)
        return time.perf_counter() - t

    shapes = [v.shape for v in model.trainable_variables]

    def replica_allreduce(i, shapes=shapes):
        ctx = tf.distribute.get_replica_context()
        grads = [tf.fill(s, tf.cast(i, tf.float32)) for s in shapes]  # depends on i: not hoisted
        reduced = ctx.all_reduce(tf.distribute.ReduceOp.SUM, grads)
        return tf.add_n([tf.reduce_sum(g[..., :1]) for g in reduced])

    def make_allreduce_loop(shapes):
        @tf.function
        def allreduce_loop(num_steps):
            total = tf.constant(0.0)
            for i in tf.range(num_steps):
                out = strategy.run(functools.partial(replica_allreduce, shapes=shapes), args=(i,))
                total += strategy.experimental_local_results(out)[0]
            return total

        def allreduce_window(num_steps: int) -> float:
            t = time.perf_counter()
            for _ in range(num_steps // k):
                float(allreduce_loop(tf.constant(k)))
            return time.perf_counter() - t
        return allreduce_window

    allreduce_window = make_allreduce_loop(shapes)  # the gradients' shapes
    latency_window = make_allreduce_loop([tf.TensorShape([1])])  # one float: the collective's latency

    for _ in range(args.warmup_windows):
        train_window(args.window_steps)
        allreduce_window(args.window_steps)
        latency_window(args.window_steps)
    train_s, allreduce_s, latency_s = [], [], []
    for _ in range(args.windows):
        train_s.append(train_window(args.window_steps))
        allreduce_s.append(allreduce_window(args.window_steps))
        latency_s.append(latency_window(args.window_steps))
    if distribute.is_chief(strategy):
        with open(args.out, "w") as f:
            json.dump({"case": args.case, "workers": workers, "strategy": type(strategy).__name__,
                       "core": core, "affinity": sorted(os.sched_getaffinity(0)),
                       "per_worker_batch": per_worker_batch, "global_batch": global_batch, "steps_per_loop": k,
                       "accumulation_steps": args.k,
                       "window_steps": args.window_steps, "params": int(sum(v.shape.num_elements()
                                                                            for v in model.trainable_variables)),
                       "train_s": train_s, "allreduce_s": allreduce_s, "scalar_allreduce_s": latency_s}, f)


if __name__ == "__main__":
    main()
