"""One benchmark peer in its own process, driven by benchmarks.throughput over stdin/stdout.

Own process per peer: time to first step includes nothing another peer
already traced or built, and ru_maxrss is this peer's peak alone. The parent
runs one timed window at a time across all peers (interleaved), so load from
other users of the machine hits every peer alike.

Protocol (one JSON object per stdout line): after start-up the peer prints
{"ready": ..., "first_call_s": ..., "baseline_rss_mb": ...} or {"error": ...};
then for each "run" line on stdin it runs one window and prints {"elapsed_s": ...};
"quit" makes it print {"peak_rss_mb": ...} and exit.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import sys
import time
from typing import Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

CASES = {  # config file, variant, overrides; K = steps per call
    "mlp": ("mlp", None, {"train.global_batch_size": 64, "train.steps_per_loop": 50}),
    "resnet_digits": ("resnet", "digits", {"train.steps_per_loop": 50}),
    "resnet50": ("resnet", "synthetic", {"train.global_batch_size": 8, "train.steps_per_loop": 4,
                                         "dataset.num_train_examples": 16}),
}
PEERS = ("raw", "raw (with metrics)", "mwloop", "mwloop (tf.data iterator)", "fit", "tutorial")
EXTRA_PEERS = ("superbatch", "mwloop (jit_compile)", "mwloop (mixed_bfloat16)",  # --peers=... to run them
               "mwloop (mixed_float16)")


def _say(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def _gist(message: str) -> str:
    """The informative line of an error ("Graph execution error:" alone says nothing)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    useful = [line for line in lines if "must feed" in line or "placeholder" in line]
    return (useful or lines or [""])[0][:160]


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def load_config(case: str):
    """The case's config: configs/<file>.py with the case's overrides."""
    from mwloop.config import base as config_base  # no TensorFlow import: devices are configured first
    name, variant, overrides = CASES[case]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return config_base.load(os.path.join(root, "configs", f"{name}.py"), variant, overrides)


class Setup:
    """What every peer shares: strategy, config, source arrays, and a fresh model + optimizer."""

    def __init__(self, case: str, strategy_name: str):
        import tensorflow as tf

        from mwloop.cluster import distribute
        if strategy_name == "mirrored":
            distribute.configure_cpu_devices(2)  # before any op
            self.strategy = tf.distribute.MirroredStrategy(
                [d.name for d in tf.config.list_logical_devices("CPU")])
        else:
            self.strategy = tf.distribute.get_strategy()
        from mwloop.tasks.classification import ImageClassification
        self.config = load_config(case)
        self.task = ImageClassification(self.config)
        self.source = self.task.source  # loading the arrays is not part of any peer's cost
        self.global_batch_size = self.config.train.global_batch_size
        self.steps_per_loop = self.config.train.steps_per_loop

    def model_and_optimizer(self, loss_scale: bool = False):
        import keras

        from mwloop.step import optim
        keras.utils.set_random_seed(self.config.seed)
        with self.strategy.scope():
            model = self.task.build_model()
            optimizer = optim.create(self.config.optimizer, global_batch_size=self.global_batch_size,
                                     total_steps=self.config.train.steps)
            if loss_scale:  # as state.create does for mixed_float16
                optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
            optimizer.build(model.trainable_variables)
        return model, optimizer

    def train_arrays(self) -> dict:
        """The source's training arrays (the first argument its train_dataset_fn partial closes over)."""
        return self.source.train_dataset_fn(self.global_batch_size, 0, 0).args[0]

    def dataset_fn(self):
        return self.source.train_dataset_fn(self.global_batch_size, self.config.seed, 0)


# Each builder returns (first_call, window): first_call() runs the first call (K steps, or 1 for
# one-step-per-call peers) and returns after its result; window(num_steps) runs num_steps more.

def _loop_peer(loop_fn, source, k: int):
    import tensorflow as tf

    def call():
        sums = loop_fn(source, tf.constant(k))
        return tf.nest.map_structure(float, sums)  # as the Trainer does after every call

    def window(num_steps: int) -> None:
        for _ in range(num_steps // k):
            call()
    return call, window


def build_mwloop(s: Setup, feed_kind: str = "resident", jit_compile: bool = False,
                 mixed_precision: str = "float32"):
    """mwloop as train.py runs it: a `Trainer` (its state, its feed: a ResidentFeed for in-memory
    sources with config.train.feed="resident", or a tf.data iterator with "iterator"; its loop and actions)
    with log, eval and checkpoint off, optionally with config.jit_compile / config.mixed_precision."""
    import tempfile

    import keras

    from mwloop.run.trainer import Trainer
    config = s.config.copy_and_resolve_references()
    config.train.update({"feed": feed_kind, "steps": 10**9, "log_every_steps": 0, "eval_every_steps": 0,
                         "checkpoint_every_steps": 0})
    config.update({"jit_compile": jit_compile, "mixed_precision": mixed_precision, "export": False})
    keras.utils.set_random_seed(config.seed)
    trainer = Trainer(config, tempfile.mkdtemp(prefix="mwloop-bench-"), strategy=s.strategy, task=s.task,
                      evaluate=False, preemption=False)  # no signal handlers set up per window

    def window(num_steps: int) -> None:  # the Trainer's per-call Python work included, periodic work off
        trainer.train(trainer.step + num_steps)
    return lambda: window(s.steps_per_loop), window


def build_raw(s: Setup, metrics: bool = False):
    """The limit: a bare tf.function of K train steps over per-replica batches already in memory.

    It accumulates only the loss, so grappler prunes the step's accuracy and finiteness check from it;
    with `metrics` it accumulates them too (what mwloop computes every step), to show their cost."""
    import numpy as np
    import tensorflow as tf

    from mwloop.step import steps
    model, optimizer = s.model_and_optimizer()
    k, replicas = s.steps_per_loop, s.strategy.num_replicas_in_sync
    per_replica = s.global_batch_size // replicas
    arrays = s.train_arrays()
    # K distinct per-replica batches in memory (wrapping around the set), sliced by the loop index.
    batches = s.strategy.experimental_distribute_values_from_function(lambda ctx: {
        key: tf.identity(np.resize(v, (k, per_replica, *v.shape[1:]))) for key, v in arrays.items()})

    def replica_step(total, batch, i):
        grads, sums, finite = steps.compute_gradients(s.task, model, optimizer, {key: v[i] for key, v in batch.items()},
                                                      steps.StepOptions(global_batch_size=s.global_batch_size))
        steps.apply_gradients(model, optimizer, grads)
        if metrics:
            return total + tf.stack([sums["loss_sum"], sums["correct"], tf.cast(finite, tf.float32)])
        return total + sums["loss_sum"]

    @tf.function
    def raw_loop(num_steps):
        total = s.strategy.run(lambda: tf.zeros([3]) if metrics else tf.constant(0.0))
        for i in tf.range(num_steps):
            total = s.strategy.run(replica_step, args=(total, batches, i))
        return s.strategy.reduce(tf.distribute.ReduceOp.SUM, total, axis=None)

    def call():
        return raw_loop(tf.constant(k)).numpy()

    def window(num_steps: int) -> None:
        for _ in range(num_steps // k):
            call()
    return call, window


def build_superbatch(s: Setup):
    """What did not reach the target: one next() per call of K batches, sliced inside the loop."""
    import tensorflow as tf

    from mwloop.step import steps
    model, optimizer = s.model_and_optimizer()
    options = steps.StepOptions(global_batch_size=s.global_batch_size)
    k = s.steps_per_loop
    dataset_fn = s.dataset_fn()
    dataset = s.strategy.distribute_datasets_from_function(
        lambda ctx: dataset_fn(ctx).batch(k, drop_remainder=True).prefetch(1))
    iterator = iter(dataset)

    def replica_fn(loss_sum, batches, i):
        batch = {key: v[i] for key, v in batches.items()}
        return loss_sum + steps.replica_step(s.task, model, optimizer, batch, options)[0]["loss_sum"]

    @tf.function
    def train_loop(iterator, num_steps):
        batches = next(iterator)
        sums = s.strategy.run(lambda: tf.constant(0.0))
        for i in tf.range(num_steps):
            sums = s.strategy.run(replica_fn, args=(sums, batches, i))
        return s.strategy.reduce(tf.distribute.ReduceOp.SUM, sums, axis=None)
    return _loop_peer(train_loop, iterator, k)


def build_tutorial(s: Setup):
    """TensorFlow's distributed training tutorial: one tf.function call per step."""
    import tensorflow as tf

    from mwloop.step import steps
    model, optimizer = s.model_and_optimizer()
    options = steps.StepOptions(global_batch_size=s.global_batch_size)
    iterator = iter(s.strategy.distribute_datasets_from_function(s.dataset_fn()))

    def train_step(batch):
        return steps.replica_step(s.task, model, optimizer, batch, options)[0]["loss_sum"]

    @tf.function
    def distributed_train_step(dist_inputs):
        per_replica_losses = s.strategy.run(train_step, args=(dist_inputs,))
        return s.strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)

    def call():
        return float(distributed_train_step(next(iterator)))

    def window(num_steps: int) -> None:
        total_loss = 0.0
        for _ in range(num_steps):
            total_loss += distributed_train_step(next(iterator))
        float(total_loss)
    return call, window


def build_fit(s: Setup):
    """Keras model.fit(steps_per_execution=K) on the same global batches, one epoch per window."""
    import keras
    import tensorflow as tf
    model, optimizer = s.model_and_optimizer()
    with s.strategy.scope():
        # jit_compile=False: the other peers run without XLA (Keras' "auto" would turn it on).
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"], steps_per_execution=s.steps_per_loop, jit_compile=False)
    dataset = s.dataset_fn()(tf.distribute.InputContext()).map(  # global batches; fit distributes them
        lambda b: (b["image"], b["label"]))
    k = s.steps_per_loop

    def call():
        model.fit(dataset, epochs=1, steps_per_epoch=k, verbose=0)

    def window(num_steps: int) -> None:
        model.fit(dataset, epochs=1, steps_per_epoch=num_steps, verbose=0)
    return call, window


BUILDERS: dict[str, Callable] = {
    "raw": build_raw, "raw (with metrics)": functools.partial(build_raw, metrics=True), "mwloop": build_mwloop,
    "mwloop (tf.data iterator)": functools.partial(build_mwloop, feed_kind="iterator"),
    "mwloop (jit_compile)": functools.partial(build_mwloop, jit_compile=True),
    "mwloop (mixed_bfloat16)": functools.partial(build_mwloop, mixed_precision="mixed_bfloat16"),
    "mwloop (mixed_float16)": functools.partial(build_mwloop, mixed_precision="mixed_float16"),
    "fit": build_fit, "tutorial": build_tutorial, "superbatch": build_superbatch,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", required=True, choices=sorted(CASES))
    parser.add_argument("--strategy", required=True, choices=("default", "mirrored"))
    parser.add_argument("--peer", required=True, choices=sorted(BUILDERS))
    parser.add_argument("--window_steps", type=int, required=True)
    parser.add_argument("--warmup_windows", type=int, default=1)
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        setup = Setup(args.case, args.strategy)
        baseline = _rss_mb()
        t0 = time.perf_counter()  # from building the model, data and function ...
        first_call, window = BUILDERS[args.peer](setup)
        first_call()  # ... to the first call's result
        first_call_s = time.perf_counter() - t0
        for _ in range(args.warmup_windows):
            window(args.window_steps)
    except Exception as e:  # reported, not raised: a peer that fails is a result ("fails: ...")
        _say({"error": f"{type(e).__name__}: {_gist(str(e))}"})
        return
    _say({"ready": True, "first_call_s": first_call_s, "baseline_rss_mb": baseline,
          "steps_in_first_call": 1 if args.peer == "tutorial" else setup.steps_per_loop,
          "global_batch_size": setup.global_batch_size, "steps_per_loop": setup.steps_per_loop})
    for line in sys.stdin:
        if line.strip() == "run":
            t = time.perf_counter()
            window(args.window_steps)
            _say({"elapsed_s": time.perf_counter() - t})
        else:
            break
    _say({"peak_rss_mb": _rss_mb()})


if __name__ == "__main__":
    main()
