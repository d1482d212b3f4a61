"""The config every config file starts from (configs/*.py change what differs), and loading a config file.

The knobs themselves, with their defaults and docs, are declared once in `mwloop.config.schema`.
"""

from __future__ import annotations

import importlib.util
import os

import ml_collections

from mwloop import errors
from mwloop.config import check as config_check
from mwloop.config import schema
from mwloop.errors import UserError

CLASSIFICATION = schema.CLASSIFICATION


def base_config(task: str | type = CLASSIFICATION) -> ml_collections.ConfigDict:
    """The full config schema: every knob of `mwloop.config.schema` at its default (its doc is there). Fields
    that may stay unset are typed placeholders, so `--config.x=y` can still set them.

    Args:
      task: the run's `mwloop.Task`: an import string "package.module:Class" (overridable with
        `--config.task=...`), or the class itself (e.g. defined in the config file).
    Returns:
      The config; `dataset`, `model` and `train.label_smoothing` are the built-in classification
      task's keys, which other tasks may reuse or replace.
    """
    return schema.TABLE.defaults(task=task)


def load_config(spec: str, overrides: dict | None = None) -> ml_collections.ConfigDict:
    """The config `python -m mwloop.main --config=SPEC --config.KEY=VALUE ...` would run, checked.

    Args:
      spec: "FILE" or "FILE:ARG", as `--config=` takes it.
      overrides: {"train.steps": 100, ...}, as `--config.train.steps=100` would set them.
    Returns:
      The config, through `config_check.check`.
    Raises:
      UserError: a missing file, an unknown key or a wrong type, or a setting that cannot work, in one line.
    """
    path, arg = spec, None
    if not os.path.isfile(spec) and ":" in spec:
        path, _, arg = spec.rpartition(":")
    return load(path, arg, overrides)


def load(path: str, arg: str | None = None, overrides: dict | None = None, *,
         check: bool = True) -> ml_collections.ConfigDict:
    """A config file's get_config(arg) with dotted-key overrides applied (type-checked), then checked.

    Args:
      path: the config file.
      arg: what get_config receives (None: no argument was given).
      overrides: {"train.steps": 100, ...}, as `--config.train.steps=100` would set them.
      check: run `config_check.check` on the result (tests of the checks themselves turn it off).
    Returns:
      The config a run of `python -m mwloop.main --config=... --config.KEY=VALUE` would get.
    Raises:
      UserError: a missing file, an unknown key or a wrong type, or a setting that cannot work, in one line.
    """
    if not os.path.isfile(path):
        raise UserError(f"config file {path!r} not found; give the path of a file defining get_config(arg)")
    spec = importlib.util.spec_from_file_location(f"config_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(arg)
    # As --config.KEY=VALUE: a key that is not in the config is an error, not a new field.
    config.lock()
    for key, value in (overrides or {}).items():
        try:
            config.update_from_flattened_dict({key: value})
        except (KeyError, AttributeError, TypeError, ValueError) as e:
            raise UserError(f"config override {key}={value!r}: {errors.one_line(e)}; check the key and the "
                            f"type") from None
    config.unlock()
    if check:
        config_check.check(config)
    return config
