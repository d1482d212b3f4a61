"""The seam between mwloop and what a user trains: `Task`.

A task is the user's part of a run: the model, the input, the per-example loss,
the metrics as additive sums, and optionally whole step functions and serving
endpoints. mwloop brings the rest (strategy, sharding checks, global-batch
scaling, reduction, the loop, checkpoints, preemption, summaries, export).
A task never sees files, flags or the cluster; it reads its settings from
`self.config`, the run's whole config.

Contract of the replica-context methods (`forward`, `loss`, `metric_sums`,
`train_step`, `eval_step`): they run once per replica inside mwloop's
`tf.function`, on this replica's batch, and return *per-replica* values that
mwloop sums across replicas with one `strategy.reduce(SUM)` per loop call. See
docs/tasks.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import threading
from typing import Any, Callable, Iterator

import keras
import ml_collections
import numpy as np
import tensorflow as tf

from mwloop import errors
from mwloop.errors import UserError

# A nest of tensors (usually a dict): one replica's batch.
Batch = Any
Sums = dict[str, tf.Tensor]
DatasetFn = Callable[[tf.distribute.InputContext], tf.data.Dataset]
Endpoint = tuple[Callable[..., Any], list[tf.TensorSpec]]
# Sums mwloop adds to every step's: the weighted loss, the weight it is divided by, the real examples.
BUILT_IN_SUMS = ("loss_sum", "weight_sum", "examples")
# The per-example padding mask mwloop's eval input adds to a dict batch (in-memory eval arrays), and the key a
# task's own eval_dataset may set to weight its examples.
MASK_KEY = "mask"
# The key of a training batch (a dict) read from records with config.dataset.skip_bad_records > 0: 1 for an example
# whose record was bad and replaced, 0 otherwise. mwloop takes it out before the task sees the batch and sums it as
# the train metric of the same name (a task's own train_step gets it in its batch).
SKIPPED_KEY = "data/skipped_records"
# Task.loss_normalization, for a single loss.
LOSS_NORMALIZATIONS = ("weights", "batch")
# What a loss part's summed (weighted) values are divided by: the global sum of its weights, the global batch
# size (examples), or the global number of loss elements (examples x elements per example).
LOSS_NORMALIZERS = ("weights", "batch", "elements")


@dataclasses.dataclass
class LossPart:
    """One named part of a task's loss (`Task.loss` may return a dict name -> LossPart).

    Attributes:
      values: unreduced per-example ([b]) or per-element ([b, t, ...]) losses of this replica's batch.
      weights: optional weights of the values' shape (a padding mask, example weights), or None.
      normalizer: what the part's summed weighted values are divided by, over the *global* batch:
        "weights" (the global sum of `weights`: per-token losses with padding; one all-reduce per step),
        "batch" (the global batch size: a per-example loss summed over its elements), or
        "elements" (the global number of loss elements).
    """
    values: Any
    weights: Any = None
    normalizer: str = "weights"


class TaskError(UserError):
    """A task that cannot run as written (a missing part, a wrong shape); the message names the fix."""


class Task:
    """Base class of a user's task. Override `build_model`, `loss`, and one of
    `train_arrays` / `train_dataset`; the rest is optional.

    Attributes:
      config: the run's whole config; a task reads its own keys from it.
      loss_normalization: when `loss` returns weights, what the summed loss is
        divided by: "weights" (default) the global sum of the weights (per-token
        losses with padding: one all-reduce per step), or "batch" the global
        number of loss elements (weights then only scale examples).
    """

    loss_normalization: str = "weights"

    def __init__(self, config: ml_collections.ConfigDict):
        self.config = config

    # ------------------------------------------------------------------ model
    def build_model(self) -> keras.Model:
        """The Keras model; mwloop calls it inside the strategy's scope (and once outside, for export)."""
        raise NotImplementedError

    def build_optimizer(self, learning_rate: Any) -> keras.optimizers.Optimizer:
        """Optional: the run's optimizer (Lion, Adafactor, per-variable settings, weight decay kept off norms
        and biases with `optimizer.exclude_from_weight_decay(var_names=[...])`), instead of the one
        `config.optimizer.name` names. `learning_rate` is the schedule config.optimizer describes (use it or
        not). Runs in the strategy's scope. mwloop still adds loss scaling (mixed_float16), clipping of the
        cross-replica sum (`config.optimizer.clip_global_norm`; leave Keras' clipnorm off), accumulation and
        the EMA (`config.optimizer.ema`), and checkpoints the optimizer's variables."""
        raise NotImplementedError

    def checkpoint_items(self) -> dict[str, Any]:
        """Extra trackables (a second optimizer, ...) made by `build_model` that checkpoints must hold."""
        return {}

    # ------------------------------------------------------------------ input
    def train_arrays(self) -> dict[str, np.ndarray] | None:
        """In-memory training arrays (same length), or None. With them mwloop builds the input itself:
        an endless stream whose order is a pure function of (seed, step), fed without tf.data
        (`train.feed="resident"`), so resume is exact with any number of workers. mwloop may call
        this (and `eval_arrays`, `build_model`) more than once: cache what you load."""
        return None

    def train_records(self) -> Any:
        """Records on disk read by global index, or None: `mwloop.open_dataset(FOLDER)` of a dataset written
        by `python -m mwloop.data.convert` (optionally with your own `decode(record_bytes, seed)`). mwloop then
        builds the input itself with the promises of `train_arrays`: step s reads the same records whatever the
        number of workers, a resume starts reading at step s (nothing before it is read), so resume and elastic
        re-forms are exact (docs/data.md). mwloop may call this more than once: cache what you open."""
        return None

    def train_dataset(self, ctx: tf.distribute.InputContext, *, global_batch_size: int, seed: int,
                      start_step: int) -> tf.data.Dataset:
        """One input pipeline's endless training batches (a `dataset_fn`), when there are no `train_arrays` nor
        `train_records`. Its order is its own: a resume with another number of workers, and an elastic job
        (--num_workers=MIN:MAX), are refused.

        Args:
          ctx: this pipeline's InputContext: shard by `ctx.input_pipeline_id` of
            `ctx.num_input_pipelines`, batch by
            `ctx.get_per_replica_batch_size(global_batch_size)` with `drop_remainder=True`.
          global_batch_size: examples per step over all replicas. With gradient accumulation
            (k micro-batches per update) a step here is a micro-step: this is
            config.train.global_batch_size / k.
          seed: the run's seed (for shuffling).
          start_step: the global step the run resumes at (0 for a fresh run; in micro-steps, update x k,
            with accumulation); skip what came before to resume exactly.
        Returns:
          A `tf.data.Dataset` of per-replica batches, repeated.
        """
        raise NotImplementedError

    def eval_arrays(self) -> dict[str, np.ndarray] | None:
        """In-memory eval arrays, or None; mwloop pads the last batch and masks it (each example once)."""
        return None

    def eval_dataset(self, ctx: tf.distribute.InputContext, *, global_batch_size: int) -> tf.data.Dataset:
        """One input pipeline's eval batches, when there are no `eval_arrays` (without either: no eval).

        A finite dataset, sharded by `ctx.input_pipeline_id` and batched by the per-replica batch
        size; the last batch may be partial and pipelines may run out at different steps (mwloop
        reads it with `get_next_as_optional`). A float `"mask"` entry of a dict batch, if present,
        weights each example (0 for padding).
        """
        raise NotImplementedError

    def eval_sets(self) -> dict[str, Any]:
        """Optional: named eval sets besides the main one, each evaluated at every eval and reported as
        split `eval_<name>` (metrics.jsonl, TensorBoard): name -> in-memory arrays (a dict, as
        `eval_arrays` returns) or a function `fn(ctx, *, global_batch_size) -> tf.data.Dataset` (as
        `eval_dataset`)."""
        return {}

    # ------------------------------------------------------------------ replica context
    def forward(self, model: keras.Model, batch: Batch, training: bool) -> Any:
        """The model's outputs for a batch. Default: `model(batch["inputs"], training=training)`."""
        return model(batch["inputs"], training=training)

    def loss(self, batch: Batch, outputs: Any) -> Any:
        """Per-example (shape [b]) or per-token ([b, t]) losses, optionally with weights of that shape;
        or several named parts: a dict name -> `LossPart(values, weights, normalizer)` (or a
        (values, weights) pair: normalizer "weights").

        Do not reduce: mwloop sums and divides by the *global* count (see `loss_normalization`, and
        `LossPart.normalizer`). The total loss is the sum of the normalised parts weighted by
        `loss_weights()`; each part is reported as `loss/<name>`, the total as `loss`.
        """
        raise NotImplementedError

    def loss_weights(self) -> dict[str, float]:
        """Weights of the loss parts in the total (missing parts: 1). Default: `config.loss_weights` if the
        config has it (a ConfigDict name -> float: overridable and sweepable like any key), else all 1."""
        weights = self.config.get("loss_weights") if self.config is not None else None
        return {str(k): float(v) for k, v in weights.items()} if weights else {}

    def compute_loss(self, model: keras.Model, batch: Batch, training: bool) -> tuple[Any, Any]:
        """Optional: the forward pass and the loss in one method, for a loss that needs more than the model's
        outputs (an auxiliary forward, a teacher, intermediate activations). Returns (loss, outputs): the loss
        as `loss` returns it (one loss or a dict of parts), the outputs for `metric_sums`. mwloop still does
        the rest of the step (global normalisation, gradients, clipping, accumulation, skipping, apply).
        Default: `forward`, then `loss`."""
        outputs = self.forward(model, batch, training=training)
        return self.loss(batch, outputs), outputs

    def metric_sums(self, batch: Batch, outputs: Any, weights: Any, mask: tf.Tensor | None = None) -> Sums:
        """Additive scalar sums over this replica's batch, e.g. {"correct": sum(correct * weights)}.

        `weights` has the loss's shape: the loss weights (ones without them) times the eval padding
        mask; with loss parts, a dict part name -> such weights. `mask` ([batch], if your method takes
        the keyword): 1 for each real example, 0 for eval padding, for example-level metrics of a per-token
        task. mwloop adds `loss_sum`, `weight_sum` and `examples` itself (per part: `loss_sum/<name>`,
        `weight_sum/<name>`).
        """
        del batch, outputs, weights, mask
        return {}

    def finalize(self, sums: dict[str, float]) -> dict[str, float]:
        """Reported values from globally summed sums (means, ratios, perplexity, R^2...).

        Runs in Python once per log or eval; `sums` maps every sum's name (the task's and mwloop's
        `loss_sum`, `weight_sum`, `examples`) to a Python float. mwloop reports `loss`
        (loss_sum / weight_sum) and `examples` besides what this returns.
        """
        del sums
        return {}

    def train_step(self, model: keras.Model, optimizer: keras.optimizers.Optimizer, batch: Batch,
                   global_batch_size: int) -> Sums:
        """Optional: a whole per-replica train step, replacing mwloop's (two optimizers, penalties...).

        Must apply its own updates (`mwloop.apply_gradients(model, optimizer, grads, clip_global_norm)`
        sums gradients across replicas and clips their sum) and return sums including `loss_sum`,
        `weight_sum` and `examples` (or `loss_sum/<part>`, `weight_sum/<part>` per part);
        `mwloop.weighted_loss` scales a loss by the global count. Gradient accumulation and skipping
        non-finite updates need mwloop's step: for a loss that needs its own forward pass, override
        `compute_loss` instead, which keeps them.
        """
        raise NotImplementedError

    def eval_step(self, model: keras.Model, batch: Batch) -> Sums:
        """Optional: a whole per-replica eval step returning sums (default: forward, loss, metric_sums)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ export
    def serving_endpoints(self, model: keras.Model) -> dict[str, Endpoint]:
        """Named SavedModel endpoints: name -> (function, input signature). Default: `serve`, the
        model itself on its inputs (a tensor, list or dict, as the model takes them)."""
        try:
            inputs = model.input
        # A Sequential model knows only its list of inputs.
        except (AttributeError, ValueError):
            inputs = getattr(model, "inputs", None) or None
            inputs = inputs[0] if inputs is not None and len(inputs) == 1 else inputs
        if inputs is None:
            raise TaskError(f"task {type(self).__name__}: the model has no known input signature (a subclassed "
                            f"model?); define serving_endpoints, or set config.export=False")
        signature = tf.nest.map_structure(lambda x: tf.TensorSpec(x.shape, x.dtype, name=x.name), inputs)
        return {"serve": (lambda features: model(features, training=False), [signature])}

    # ------------------------------------------------------------------ introspection
    def overrides(self, name: str) -> bool:
        """Whether this task defines `name` itself rather than inheriting Task's default."""
        return getattr(type(self), name) is not getattr(Task, name)


def resolve(spec: str | type, config: ml_collections.ConfigDict) -> Task:
    """The task a config names: an import string "package.module:Class" (or "package.module.Class")
    or a Task subclass (e.g. defined in the config file), instantiated with `config`."""
    cls = import_object(spec, "config.task") if isinstance(spec, str) else spec
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise TaskError(f"config.task={spec!r} is {cls!r}, not a subclass of mwloop.Task; "
                        f"point it at your Task class ('package.module:Class')")
    task = cls(config)
    check(task)
    return task


def import_object(spec: str, setting: str) -> Any:
    """What an import string "package.module:Name" (or "package.module.Name") names; `setting` is the
    config key it came from, for the one-line errors."""
    module_name, sep, attribute = spec.partition(":")
    if not sep:
        module_name, _, attribute = spec.rpartition(".")
    fix = "use 'package.module:Class' importable from the working directory or an installed package"
    if not module_name or not attribute:
        raise TaskError(f"{setting}={spec!r} is not an import string; {fix}")
    try:
        with _exits_named(f"{setting}={spec!r}: importing {module_name}"):
            module = importlib.import_module(module_name)
    # The user's module: where, not a traceback into importlib.
    except SyntaxError as e:
        raise TaskError(f"{setting}={spec!r}: {e.filename}:{e.lineno}: {e.msg}; fix the module") from None
    except ImportError as e:
        raise TaskError(f"{setting}={spec!r} does not resolve ({e}); {fix}") from None
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise TaskError(f"{setting}={spec!r} does not resolve: module {module_name!r} has no "
                        f"{attribute!r}; {fix}") from None


class _ProcessExit(BaseException):
    """os._exit(code) called while a user's module was imported (the guard's stand-in: the real one cannot be
    caught)."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


@contextlib.contextmanager
def _exits_named(what: str) -> Iterator[None]:
    """Around an import of the user's module: code there that ends the process (sys.exit, argparse's
    parse_args reading mwloop's command line, a library's SystemExit, os._exit called from Python) becomes a
    TaskError naming it, its file and line, so the run ends with exit 2 in one line.

    os._exit ends the process without unwinding, so it is replaced for the import by a stand-in that raises,
    in this thread of this process only (a child forked meanwhile and other threads get the real one). What
    no guard here catches: a C extension's exit(), a module that took os._exit before the guard (`from os
    import _exit` in a module imported earlier), a signal; that process ends with its own code and output.
    """
    real_exit, pid, thread = os._exit, os.getpid(), threading.get_ident()

    def stand_in(code: int) -> None:
        if os.getpid() == pid and threading.get_ident() == thread:
            raise _ProcessExit(code)
        real_exit(code)

    os._exit = stand_in
    try:
        yield
    except (SystemExit, _ProcessExit) as exit:
        call = "os._exit" if isinstance(exit, _ProcessExit) else "sys.exit"
        where = errors.exit_site(exit, innermost_is_mwloops=isinstance(exit, _ProcessExit))
        raise TaskError(f"{what} ended the process: user code called {call}({exit.code!r}){where}; a module must "
                        f"not exit or parse the command line when imported: move that under `if __name__ == "
                        f"'__main__':`, or raise an exception that says what is wrong") from None
    finally:
        os._exit = real_exit


def check(task: Task) -> None:
    """One-line errors for a task missing a required part, before anything is built."""
    name = type(task).__name__
    if task.loss_normalization not in LOSS_NORMALIZATIONS:
        raise TaskError(f"task {name}: loss_normalization={task.loss_normalization!r}; use 'weights' or 'batch'")
    if not task.overrides("build_model"):
        raise TaskError(f"task {name} does not define build_model(self) -> keras.Model; add it")
    if not (task.overrides("loss") or task.overrides("compute_loss") or task.overrides("train_step")):
        raise TaskError(f"task {name} defines neither loss(self, batch, outputs) nor train_step; add loss, "
                        f"returning per-example values")
    if not (task.overrides("train_arrays") or task.overrides("train_records") or task.overrides("train_dataset")):
        raise TaskError(f"task {name} defines none of train_arrays(self), train_records(self) and "
                        f"train_dataset(self, ctx, ...); add one to give it training data")
    if task.overrides("eval_dataset") or task.overrides("eval_arrays"):
        if not (task.overrides("loss") or task.overrides("compute_loss") or task.overrides("eval_step")):
            raise TaskError(f"task {name} has eval data but neither loss nor eval_step; add loss")
