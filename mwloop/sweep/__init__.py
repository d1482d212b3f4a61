"""Hyperparameter sweeps: each point of `experiments/<name>.py` as its own training process.

A sweep file defines `get_sweep(arg=None)`, a list of override dicts keyed by
config path (built with `product` and `zip_` from here), and may set `CONFIG`,
`METRIC` and `MODE` as defaults. `run_sweep` checks every point against the
config before anything runs (`plan`), runs each as `python -m mwloop.main` in
`DIR/<name from its overrides>/` (`runner`), and writes results.* (`report`).
The command line is `python -m mwloop.sweep` (`__main__`). Nothing here imports
TensorFlow: training is reached only through the command line and workdir
files. See docs/sweeps.md.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import os
from collections.abc import Mapping, Sequence
from typing import Any

from absl import logging

from mwloop.sweep import plan, report, runner
from mwloop.sweep.plan import Overrides, SweepError

__all__ = ["Overrides", "SweepError", "SweepFile", "load_sweep", "product", "run_sweep", "zip_"]

Part = Mapping[str, Sequence] | Sequence[Mapping[str, Any]]  # a dict of axes, or a list of points


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
    try:
        module_spec = importlib.util.spec_from_file_location(f"sweep_{os.path.basename(path)[:-3]}", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        if not hasattr(module, "get_sweep"):
            raise SweepError(f"{path} defines no get_sweep(arg=None)")
        points = module.get_sweep(arg) if arg else module.get_sweep()
    except SweepError as e:
        raise SweepError(f"{spec}: {e}") from None
    except Exception as e:  # the sweep file's own bug or a bad :arg: one line, not a traceback
        raise SweepError(f"{spec}: {type(e).__name__}: {e}") from e
    if not points or not all(isinstance(p, Mapping) for p in points):
        raise SweepError(f"{spec}: get_sweep() must return a non-empty list of dicts, got {points!r}")
    metric = getattr(module, "METRIC", "eval/accuracy")
    mode = getattr(module, "MODE", "min" if "loss" in metric else "max")
    return SweepFile([dict(p) for p in points], getattr(module, "CONFIG", None), metric, mode)


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
    points = plan.plan(config_spec, sweep.points)
    plan.check_workdirs(sweep_dir, points)
    os.makedirs(sweep_dir, exist_ok=True)

    overrides = [p.overrides for p in points]
    all_keys, keys = plan.swept_keys(overrides), plan.name_keys(overrides)  # csv and HParams; table and plot
    labels = plan.short_labels(keys)
    results = _collect(points, sweep_dir, all_keys)
    done = [p.name for p in points if results[p.name].status == "done"]
    if done:
        logging.info("skipping %d points done before: %s", len(done), ", ".join(done))
    todo = [p for p in points if p.name not in done]
    logging.info("sweep %s on %s: %d points, %d already done, %d to run, %d at a time, in %s", sweep_spec,
                 config_spec, len(points), len(done), len(todo), parallel, sweep_dir)

    def write(final: bool) -> None:
        report.write_all(sweep_dir, list(results.values()), keys=keys, all_keys=all_keys, labels=labels,
                         metric=metric, mode=mode, title=f"Sweep {sweep_spec} on {config_spec}", final=final)

    def on_finish(point: runner.Point, marker: dict) -> None:
        _update(results[point.name], marker)
        write(final=False)

    progress = runner.Progress(total=len(points), already_done=len(done), parallel=parallel)
    try:
        runner.run_points(todo, sweep_dir=sweep_dir, config_spec=config_spec, parallel=parallel,
                          num_workers=num_workers, progress=progress, on_finish=on_finish)
    finally:
        write(final=True)
    return _report(list(results.values()), metric, sweep_dir)


def _collect(points: Sequence[runner.Point], sweep_dir: str, keys: Sequence[str]) -> dict[str, report.PointResult]:
    """Each point's result so far, from its marker and metrics.jsonl."""
    results = {}
    for p in points:
        workdir = os.path.join(sweep_dir, p.name)
        results[p.name] = report.PointResult(p.name, workdir, {k: plan.config_value(p.config, k) for k in keys})
        _update(results[p.name], runner.read_marker(workdir))
    return results


def _report(results: Sequence[report.PointResult], metric: str, sweep_dir: str) -> int:
    """Logs the outcome; returns the number of failed points."""
    reported = {m for r in results for m in r.final}
    if reported and metric not in reported:
        logging.warning("no point reports %s, so nothing is ranked; metrics are: %s", metric,
                        ", ".join(sorted(reported)))
    failed = sum(r.status == "failed" for r in results)
    logging.info("sweep done: %d/%d points done, %d failed; results in %s", len(results) - failed, len(results),
                 failed, os.path.join(sweep_dir, "results.md"))
    return failed


def _update(result: report.PointResult, marker: dict) -> None:
    result.status = marker.get("status", "pending")
    result.wall_s = marker.get("wall_s")
    result.error = marker.get("error", "")
    result.events = report.read_events(result.workdir)
