"""Hyperparameter sweeps: each point of `experiments/<name>.py` as its own training process.

  python -m mwloop.sweep --sweep=experiments/resnet_lr.py [--config=configs/resnet.py:digits] \
      --workdir=DIR [--parallel=P] [--num_workers=W]

A sweep file defines `get_sweep(arg=None)`, a list of override dicts keyed by
config path, and may set `CONFIG`, `METRIC` and `MODE` as defaults. Every
point is checked against the config before anything runs; each runs in
`DIR/<name from its overrides>/`, a finished point is skipped on rerun, a
failed one is recorded and retried on rerun. See docs/sweeps.md.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import importlib.util
import itertools
import json
import os
import re
import signal
import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections
from absl import app, flags, logging
from ml_collections import config_flags

from mwloop import results as results_lib
from mwloop import sweep_runner
from mwloop.sweep_runner import Point

Overrides = dict[str, Any]
Part = Mapping[str, Sequence] | Sequence[Mapping[str, Any]]
MAX_NAME = 120


class SweepError(ValueError):
    """A sweep that cannot run as written; the message is one actionable line."""


# ---------------------------------------------------------------------------- defining sweeps

def _points(part: Part, combine) -> list[Overrides]:
    """A part as a list of points: a dict of axes is combined by `combine`, a list of dicts is taken as is."""
    if isinstance(part, Mapping):
        for key, values in part.items():
            if isinstance(values, (str, bytes, tuple)) or not isinstance(values, Sequence):
                # a tuple is one value (config tuples like model.widths), never an axis
                raise SweepError(f"axis {key!r} needs a list of values, got {values!r}; "
                                 f"a constant is a list of one: [{values!r}]")
        axes = [[(key, value) for value in values] for key, values in part.items()]
        return [dict(pairs) for pairs in combine(*axes)]
    return [dict(point) for point in part]


def _merge(points: Sequence[Overrides]) -> Overrides:
    merged: Overrides = {}
    for point in points:
        clash = merged.keys() & point.keys()
        if clash:
            raise SweepError(f"key {sorted(clash)[0]!r} is set by two parts of one sweep point")
        merged.update(point)
    return merged


def _strict_zip(*lists: Sequence) -> list[tuple]:
    if len({len(x) for x in lists}) > 1:
        raise SweepError(f"zip_ needs lists of one length, got lengths {[len(x) for x in lists]}")
    return list(zip(*lists))


def product(*parts: Part) -> list[Overrides]:
    """Every combination: product({"a": [1, 2], "b": [3, 4]}) has 4 points, the last key varying fastest.

    A part is a dict of axes (its own product) or a list of points (e.g. from zip_).
    """
    return [_merge(combo) for combo in itertools.product(*(_points(p, itertools.product) for p in parts))]


def zip_(*parts: Part) -> list[Overrides]:
    """Values side by side: zip_({"a": [1, 2], "b": [3, 4]}) is [{a: 1, b: 3}, {a: 2, b: 4}].

    A part is a dict of axes (zipped) or a list of points; all parts have one length.
    """
    return [_merge(combo) for combo in _strict_zip(*(_points(p, _strict_zip) for p in parts))]


# ---------------------------------------------------------------------------- loading

@dataclasses.dataclass(frozen=True)
class SweepFile:
    points: list[Overrides]
    config: str | None  # CONFIG: the default --config
    metric: str  # METRIC: what results are ranked by, "<split>/<name>"
    mode: str  # MODE: max | min


def load_sweep(spec: str) -> SweepFile:
    """experiments/<name>.py[:arg] -> its points and defaults."""
    path, _, arg = spec.partition(":")
    if not os.path.isfile(path):
        raise SweepError(f"sweep file {path!r} not found")
    module_spec = importlib.util.spec_from_file_location(f"sweep_{os.path.basename(path)[:-3]}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not hasattr(module, "get_sweep"):
        raise SweepError(f"{path} defines no get_sweep(arg=None)")
    points = module.get_sweep(arg) if arg else module.get_sweep()
    if not points or not all(isinstance(p, Mapping) for p in points):
        raise SweepError(f"{spec}: get_sweep() must return a non-empty list of dicts, got {points!r}")
    metric = getattr(module, "METRIC", "eval/accuracy")
    mode = getattr(module, "MODE", "min" if "loss" in metric else "max")
    return SweepFile([dict(p) for p in points], getattr(module, "CONFIG", None), metric, mode)


def _normalize(point: Mapping[str, Any]) -> Overrides:
    # ml_collections 1.1.0 can't override lists from the command line; config fields are tuples.
    return {key: tuple(value) if isinstance(value, list) else value for key, value in point.items()}


def parse_config(config_spec: str, override_flags: Sequence[str] = ()) -> ml_collections.ConfigDict:
    """The config exactly as `mwloop.main` will see it: the same config_flags parsing of the same argv."""
    argv = ["mwloop.main", f"--config={config_spec}", *override_flags]
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", flag_values=flag_values, lock_config=True, sys_argv=argv)
    with warnings.catch_warnings():  # config_flags loads files with the deprecated load_module(): not ours to fix
        warnings.simplefilter("ignore", DeprecationWarning)
        flag_values(argv)
    return flag_values.config


# ---------------------------------------------------------------------------- checking and naming

def flag_value(value: Any) -> str:
    """`value` as the text after `--config.key=` that config_flags parses back to `value`."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, dict, float)):
        return repr(value)  # floats: repr is the shortest exact text; tuples/dicts: literal_eval
    return str(value)  # ints; strings go through unparsed


def _flat_keys(config: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in config.items():
        keys.append(prefix + key)
        if isinstance(value, ml_collections.ConfigDict):
            keys += _flat_keys(value, f"{prefix}{key}.")
    return keys


def _get(config: ml_collections.ConfigDict, key: str) -> Any:
    for part in key.split("."):
        config = config[part]
    return config


def _type_check(base: ml_collections.ConfigDict, point: Overrides) -> None:
    """update_from_flattened_dict on a copy, one key at a time, so the error names the key."""
    known = _flat_keys(base)
    config = copy.deepcopy(base)
    for key, value in point.items():
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            raise SweepError(f"unknown config key {key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        current = _get(config, key)
        try:
            config.update_from_flattened_dict({key: value})
        except (TypeError, ValueError) as e:
            expected = type(current).__name__ if current is not None else "a typed placeholder"
            raise SweepError(f"{key}={value!r} is a {type(value).__name__} but the config field is "
                             f"{expected} ({current!r})") from e

def check_point(config_spec: str, base: ml_collections.ConfigDict, overrides: Overrides) -> tuple[list[str], Any]:
    """Type-checks `overrides` and proves they survive the command line; returns (flags, resolved config)."""
    _type_check(base, overrides)
    override_flags = [f"--config.{key}={flag_value(value)}" for key, value in overrides.items()]
    try:
        config = parse_config(config_spec, override_flags)
    except Exception as e:  # config_flags raises KeyError, TypeError, flags.Error...
        raise SweepError(f"the overrides do not parse as flags {override_flags}: {e}") from e
    expected = copy.deepcopy(base)
    expected.update_from_flattened_dict(overrides)
    for key in overrides:
        if _get(config, key) != _get(expected, key):
            raise SweepError(f"{key}={overrides[key]!r} reaches mwloop.main as {_get(config, key)!r} "
                             f"(flag {flag_value(overrides[key])!r})")
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
        if not any(_determines(points, kept, key) for kept in named):
            named.append(key)  # dropping only keys fixed by a named key keeps names unique
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
        text = ",".join(f"{labels[k]}={results_lib.format_value(point[k])}" for k in keys if k in point)
        name = re.sub(r"[^A-Za-z0-9._,=+-]", "_", text) or "base"
        if len(name) > MAX_NAME:
            name = name[:MAX_NAME - 9] + "-" + hashlib.sha1(text.encode()).hexdigest()[:8]  # stable across runs
        unique, n = name, 1
        while unique in seen:
            n += 1
            unique = f"{name}-{n}"
        seen.add(unique)
        names.append(unique)
    return names


def plan(config_spec: str, points: Sequence[Overrides]) -> list[Point]:
    """Every point checked and named, before anything runs; the first bad one raises SweepError."""
    try:
        base = parse_config(config_spec)
    except Exception as e:
        raise SweepError(f"--config={config_spec}: {e}") from e
    points = [_normalize(p) for p in points]
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


def check_workdirs(sweep_dir: str, points: Sequence[Point]) -> None:
    """A point's directory that holds a run of another config would be resumed by mistake: refuse it."""
    for point in points:
        saved_path = os.path.join(sweep_dir, point.name, "config.json")
        if not os.path.exists(saved_path):
            continue
        with open(saved_path) as f:
            saved = _flatten(json.load(f))
        wanted = _flatten(json.loads(point.config.to_json_best_effort()))
        differ = sorted(k for k in saved.keys() & wanted.keys() if saved[k] != wanted[k])
        if differ:
            changes = ", ".join(f"{k}: {saved[k]!r} -> {wanted[k]!r}" for k in differ[:3])
            raise SweepError(f"{os.path.dirname(saved_path)} holds a run of another config ({changes}); "
                             f"use a new --workdir or delete that directory")


# ---------------------------------------------------------------------------- running

def run_sweep(*, sweep_spec: str, sweep_dir: str, config_spec: str | None = None, parallel: int = 1,
              num_workers: int = 1, metric: str | None = None, mode: str | None = None) -> int:
    """Checks, runs and reports a sweep; returns the number of failed points."""
    sweep = load_sweep(sweep_spec)
    config_spec = config_spec or sweep.config
    if not config_spec:
        raise SweepError(f"no --config given and {sweep_spec} sets no CONFIG")
    metric, mode = metric or sweep.metric, mode or sweep.mode
    if mode not in ("max", "min") or "/" not in metric:
        raise SweepError(f"rank by <split>/<metric> (e.g. eval/accuracy) with mode max or min, got {metric} {mode}")
    points = plan(config_spec, sweep.points)
    check_workdirs(sweep_dir, points)
    os.makedirs(sweep_dir, exist_ok=True)

    overrides = [p.overrides for p in points]
    all_keys, keys = swept_keys(overrides), name_keys(overrides)  # csv and HParams; table and plot
    labels = short_labels(keys)
    results = {}
    for p in points:
        workdir = os.path.join(sweep_dir, p.name)
        results[p.name] = results_lib.PointResult(p.name, workdir, {k: _get(p.config, k) for k in all_keys})
        _update(results[p.name], sweep_runner.read_marker(workdir))
    todo = [p for p in points if results[p.name].status != "done"]
    if len(todo) < len(points):
        logging.info("skipping %d points done before: %s", len(points) - len(todo),
                     ", ".join(p.name for p in points if results[p.name].status == "done"))
    logging.info("sweep %s on %s: %d points, %d already done, %d to run, %d at a time, in %s", sweep_spec,
                 config_spec, len(points), len(points) - len(todo), len(todo), parallel, sweep_dir)

    def write(final: bool) -> None:
        results_lib.write_all(sweep_dir, list(results.values()), keys=keys, all_keys=all_keys, labels=labels,
                              metric=metric, mode=mode, title=f"Sweep {sweep_spec} on {config_spec}", final=final)

    def on_finish(point: Point, marker: dict) -> None:
        _update(results[point.name], marker)
        write(final=False)

    progress = sweep_runner.Progress(total=len(points), already_done=len(points) - len(todo), parallel=parallel)
    try:
        sweep_runner.run_points(todo, sweep_dir=sweep_dir, config_spec=config_spec, parallel=parallel,
                                num_workers=num_workers, progress=progress, on_finish=on_finish)
    finally:
        write(final=True)
    failed = [r for r in results.values() if r.status == "failed"]
    logging.info("sweep done: %d/%d points done, %d failed; results in %s", len(points) - len(failed),
                 len(points), len(failed), os.path.join(sweep_dir, "results.md"))
    return len(failed)


def _update(result: results_lib.PointResult, marker: dict) -> None:
    result.status = marker.get("status", "pending")
    result.wall_s = marker.get("wall_s")
    result.error = marker.get("error", "")
    result.events = results_lib.read_events(result.workdir)


# ---------------------------------------------------------------------------- command line

def _define_flags() -> None:
    # Only when run as a program: sweep files import this module, and a library must not own global flags.
    flags.DEFINE_string("sweep", None, "Sweep file experiments/<name>.py[:arg] defining get_sweep().")
    flags.DEFINE_string("config", None, "Base config FILE[:ARG] (default: the sweep file's CONFIG).")
    flags.DEFINE_string("workdir", None, "Sweep directory: one subdirectory per point, results.* at the top.")
    flags.DEFINE_integer("parallel", 1, "Points run at the same time.", lower_bound=1)
    flags.DEFINE_integer("num_workers", 1, "Worker processes per point (> 1: through mwloop.launch).", lower_bound=1)
    flags.DEFINE_string("metric", None, "Rank by <split>/<metric> (default: the sweep's METRIC or eval/accuracy).")
    flags.DEFINE_enum("mode", None, ["max", "min"], "Whether a higher or lower metric is better.")
    flags.mark_flags_as_required(["sweep", "workdir"])


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM as Ctrl-C: stop the children rather than orphan them


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    signal.signal(signal.SIGTERM, _interrupt)
    FLAGS = flags.FLAGS
    try:
        failed = run_sweep(sweep_spec=FLAGS.sweep, sweep_dir=FLAGS.workdir, config_spec=FLAGS.config,
                           parallel=FLAGS.parallel, num_workers=FLAGS.num_workers, metric=FLAGS.metric,
                           mode=FLAGS.mode)
    except SweepError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit("interrupted: run the same command again to resume the sweep")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    _define_flags()
    app.run(main)
