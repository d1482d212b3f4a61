"""Checks and names sweep points against the config, before anything runs.

Each point's overrides are applied to a copy of the config with
`update_from_flattened_dict` (type-checked), then parsed back from the exact
`--config.KEY=VALUE` flags `mwloop.main` will receive, so a typo, a wrong type
or a value that would not survive the command line fails the whole sweep at once.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import json
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections
from absl import flags, logging
from ml_collections import config_flags

from mwloop import errors
from mwloop.artifacts import jsonl
from mwloop.config import check as config_check
from mwloop.sweep.runner import Point, held_stderr
from mwloop.sweep.values import Overrides, SweepError, format_value

# The longest directory name of a point, in characters (a longer one is cut and ends in a hash).
MAX_NAME = 120

def normalize(point: Mapping[str, Any]) -> Overrides:
    # ml_collections 1.1.0 can't override lists from the command line; config fields are tuples.
    return {key: tuple(value) if isinstance(value, list) else value for key, value in point.items()}


def parse_config(config_spec: str, override_flags: Sequence[str] = ()) -> ml_collections.ConfigDict:
    """The config exactly as `mwloop.main` will see it: the same config_flags parsing of the same argv."""
    argv = ["mwloop.main", f"--config={config_spec}", *override_flags]
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", flag_values=flag_values, lock_config=True, sys_argv=argv)
    # config_flags loads files with the deprecated load_module().
    with warnings.catch_warnings(), held_stderr():
        warnings.simplefilter("ignore", DeprecationWarning)
        flag_values(argv)
    return flag_values.config


def flag_value(value: Any) -> str:
    """`value` as the text after `--config.key=` that config_flags parses back to `value`."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, dict, float)):
        # Floats: repr is the shortest exact text; tuples and dicts are parsed back by literal_eval.
        return repr(value)
    # Ints; strings go through unparsed.
    return str(value)


def _flat_keys(config: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in config.items():
        keys.append(prefix + key)
        if isinstance(value, ml_collections.ConfigDict):
            keys += _flat_keys(value, f"{prefix}{key}.")
    return keys


def config_value(config: ml_collections.ConfigDict, key: str) -> Any:
    for part in key.split("."):
        config = config[part]
    return config


def _type_check(base: ml_collections.ConfigDict, point: Overrides) -> ml_collections.ConfigDict:
    """update_from_flattened_dict on a copy, one key at a time, so the error names the key; returns the copy."""
    known = _flat_keys(base)
    config = copy.deepcopy(base)
    for key, value in point.items():
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            raise SweepError(f"unknown config key {key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        current = config_value(config, key)
        try:
            config.update_from_flattened_dict({key: value})
        except (TypeError, ValueError) as e:
            expected = type(current).__name__ if current is not None else "a typed placeholder"
            raise SweepError(f"{key}={value!r} is a {type(value).__name__} but the config field is "
                             f"{expected} ({current!r})") from e
    return config


def check_point(config_spec: str, base: ml_collections.ConfigDict, overrides: Overrides) -> tuple[list[str], Any]:
    """Type-checks `overrides`, proves they survive the command line and checks the resulting config
    (`config_check.check`, as mwloop.main will); returns (flags, resolved config)."""
    expected = _type_check(base, overrides)
    override_flags = [f"--config.{key}={flag_value(value)}" for key, value in overrides.items()]
    try:
        config = parse_config(config_spec, override_flags)
    # config_flags raises KeyError, TypeError, flags.Error...
    except Exception as e:
        raise SweepError(f"the overrides do not parse as flags {override_flags}: {errors.one_line(e)}") from e
    for key in overrides:
        if config_value(config, key) != config_value(expected, key):
            raise SweepError(f"{key}={overrides[key]!r} reaches mwloop.main as {config_value(config, key)!r} "
                             f"(flag {flag_value(overrides[key])!r})")
    try:
        # The same check every entry point runs: a value no run can take.
        config_check.check(config)
    except config_check.ConfigError as e:
        raise SweepError(str(e)) from None
    return override_flags, config


def swept_keys(points: Sequence[Overrides]) -> list[str]:
    """Every key any point sets, in order of first appearance."""
    return list(dict.fromkeys(key for point in points for key in point))


def _determines(points: Sequence[Overrides], key: str, other: str) -> bool:
    """Whether `key`'s value fixes `other`'s in every point (e.g. batch size -> scaled steps)."""
    seen: dict[str, str] = {}
    for p in points:
        value, dependent = repr(p.get(key, "<unset>")), repr(p.get(other, "<unset>"))
        if seen.setdefault(value, dependent) != dependent:
            return False
    return True


def name_keys(points: Sequence[Overrides]) -> list[str]:
    """The keys that tell points apart: not constants, nor keys that follow another (zipped) key."""
    keys = swept_keys(points)
    varying = [k for k in keys if len({repr(p.get(k, "<unset>")) for p in points}) > 1]
    named: list[str] = []
    for key in varying:
        # Dropping only keys fixed by a named key keeps names unique.
        if not any(_determines(points, kept, key) for kept in named):
            named.append(key)
    return named or keys


def short_labels(keys: Sequence[str]) -> dict[str, str]:
    """Last path component ("learning_rate"), or the full path where two keys share it."""
    last = [key.rsplit(".", 1)[-1] for key in keys]
    return {key: short if last.count(short) == 1 else key for key, short in zip(keys, last)}


def point_names(points: Sequence[Overrides]) -> list[str]:
    """Readable, filesystem-safe, unique directory names: "learning_rate=0.1,weight_decay=0.0005"."""
    keys = name_keys(points)
    labels = short_labels(keys)
    names, seen = [], set()
    for point in points:
        text = ",".join(f"{labels[k]}={format_value(point[k])}" for k in keys if k in point)
        name = re.sub(r"[^A-Za-z0-9._,=+-]", "_", text) or "base"
        if len(name) > MAX_NAME:
            # sha1, not hash(): the name is stable across runs.
            name = name[:MAX_NAME - 9] + "-" + hashlib.sha1(text.encode()).hexdigest()[:8]
        unique, n = name, 1
        while unique in seen:
            n += 1
            unique = f"{name}-{n}"
        seen.add(unique)
        names.append(unique)
    return names


def base_config(config_spec: str) -> ml_collections.ConfigDict:
    """The config without overrides; SweepError when the file is missing or does not load."""
    if not os.path.isfile(config_spec.partition(":")[0]):
        raise SweepError(f"config file {config_spec.partition(':')[0]!r} not found (--config=FILE[:ARG])")
    try:
        return parse_config(config_spec)
    except Exception as e:
        raise SweepError(f"--config={config_spec}: {errors.one_line(e)}") from e


def plan(config_spec: str, points: Sequence[Overrides]) -> list[Point]:
    """Every point checked and named, before anything runs; the first bad one raises SweepError."""
    base = base_config(config_spec)
    points = [normalize(p) for p in points]
    planned = []
    for index, (name, overrides) in enumerate(zip(point_names(points), points)):
        try:
            override_flags, config = check_point(config_spec, base, overrides)
        except SweepError as e:
            raise SweepError(f"sweep point {index + 1} {overrides}: {e}") from None
        planned.append(Point(index, name, dict(overrides), override_flags, config))
    seen: dict[str, int] = {}
    for point in planned:
        key = repr(sorted(point.overrides.items()))
        if key in seen:
            raise SweepError(f"sweep points {seen[key] + 1} and {point.index + 1} are identical: {point.overrides}")
        seen[key] = point.index
    return planned


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


# What every trial runs with besides its overrides (the agent adds them to its command): what it costs,
# recorded for objectives and constraints (mwloop.run.cost).
TRIAL_SETTINGS = {"record_cost": True}


def trial_flags(config: ml_collections.ConfigDict) -> list[str]:
    """TRIAL_SETTINGS as flags, those `config` has (a config not built on base_config may lack them)."""
    return [f"--config.{key}={flag_value(value)}" for key, value in TRIAL_SETTINGS.items() if key in config]


def check_workdir(workdir: str, config: ml_collections.ConfigDict) -> None:
    """A directory that holds a run of another config would be resumed by mistake: SweepError. (`config` as
    planned; the run also has TRIAL_SETTINGS.)"""
    saved_path = os.path.join(workdir, "config.json")
    if not os.path.exists(saved_path):
        return
    try:
        saved = _flatten(jsonl.read_json(saved_path))
    except jsonl.CorruptFileError as e:
        # Only a crash while the run wrote it does this; the run rewrites it when it resumes.
        logging.warning("%s; not checking that it holds a run of this config (if it may not, delete %s)", e, workdir)
        return
    wanted = _flatten(json.loads(config.to_json_best_effort()))
    wanted.update({key: value for key, value in TRIAL_SETTINGS.items() if key in wanted})
    differ = sorted(k for k in saved.keys() & wanted.keys() if saved[k] != wanted[k])
    if differ:
        changes = ", ".join(f"{k}: {saved[k]!r} -> {wanted[k]!r}" for k in differ[:3])
        raise SweepError(f"{workdir} holds a run of another config ({changes}); "
                         f"use a new --workdir or delete that directory")


def check_workdirs(sweep_dir: str, points: Sequence[Point]) -> None:
    """`check_workdir` for every point of a grid."""
    for point in points:
        check_workdir(os.path.join(sweep_dir, point.name), point.config)


def search_name(overrides: Overrides, params: Sequence[str]) -> str:
    """A search trial's directory: its parameters, short, then a hash of every override, so the same
    values always give the same directory (a retried trial resumes there) and different ones never share it.

    "learning_rate=0.0123,weight_decay=0.00041-3f9a2c1d"
    """
    keys = [k for k in params if k in overrides]
    labels = short_labels(keys)
    text = ",".join(f"{labels[k]}={_short(overrides[k])}" for k in keys)
    digest = hashlib.sha1(json.dumps(overrides, sort_keys=True, default=repr).encode()).hexdigest()[:8]
    name = re.sub(r"[^A-Za-z0-9._,=+-]", "_", text)[:MAX_NAME - 9]
    return f"{name}-{digest}" if name else f"trial-{digest}"


def _short(value: Any) -> str:
    if isinstance(value, float) and not isinstance(value, bool):
        return f"{value:.3g}"
    return format_value(value)
