"""Hyperparameter sweeps on Optuna: grids and searches, each trial its own training process.

A sweep file defines a grid, `get_sweep(arg=None)` (a list of override dicts
keyed by config path, built with `product` and `zip_` from here), or a search,
`search_space(trial)` (Optuna's suggest API, parameters named by config path),
and may set CONFIG, METRIC, MODE, SAMPLER, PRUNER, N_TRIALS (`space`). Both
run through one engine: an Optuna study (`study`: a grid's points are enqueued
trials) and agents (`agent`) that turn trials into `mwloop.main` processes,
prune them through their metrics.jsonl and report back; results.* are written
from the study (`results`: tables in `report`, results.png in `plots`, TensorBoard
HParams in `hparams`). `run_sweep` is the local backend:
create the study, then `parallel` agents in this process. The command line is
`python -m mwloop.sweep` (`__main__`). Nothing here imports TensorFlow, and
training processes never import Optuna. See docs/sweeps.md.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from mwloop.sweep.values import Overrides, SweepError

__all__ = ["Overrides", "SweepError", "SweepFile", "create_sweep", "load_sweep", "product", "run_agent", "run_sweep",
           "zip_"]

# A dict of axes, or a list of points.
Part = Mapping[str, Sequence] | Sequence[Mapping[str, Any]]


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

# ---------------------------------------------------------------------------- running (imported late: sweep files
# import this package for product/zip_, and must not wait for Optuna to load)

def __getattr__(name: str):
    if name in ("SweepFile", "load_sweep"):
        from mwloop.sweep import space
        return getattr(space, name)
    if name in ("create_sweep", "run_agent", "run_sweep", "write_results", "launch_agents"):
        from mwloop.sweep import local
        return getattr(local, name)
    raise AttributeError(f"module 'mwloop.sweep' has no attribute {name!r}")
