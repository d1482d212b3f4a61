"""A task's input, distributed: the train feed and the eval dataset, with their batch sizes checked."""

from __future__ import annotations

import functools
from typing import Any, Iterator

import ml_collections
import tensorflow as tf

from mwloop.data import faults, pipeline
from mwloop.loop import feed
from mwloop.task import MASK_KEY, DatasetFn, Task, TaskError


def _threads(config: ml_collections.ConfigDict) -> int:
    return config.dataset.get("threads", 0) if "dataset" in config else 0


def checked(dataset_fn: DatasetFn, *, global_batch_size: int, what: str, static: bool) -> DatasetFn:
    """`dataset_fn` whose batches must have the per-replica batch size it was given.

    `static`: the size must be known from the dataset's shapes (training: `drop_remainder=True`);
    otherwise a batch of unknown size (a partial last eval batch) passes.
    """
    def checked_fn(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        want = pipeline.per_replica_batch_size(global_batch_size, ctx)
        dataset = dataset_fn(ctx)
        if not isinstance(dataset, tf.data.Dataset):
            raise TaskError(f"{what} returned {type(dataset).__name__}, not a tf.data.Dataset")
        for spec in tf.nest.flatten(dataset.element_spec):
            got = spec.shape[0] if spec.shape.rank else None
            if spec.shape.rank == 0 or (got is not None and got != want):
                raise TaskError(f"{what} yields batches of {got if spec.shape.rank else 'scalars'} where the "
                                f"per-replica batch size is {want}; batch by "
                                f"ctx.get_per_replica_batch_size(global_batch_size)")
            if got is None and static:
                raise TaskError(f"{what} yields batches of unknown size; batch training data with "
                                f"drop_remainder=True so every step has {want} examples per replica")
        return dataset
    return checked_fn


def check_train_arrays(task: Task) -> None:
    """A task whose training arrays are empty: one line, before anything is written."""
    arrays = task.train_arrays()
    if arrays is not None and not len(next(iter(arrays.values()))):
        raise TaskError(f"{type(task).__name__}.train_arrays has 0 examples: there is nothing to train on")


def keeps_order_across_worker_counts(task: Task) -> bool:
    """Whether the task's training data reads the same examples at every step whatever the number of workers:
    mwloop's own streams (train_arrays, train_records) do; a task's own train_dataset does not (its sharding is
    its own)."""
    return task.train_arrays() is not None or task.train_records() is not None


def accumulation_steps(config: ml_collections.ConfigDict) -> int:
    """Micro-batches per optimizer update (config.optimizer.gradient_accumulation_steps)."""
    return config.optimizer.get("gradient_accumulation_steps", 1)


def train_dataset_fn(config: ml_collections.ConfigDict, task: Task, start_step: int) -> DatasetFn:
    """The task's training dataset_fn from update `start_step`: its arrays' or records' seeded stream, or its own.

    With k micro-batches per update, the dataset is the same stream cut into micro-batches: it is built
    for a global batch of global_batch_size / k from micro-step start_step * k, so update s reads the
    stream positions [s * B, (s + 1) * B) whatever k is.
    """
    arrays = task.train_arrays()
    k = accumulation_steps(config)
    global_batch_size, start_step = config.train.global_batch_size // k, start_step * k
    if arrays is not None:
        return functools.partial(pipeline.array_train_dataset, arrays, global_batch_size=global_batch_size,
                                 seed=config.seed, start_step=start_step, threads=_threads(config))
    on_disk = task.train_records()
    if on_disk is not None:
        tuning = config.dataset if "dataset" in config else {}
        return functools.partial(on_disk.train_dataset, global_batch_size=global_batch_size, seed=config.seed,
                                 start_step=start_step, threads=_threads(config),
                                 parallel_calls=tuning.get("parallel_calls", pipeline.AUTOTUNE),
                                 prefetch=tuning.get("prefetch", pipeline.AUTOTUNE),
                                 skip_bad_records=tuning.get("skip_bad_records", 0.0))
    return checked(functools.partial(task.train_dataset, global_batch_size=global_batch_size, seed=config.seed,
                                     start_step=start_step),
                   global_batch_size=global_batch_size, what=f"{type(task).__name__}.train_dataset", static=True)


def train_input(config: ml_collections.ConfigDict, strategy: tf.distribute.Strategy, task: Task,
                step: tf.Variable) -> Iterator | feed.FeedAtStep:
    """What the train loop reads from the current `step` on: a resident feed or a distributed iterator."""
    start = int(step.numpy())
    nan_steps = [s for s in config.nan_at_steps if s > 0]
    arrays = task.train_arrays()
    if config.train.feed == "resident" and arrays is not None and not nan_steps:
        # The loop reads `step` each call (the Trainer advances it after each call): resume needs no iterator state.
        return feed.ResidentFeed(strategy, arrays, global_batch_size=config.train.global_batch_size,
                                 seed=config.seed, steps_per_call=config.train.steps_per_loop,
                                 accumulation_steps=accumulation_steps(config)).at(step)
    # tf.data: the task's own pipeline, or the NaN fault drill (it injects NaN into tf.data batches).
    dataset_fn = faults.nan_at_steps(train_dataset_fn(config, task, start), nan_steps, start_step=start,
                                     accumulation_steps=accumulation_steps(config))
    return iter(strategy.distribute_datasets_from_function(dataset_fn))


def eval_datasets(config: ml_collections.ConfigDict, strategy: tf.distribute.Strategy,
                  task: Task) -> dict[str, Any]:
    """The task's distributed eval sets by split name: "eval" (eval_arrays / eval_dataset), then
    "eval_<name>" for each of its eval_sets; empty when it has none."""
    name = type(task).__name__
    sources: dict[str, Any] = {}
    if task.eval_arrays() is not None:
        sources["eval"] = task.eval_arrays()
    elif task.overrides("eval_dataset"):
        sources["eval"] = task.eval_dataset
    for set_name, source in task.eval_sets().items():
        if not isinstance(set_name, str) or not set_name.isidentifier():
            raise TaskError(f"{name}.eval_sets has the name {set_name!r}; use identifiers (letters, digits, _)")
        sources[f"eval_{set_name}"] = source
    return {split: strategy.distribute_datasets_from_function(_eval_dataset_fn(config, task, split, source))
            for split, source in sources.items()}


def _eval_dataset_fn(config: ml_collections.ConfigDict, task: Task, split: str, source: Any) -> DatasetFn:
    """In-memory arrays padded and masked (every example once), or the task's own eval dataset_fn, checked."""
    global_batch_size = config.eval.global_batch_size
    main = "eval_arrays" if isinstance(source, dict) else "eval_dataset"
    what = f"{type(task).__name__}.{main if split == 'eval' else f'eval_sets()[{split[5:]!r}]'}"
    if isinstance(source, dict):
        if MASK_KEY in source:
            raise TaskError(f"{what} has a key {MASK_KEY!r}, which mwloop sets to the eval padding mask (1 for a "
                            f"real example, 0 for padding); rename your key")
        if not len(next(iter(source.values()))):
            raise TaskError(f"{what} has 0 examples: there is nothing to evaluate; give it eval data "
                            f"(config.dataset.eval_fraction > 0 for the digits), or run --mode=train")
        return functools.partial(pipeline.array_eval_dataset, source, global_batch_size=global_batch_size,
                                 threads=_threads(config))
    if not callable(source):
        raise TaskError(f"{what} is {type(source).__name__}; give a dict of arrays or a dataset function")
    return checked(functools.partial(source, global_batch_size=global_batch_size),
                   global_batch_size=global_batch_size, what=what, static=False)
