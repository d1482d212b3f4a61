"""A hash of the traced train loop's graph, to show a refactoring changed no op of it.

    python -m benchmarks.step_graph [--cases=mlp] [--strategies=default,mirrored] [--k=1]

For each (case, strategy) it builds the case's task, model and optimizer as a run does, traces the train
loop for one call of `steps_per_loop` steps (the unrolled trace) and prints a SHA-256 of its GraphDef
(the loop function and every function it calls). Numeric suffixes that TensorFlow adds to make names unique
(`while_12`, `__inference_train_loop_fn_345`) are normalised, so two processes that traced other functions
first still hash alike; any added, removed or changed op or attribute changes the hash. Run it on two
checkouts (PYTHONPATH) and compare.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import os
import re

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
CASES = {  # as benchmarks.peers' (copied: this script also runs against other checkouts' mwloop)
    "mlp": ("mlp", None, {"train.global_batch_size": 64, "train.steps_per_loop": 50}),
    "resnet_digits": ("resnet", "digits", {"train.steps_per_loop": 50}),
}


def graph_hash(case: str, strategy_name: str, accumulation_steps: int = 1) -> str:
    """The normalised GraphDef hash of the case's train loop under `strategy_name`."""
    import keras
    import tensorflow as tf

    import mwloop
    from mwloop.config import base as config_base
    from mwloop.loop import inputs
    from mwloop.loop import loops as loop
    from mwloop.run import state
    from mwloop.tasks.classification import ImageClassification
    strategy = tf.distribute.get_strategy()
    if strategy_name == "mirrored":
        strategy = tf.distribute.MirroredStrategy([d.name for d in tf.config.list_logical_devices("CPU")][:2])
    name, variant, overrides = CASES[case]
    root = os.path.dirname(os.path.dirname(os.path.abspath(mwloop.__file__)))  # the checkout under test
    config = config_base.load(os.path.join(root, "configs", f"{name}.py"), variant, overrides)
    config.optimizer.gradient_accumulation_steps = accumulation_steps
    config.optimizer.clip_global_norm = 0.0
    task = ImageClassification(config)
    keras.utils.set_random_seed(0)
    built = state.create(config, strategy, task)
    train_input = inputs.train_input(config, strategy, task, built.step)
    train_loop = loop.make_train_loop(strategy, task, built.model, built.optimizer,
                                      global_batch_size=config.train.global_batch_size)
    num_steps = config.train.steps_per_loop
    train_loop(train_input, num_steps)
    fn = inspect.getclosurevars(train_loop).nonlocals["train_loop_fn"]
    concrete = fn._list_all_concrete_functions_for_serialization() or fn._list_all_concrete_functions()
    texts = []
    for function in concrete:
        graph_def = function.graph.as_graph_def()
        texts.append(str(graph_def))
    text = "\n".join(sorted(re.sub(r"_\d+", "_N", t) for t in texts))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="mlp")
    parser.add_argument("--strategies", default="default,mirrored")
    parser.add_argument("--k", type=int, default=1)
    args = parser.parse_args()
    from mwloop.cluster import distribute
    distribute.configure_cpu_devices(2)
    for case in args.cases.split(","):
        for strategy_name in args.strategies.split(","):
            print(f"{case} {strategy_name} k={args.k}: {graph_hash(case, strategy_name, args.k)}", flush=True)


if __name__ == "__main__":
    main()
