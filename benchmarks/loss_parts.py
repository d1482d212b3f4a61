"""N replicas == 1 replica for a loss of several parts with uneven padding (examples/detection.py).

    python -m benchmarks.loss_parts [--updates=20] [--launcher]

In one process with the CPU split into 4 logical devices: 20 updates (SGD, momentum 0.9) of the detection
task (1 to 8 real objects per example; class and box parts normalised by the global number of real objects,
the count part by the global batch) through mwloop's train loop and resident feed, on 1 replica with the
whole batch, on 2 and 4 replicas, and with k=4 micro-batches on 2 replicas (or, with --launcher, through
`mwloop.main` on 1 replica against `mwloop.launch --num_workers=2`: 2 worker processes). Prints the largest
weight difference relative to the largest weight, and each reported train loss part's relative difference.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
GLOBAL_BATCH, SEED = 32, 5


def run(strategy, k: int, updates: int):
    """(weights, finalized metrics) after `updates` updates of the detection task."""
    import keras
    import tensorflow as tf

    from examples.detection import Detection
    from mwloop.config import base as config_base
    from mwloop.loop import feed
    from mwloop.loop import loops as loop
    from mwloop.run import state
    from mwloop.step import steps
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    config = config_base.load(os.path.join(root, "configs", "detection.py"), None,
                              {"distribution.strategy": "default", "dataset.num_train_examples": 203})
    config.optimizer.update({"name": "sgd", "learning_rate": 0.05, "schedule": "constant", "momentum": 0.9,
                             "gradient_accumulation_steps": k})
    task = Detection(config)
    keras.utils.set_random_seed(0)
    built = state.create(config, strategy, task)
    options = steps.StepOptions.from_config(config, global_batch_size=GLOBAL_BATCH)
    train_loop = loop.make_train_loop(strategy, task, built.model, built.optimizer, options)
    source = feed.ResidentFeed(strategy, task.train_arrays(), global_batch_size=GLOBAL_BATCH, seed=SEED,
                               steps_per_call=updates, accumulation_steps=k).at(built.step)
    sums, _ = train_loop(source, tf.constant(updates))
    return [v.numpy() for v in built.model.trainable_variables], steps.finalize(task, sums)


def _child(replicas: int, k: int, updates: int, out: str) -> None:
    """One run in this process (several MirroredStrategies in one process abort each other's collectives)."""
    import json

    import numpy as np

    from mwloop import testing
    testing.split_cpu(4)
    weights, metrics = run(testing.replica_strategy(replicas), k, updates)
    np.savez(out, *weights)
    with open(out + ".json", "w") as f:
        json.dump(metrics, f)


def _spawn(replicas: int, k: int, updates: int, directory: str):
    import json
    import subprocess
    import sys

    import numpy as np
    out = os.path.join(directory, f"r{replicas}k{k}.npz")
    subprocess.run([sys.executable, "-m", "benchmarks.loss_parts", f"--child={replicas},{k}", f"--out={out}",
                    f"--updates={updates}"], check=True)
    with np.load(out) as arrays:
        weights = [arrays[f"arr_{i}"] for i in range(len(arrays.files))]
    with open(out + ".json") as f:
        return weights, json.load(f)


def _launched(updates: int, directory: str) -> None:
    """The same run through `python -m mwloop.main` on 1 replica and `python -m mwloop.launch --num_workers=2`
    (2 worker processes, MultiWorkerMirroredStrategy): the checkpoints' weights and each part's train loss."""
    import json
    import subprocess
    import sys

    import numpy as np
    import tensorflow as tf

    from mwloop import testing
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    flags = ["--config=configs/detection.py", "--config.dataset.num_train_examples=203",
             f"--config.train.global_batch_size={GLOBAL_BATCH}", f"--config.train.steps={updates}",
             f"--config.train.steps_per_loop={updates}", f"--config.train.log_every_steps={updates}",
             f"--config.train.eval_every_steps={updates}", f"--config.train.checkpoint_every_steps={updates}",
             "--config.optimizer.name=sgd", "--config.optimizer.learning_rate=0.05",
             "--config.optimizer.schedule=constant", "--config.optimizer.momentum=0.9", "--config.export=False",
             f"--config.seed={SEED}"]
    env = dict(os.environ, PYTHONPATH=root, GCE_METADATA_IP="127.0.0.1:9")
    runs = {"1 replica": ([sys.executable, "-m", "mwloop.main"], ["--config.distribution.strategy=default"]),
            "2 workers (launcher)": ([sys.executable, "-m", "mwloop.launch", "--num_workers=2", "--"], [])}
    results = {}
    for name, (command, overrides) in runs.items():  # overrides after --config=
        workdir = os.path.join(directory, name.split()[0])
        subprocess.run(command + flags + overrides + [f"--workdir={workdir}"], cwd=root, env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        reader = tf.train.load_checkpoint(os.path.join(workdir, "checkpoints"))
        prefix = "optimizer/_trainable_variables/"  # where Keras 3's model weights sit in the checkpoint
        names = sorted((n for n in reader.get_variable_to_shape_map() if n.startswith(prefix)),
                       key=lambda n: int(n[len(prefix):].split("/")[0]))
        assert names, "no model weights found in the checkpoint"
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            events = [json.loads(line) for line in f if line.strip()]
        train = [e for e in events if e.get("split") == "train"][-1]
        evaluation = [e for e in events if e.get("split") == "eval"][-1]
        results[name] = ([np.asarray(reader.get_tensor(n)) for n in names], train, evaluation)
    single, single_train, single_eval = results["1 replica"]
    weights, train, evaluation = results["2 workers (launcher)"]
    keys = ("loss", "loss/cls", "loss/box", "loss/count")
    figures = [testing.relative_difference(weights, single)] + [
        abs(train[k] - single_train[k]) / abs(single_train[k]) for k in keys]
    print(f"{'2 workers (launcher)':<22} " + " ".join(f"{f:>9.1e}" if i == 0 else f"{f:>10.1e}"
                                                    for i, f in enumerate(figures))
          + f"   eval loss {abs(evaluation['loss'] - single_eval['loss']) / single_eval['loss']:.1e}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--updates", type=int, default=20)
    parser.add_argument("--child", default="", help="replicas,k: one run (internal)")
    parser.add_argument("--out", default="")
    parser.add_argument("--launcher", action="store_true", help="instead: 1 replica vs 2 workers through mwloop.launch")
    args = parser.parse_args()
    if args.child:
        replicas, k = map(int, args.child.split(","))
        _child(replicas, k, args.updates, args.out)
        return
    import tempfile

    from mwloop import testing
    with tempfile.TemporaryDirectory() as directory:
        keys = ("loss", "loss/cls", "loss/box", "loss/count")
        print(f"{'run':<22} {'weights':>9} " + " ".join(f"{k:>10}" for k in keys))
        if args.launcher:
            _launched(args.updates, directory)
            return
        single, single_metrics = _spawn(1, 1, args.updates, directory)
        for name, replicas, k in (("2 replicas", 2, 1), ("4 replicas", 4, 1), ("2 replicas, k=4", 2, 4)):
            weights, metrics = _spawn(replicas, k, args.updates, directory)
            figures = [testing.relative_difference(weights, single)] + [
                abs(metrics[key] - single_metrics[key]) / abs(single_metrics[key]) for key in keys]
            print(f"{name:<22} " + " ".join(f"{f:>9.1e}" if i == 0 else f"{f:>10.1e}"
                                            for i, f in enumerate(figures)), flush=True)


if __name__ == "__main__":
    main()
