"""mwloop: custom distributed training loops for TensorFlow.

The public API, for users' tasks, configs, scripts and tests (everything docs/ and examples/ use):

- `Task`, `Sums`, `Batch`, `Endpoint`: what a user brings (see docs/tasks.md).
- `base_config(task=...)`: the config every config file starts from; `load_config("FILE[:ARG]",
  {"train.steps": 100})`: a config file with overrides, checked, as `python -m mwloop.main` gets it.
- `train_and_evaluate(config, workdir, mode)`: a run, as `python -m mwloop.main` does it.
- `Trainer`: the same run driven from Python (`train`, `evaluate`, `export`).
- `Action`: periodic work of a user's own between loop calls, given an `ActionContext`: all an action may
  touch of its run (see docs/actions.md).
- `build_optimizer(config)`: the optimizer a run builds (schedule, clipping across replicas, loss scaling).
- `LossPart`: one named part of a task's loss (docs/tasks.md, "Several losses").
- `weighted_loss`, `loss_parts` + `part_losses`: a loss (or its parts) scaled by the *global* count, and
  `apply_gradients` (the cross-replica sum, clipped by its norm), for a task's own train_step.
- `gather_global_batch` (returning a `GlobalBatch`: rows, offset): every replica's rows inside a replica step,
  for losses and metrics over the whole global batch (contrastive, in-batch negatives; docs/global_batch_losses.md).
- `open_dataset(FOLDER)`: records on disk (written by `python -m mwloop.data.convert`) for `Task.train_records`,
  and `example_seed(seed, index, epoch)`: the per-example seed a decode function gets (docs/data.md).
- `UserError`, `TaskError`, `ConfigError`: the one-line errors (exit 2 from the command line).
- `testing`: N-replica checks for a task's step functions.

Besides these names, public are the commands `python -m mwloop.main`, `mwloop.launch`, `mwloop.sweep`,
`mwloop.data.convert` and `mwloop.data.make_tfrecords`, and for sweep files
`from mwloop.sweep import product, zip_, SweepError`; every other module is internal. README.md and docs/ name
nothing else (tests/test_docs.py).

Attributes load lazily, so `import mwloop` (and the sweep tools) does not start TensorFlow.
"""

import importlib

_EXPORTS = {
    "Task": ("mwloop.task", "Task"),
    "Sums": ("mwloop.task", "Sums"),
    "Batch": ("mwloop.task", "Batch"),
    "Endpoint": ("mwloop.task", "Endpoint"),
    "TaskError": ("mwloop.task", "TaskError"),
    "UserError": ("mwloop.errors", "UserError"),
    "ConfigError": ("mwloop.config.check", "ConfigError"),
    "base_config": ("mwloop.config.base", "base_config"),
    "load_config": ("mwloop.config.base", "load_config"),
    "train_and_evaluate": ("mwloop.run.train", "train_and_evaluate"),
    "Trainer": ("mwloop.run.trainer", "Trainer"),
    "Action": ("mwloop.run.actions", "Action"),
    "ActionContext": ("mwloop.run.context", "ActionContext"),
    "build_optimizer": ("mwloop.run.state", "build_optimizer"),
    "weighted_loss": ("mwloop.step.losses", "weighted_loss"),
    "LossPart": ("mwloop.task", "LossPart"),
    "loss_parts": ("mwloop.step.losses", "loss_parts"),
    "part_losses": ("mwloop.step.losses", "part_losses"),
    "apply_gradients": ("mwloop.step.steps", "apply_gradients"),
    "gather_global_batch": ("mwloop.step.gather", "gather_global_batch"),
    "GlobalBatch": ("mwloop.step.gather", "GlobalBatch"),
    "open_dataset": ("mwloop.data.indexed", "open_dataset"),
    "example_seed": ("mwloop.data.indexed", "example_seed"),
    "testing": ("mwloop.testing", None),
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mwloop' has no attribute {name!r}")
    module_name, attribute = _EXPORTS[name]
    module = importlib.import_module(module_name)
    return module if attribute is None else getattr(module, attribute)


def __dir__() -> list[str]:
    return __all__
