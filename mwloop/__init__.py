"""mwloop: custom distributed training loops for TensorFlow.

The public API, for users' tasks, scripts and tests:

- `mwloop.Task`, `mwloop.TaskError`: what a user brings (see docs/tasks.md).
- `mwloop.train_and_evaluate(config, workdir, mode)`: a run, as `python -m mwloop.main` does it.
- `mwloop.Trainer`: the same run driven from Python (`train`, `evaluate`, `export`).
- `mwloop.Action`: periodic work of a user's own between loop calls (see docs/actions.md).
- `mwloop.base_config(task=...)`: the config every config file starts from.
- `mwloop.testing`: N-replica checks for a task's step functions.
- `mwloop.steps`: mwloop's per-replica steps and `weighted_loss`, for custom steps.

Attributes load lazily, so `import mwloop` (and the sweep tools) does not start TensorFlow.
"""

import importlib

_EXPORTS = {
    "Task": ("mwloop.task", "Task"),
    "TaskError": ("mwloop.task", "TaskError"),
    "train_and_evaluate": ("mwloop.train", "train_and_evaluate"),
    "Trainer": ("mwloop.trainer", "Trainer"),
    "Action": ("mwloop.actions", "Action"),
    "base_config": ("mwloop.config_base", "base_config"),
    "testing": ("mwloop.testing", None),
    "steps": ("mwloop.steps", None),
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mwloop' has no attribute {name!r}")
    module_name, attribute = _EXPORTS[name]
    module = importlib.import_module(module_name)
    return module if attribute is None else getattr(module, attribute)
