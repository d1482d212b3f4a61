"""Parameter-server training: the chief's train loop over `ClusterCoordinator.schedule`, and the servers.

Under `ParameterServerStrategy` only the chief (the coordinator) runs the Trainer. Variables live on the
ps tasks; each worker runs the step functions the chief schedules on it, on its own input pipeline, and
applies its update to the ps variables at once, without waiting for the other workers (asynchronous
training). Workers and ps tasks run nothing of mwloop's but a `tf.distribute.Server` (`serve`).

What that means for a run:
- one scheduled step is one whole update: its loss is scaled by that worker's batch
  (config.train.global_batch_size examples), not by a batch summed over workers;
- a loop call of N steps schedules N step functions (the coordinator hands them to whichever worker is
  free), waits for all of them (`join`), and returns their sums added up: the logged train loss is the
  mean over those steps, each computed on weights the other workers were changing meanwhile;
- the step counter is the chief's (steps scheduled and completed); `optimizer.iterations` races across
  workers (a read and an assign in Keras 3) and is set from the chief's count after every call;
- a worker that dies is TensorFlow's to handle: the coordinator reruns its steps on the others and takes
  it back when it restarts on the same address; a ps that dies ends the run (`ParameterServerLost`):
  the job restarts from the last checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
from typing import Iterator, NoReturn

import keras
import ml_collections
import numpy as np
import tensorflow as tf
from absl import logging
from tensorflow.python.eager import context

from mwloop import errors
from mwloop.cluster import distribute
from mwloop.data import pipeline
from mwloop.loop import inputs, update
from mwloop.step import steps, user_code
from mwloop.task import Task

SUM = tf.distribute.ReduceOp.SUM
_PS_TASK = re.compile(r"/job:ps/replica:\d+/task:\d+")


class ParameterServerLost(errors.JobLost):
    """A ps task became unreachable: its variables are gone, so the whole job must restart from the last
    checkpoint (not a user error: the launcher and a TFJob restart it)."""


def serve() -> NoReturn:
    """Runs this worker or ps task's server until the process is stopped (the chief does the training)."""
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    cluster = resolver.cluster_spec()
    distribute.check_can_listen(resolver)
    # A server holds nothing to save: Ctrl-C and the launcher's forwarded Ctrl-C end it at once (Python's
    # handlers could not run while the main thread is inside TensorFlow's join).
    for signum in (signal.SIGINT, errors.INTERRUPT_SIGNAL):
        signal.signal(signum, signal.SIG_DFL)
    # Each worker runs several remote functions at once (one per in-flight step, plus ps reads); too few
    # inter-op threads hang them (TensorFlow's multi_worker_test_base: b/172296720).
    threads = max(os.cpu_count() or 1, cluster.num_tasks("worker") + 1)
    server = tf.distribute.Server(cluster, job_name=resolver.task_type, task_index=resolver.task_id,
                                  protocol="grpc", start=True,
                                  config=tf.compat.v1.ConfigProto(inter_op_parallelism_threads=threads))
    logging.info("%s %d serves the parameter-server cluster at %s; the chief runs the training loop",
                 resolver.task_type, resolver.task_id, cluster.task_address(resolver.task_type, resolver.task_id))
    server.join()
    # join() only returns if the server is stopped.
    raise SystemExit(0)


def coordinator(strategy: tf.distribute.Strategy) -> tf.distribute.coordinator.ClusterCoordinator:
    """The strategy's one ClusterCoordinator (TensorFlow keeps a single instance per strategy)."""
    return tf.distribute.coordinator.ClusterCoordinator(strategy)


def cluster_size() -> tuple[int, int]:
    """(workers, ps tasks) of the cluster TF_CONFIG describes: the tasks the chief schedules steps on, and
    those holding the variables."""
    cluster = distribute.parse_tf_config()["cluster"]
    return len(cluster["worker"]), len(cluster["ps"])


@contextlib.contextmanager
def _fresh_seeds() -> Iterator[None]:
    """No global seed while tracing, so the random ops traced here get no seed attribute and each worker's
    kernel draws its own (and a worker that restarts draws again)."""
    seed = context.global_seed()
    tf.random.set_seed(None)
    try:
        yield
    finally:
        tf.random.set_seed(seed)


def train_input(config: ml_collections.ConfigDict, strategy: tf.distribute.Strategy, task: Task) -> Iterator:
    """A per-worker iterator over the task's training data, each worker with its own random order.

    Why not the task's seed: under ParameterServerStrategy `dataset_fn` is traced once and run on every
    worker with `input_pipeline_id` 0 of 1 (TensorFlow hard-codes it), so a seeded pipeline would give
    every worker the same batches. Each worker draws a seed when its dataset is made; the data order is
    therefore not reproducible, and a resume does not replay the stream (asynchronous updates are not
    reproducible anyway). A task's own `train_dataset` gets that seed as an int64 scalar tensor.
    """
    arrays = task.train_arrays()
    global_batch_size = config.train.global_batch_size

    def dataset_fn(ctx: tf.distribute.InputContext, seed: tf.Tensor) -> tf.data.Dataset:
        if arrays is not None:
            return pipeline.array_train_dataset(arrays, ctx, global_batch_size=global_batch_size, seed=seed,
                                                threads=config.dataset.get("threads", 0)
                                                if "dataset" in config else 0)
        on_disk = task.train_records()
        if on_disk is not None:
            return on_disk.train_dataset(ctx, global_batch_size=global_batch_size, seed=seed,
                                         threads=config.dataset.get("threads", 0) if "dataset" in config else 0)
        own = functools.partial(task.train_dataset, global_batch_size=global_batch_size, seed=seed, start_step=0)
        return inputs.checked(own, global_batch_size=global_batch_size, static=True,
                              what=f"{type(task).__name__}.train_dataset")(ctx)

    @tf.function
    def per_worker_dataset():
        seed = tf.random.uniform([], maxval=np.iinfo(np.int64).max, dtype=tf.int64)
        return strategy.distribute_datasets_from_function(lambda ctx: dataset_fn(ctx, seed))

    # Traced here, run on each worker (again on one that comes back).
    with _fresh_seeds():
        dataset = coordinator(strategy).create_per_worker_dataset(per_worker_dataset)
    return iter(dataset)


def make_train_loop(strategy: tf.distribute.Strategy, task: Task, model: keras.Model,
                    optimizer: keras.optimizers.Optimizer, options: steps.StepOptions | None = None, *,
                    global_batch_size: int | None = None, jit_compile: bool = False):
    """The chief's train loop: `train_loop(per_worker_iterator, num_steps) -> (sums, status)`, as
    `loop.make_train_loop`'s. It schedules `num_steps` step functions (one update each, on whichever
    worker is free), joins them, and returns their sums added up and `status` (`nonfinite`: steps whose
    loss was not finite; `first_nonfinite`: the first one's index in scheduling order; `skipped`: 0)."""
    options = options or steps.StepOptions(global_batch_size=global_batch_size, jit_compile=jit_compile)
    global_batch_size = options.global_batch_size
    cluster_coordinator = coordinator(strategy)
    compute = update.step_gradients(task, options)

    # The one replica step (mwloop.loop.update builds the loop's from it too).
    def replica_step(batch):
        return steps.replica_step(task, model, optimizer, batch, options, compute)

    # Without autograph, as the plain loop's tf.function: the task's code runs as written on every strategy,
    # and its errors stay the one-line UserCodeError (autograph rewrites them into a StagingError paragraph).
    @tf.function(autograph=False)
    def worker_step(iterator):
        sums, finite = strategy.run(replica_step, args=(next(iterator),))
        sums = {k: strategy.reduce(SUM, v, axis=None) for k, v in sums.items()}
        return sums, 1.0 - tf.cast(strategy.reduce(SUM, tf.cast(finite, tf.float32), axis=None) > 0, tf.float32)

    logging.info("parameter-server training on %d workers and %d ps: each step is one asynchronous update on "
                 "one worker's batch of %d examples; a log window's train metrics add up all its steps, each "
                 "computed on weights the other workers were updating meanwhile", *cluster_size(), global_batch_size)

    def train_loop(iterator, num_steps) -> tuple[dict[str, float], dict[str, float]]:
        count = int(num_steps)
        iterations = int(optimizer.iterations.numpy())
        # The first schedule traces the step (a worker's GPUs: threads).
        with user_code.one_line_errors():
            results = [cluster_coordinator.schedule(worker_step, args=(iterator,)) for _ in range(count)]
        try:
            cluster_coordinator.join()
            fetched = cluster_coordinator.fetch(results)
        except (tf.errors.UnavailableError, tf.errors.AbortedError, tf.errors.CancelledError) as e:
            raise _lost(e) from None
        # The chief's count: Keras' own increments race between workers (a read, then an assign).
        optimizer.iterations.assign(iterations + count)
        return _add_up(fetched)

    # As the plain loop's: a call that raised it traced.
    train_loop.tracing_count = worker_step.experimental_get_tracing_count
    return train_loop


@contextlib.contextmanager
def ps_failures_are_lost() -> Iterator[None]:
    """Turns an error from a ps task that went away (raised by whatever reads or writes a variable: a step,
    an eval, a save) into ParameterServerLost."""
    try:
        yield
    except (tf.errors.UnavailableError, tf.errors.AbortedError, tf.errors.CancelledError) as e:
        raise _lost(e) from None


def _lost(error: tf.errors.OpError) -> Exception:
    """ParameterServerLost naming the ps task if `error` came from one; otherwise `error` itself."""
    match = _PS_TASK.search(str(error))
    if not match:
        return error
    return ParameterServerLost(f"parameter server {match[0]} is unreachable ({type(error).__name__}): its variables "
                               f"are lost, so training stops; restart the whole job, which resumes from the last "
                               f"checkpoint (the launcher does with --max_restarts, a TFJob with its restartPolicy)")


def _add_up(fetched: list) -> tuple[dict[str, float], dict[str, float]]:
    """Summed sums of the fetched (sums, nonfinite) of each scheduled step, and the loop status."""
    totals: dict[str, float] = {}
    bad = [i for i, (_, nonfinite) in enumerate(fetched) if nonfinite > 0]
    for sums, _ in fetched:
        for k, v in sums.items():
            totals[k] = totals.get(k, 0.0) + float(v)
    return totals, {"nonfinite": float(len(bad)), "skipped": 0.0,
                    "first_nonfinite": float(bad[0]) if bad else float("inf")}
