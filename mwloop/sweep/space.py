"""Sweep files: a grid (`get_sweep()`) or a search (`search_space(trial)`), their defaults, and the check
that runs before any training.

A grid file returns a list of override dicts; a search file suggests values
with Optuna's trial API, naming each parameter by its config path
(`trial.suggest_float("optimizer.learning_rate", 1e-3, 1.0, log=True)`), and
may return a dict of further overrides (constants, or values derived from
parameters). Parameters whose name starts with `_` are helpers that are not
config keys (`_width` -> `{"model.hidden": (w, w)}`); every other name must be
a config key. Both kinds may set CONFIG, METRIC, MODE (or OBJECTIVES for several,
and CONSTRAINTS: objectives.py), PRUNER (+ PRUNER_OPTIONS) and PRUNE_BY; a search
also SAMPLER (+ SAMPLER_OPTIONS) and N_TRIALS. This module imports Optuna but
never TensorFlow.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import optuna

from mwloop.sweep import objectives as objectives_lib
from mwloop.sweep import pbt, plan, runner
from mwloop.sweep.values import Overrides, SweepError

SAMPLERS = ("tpe", "random", "cmaes", "grid", "nsga2")
PRUNERS = ("median", "asha", "successive_halving", "hyperband", "none")
DEFAULT_N_TRIALS = 20
# Random samples of a search space checked before anything runs (to cover its conditional branches).
PROBE_SAMPLES = 16


@dataclasses.dataclass(frozen=True)
class Choices:
    """What a sweep file chooses and its study keeps: the config, the ranking, the budget, sampler and pruner.

    In a `SweepFile` these are the file's own (None: it leaves the choice to `create_sweep`); in a study's
    `study.Settings` they are what the study was created with, none left None.

    Attributes:
      config: CONFIG: the default --config.
      metric: METRIC: "<split>/<name>".
      mode: MODE: max | min.
      n_trials: a grid's number of points; a search's N_TRIALS (None: not set).
      prune_by: PRUNE_BY: step | examples; None: examples when the batch size is swept.
      objectives: OBJECTIVES when it names several: ((metric, mode), ...), the first being `metric` and `mode`
        (what single-objective code ranks by); () for one objective.
      constraints: CONSTRAINTS: "<split>/<metric> <= number" (or >=) each.
      pbt: ALGORITHM = "pbt"'s settings (`pbt.Spec.as_dict`); None for a grid or a search.
    """
    config: str | None
    metric: str
    mode: str
    sampler: str
    sampler_options: dict[str, Any]
    pruner: str
    pruner_options: dict[str, Any]
    n_trials: int | None
    prune_by: str | None
    # Defaults: a study stored before these existed has neither.
    objectives: tuple[objectives_lib.Objective, ...] = dataclasses.field(default=(), kw_only=True)
    constraints: tuple[str, ...] = dataclasses.field(default=(), kw_only=True)
    pbt: dict[str, Any] | None = dataclasses.field(default=None, kw_only=True)

    @property
    def all_objectives(self) -> tuple[objectives_lib.Objective, ...]:
        """Every objective, in order: ((metric, mode),) for a single one."""
        return self.objectives or ((self.metric, self.mode),)

    @property
    def multi(self) -> bool:
        return len(self.objectives) > 1


@dataclasses.dataclass(frozen=True)
class SweepFile(Choices):
    """What a sweep file defines, with its defaults filled in.

    Attributes:
      spec: FILE[:arg] as given.
      points: a grid's points; None for a search.
      space: a search's search_space; None for a grid.
    """
    spec: str
    points: list[Overrides] | None
    space: Callable[[optuna.trial.BaseTrial], Mapping[str, Any] | None] | None

    @property
    def kind(self) -> str:
        return "grid" if self.points is not None else "pbt" if self.pbt else "search"


def _exec(path: str):
    module_spec = importlib.util.spec_from_file_location(f"sweep_{os.path.basename(path)[:-3]}", path)
    module = importlib.util.module_from_spec(module_spec)
    # A sweep file may import Optuna's experimental parts.
    with warnings.catch_warnings(), runner.held_stderr():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        module_spec.loader.exec_module(module)
    return module


def _takes_arg(function: Callable, positional: int) -> bool:
    return len(inspect.signature(function).parameters) > positional


def load_sweep(spec: str) -> SweepFile:
    """experiments/<name>.py[:arg] -> its points or search space and defaults; SweepError when it is malformed."""
    path, _, arg = spec.partition(":")
    if not os.path.isfile(path):
        raise SweepError(f"sweep file {path!r} not found")
    try:
        module = _exec(path)
        has_grid, has_space = hasattr(module, "get_sweep"), hasattr(module, "search_space")
        if has_grid and has_space:
            raise SweepError("defines both get_sweep() (a grid) and search_space(trial) (a search); keep one")
        if not has_grid and not has_space:
            raise SweepError("defines neither get_sweep() (a grid) nor search_space(trial) (a search)")
        points, space = None, None
        if has_grid:
            points = module.get_sweep(arg) if arg else module.get_sweep()
            if not points or not all(isinstance(p, Mapping) for p in points):
                raise SweepError(f"get_sweep() must return a non-empty list of dicts, got {points!r}")
            points = [dict(p) for p in points]
            for name in ("SAMPLER", "N_TRIALS", "SAMPLER_OPTIONS"):
                if hasattr(module, name) and not (name == "SAMPLER" and module.SAMPLER == "grid"):
                    raise SweepError(f"{name} is for search_space(trial) files; a grid from get_sweep() runs "
                                     f"each of its {len(points)} points once")
        else:
            if arg and not _takes_arg(module.search_space, 1):
                raise SweepError(f"got :{arg} but search_space(trial) takes no argument; "
                                 f"define search_space(trial, arg=None)")
            space = (lambda trial: module.search_space(trial, arg)) if arg else module.search_space
        population = pbt.Spec.from_module(module)
        if population and points is not None:
            raise SweepError("ALGORITHM = 'pbt' draws its population from search_space(trial), not get_sweep()")
    except SweepError as e:
        raise SweepError(f"{spec}: {e}") from None
    # The sweep file's own bug or a bad :arg: one line, not a traceback.
    except Exception as e:
        raise SweepError(f"{spec}: {type(e).__name__}: {e}") from e
    metric = getattr(module, "METRIC", "eval/accuracy")
    mode = getattr(module, "MODE", "min" if "loss" in metric else "max")
    objectives, constraints = _objectives(spec, module)
    if objectives:
        metric, mode = objectives[0]
    # A grid runs every point to the end; several objectives cannot be pruned (objectives.py).
    default_pruner = "none" if points is not None or len(objectives) > 1 or population else "median"
    return SweepFile(
        spec=spec, points=points, space=space, config=getattr(module, "CONFIG", None), metric=metric, mode=mode,
        sampler=getattr(module, "SAMPLER", "grid" if points is not None else "tpe"),
        sampler_options=dict(getattr(module, "SAMPLER_OPTIONS", {})),
        pruner=getattr(module, "PRUNER", default_pruner), pruner_options=dict(getattr(module, "PRUNER_OPTIONS", {})),
        n_trials=len(points) if points is not None else getattr(module, "N_TRIALS", None),
        prune_by=getattr(module, "PRUNE_BY", None), objectives=objectives if len(objectives) > 1 else (),
        constraints=constraints, pbt=population.as_dict() if population else None)


def _objectives(spec: str, module) -> tuple[tuple[objectives_lib.Objective, ...], tuple[str, ...]]:
    """A sweep file's OBJECTIVES (none: ()) and CONSTRAINTS, checked."""
    try:
        if hasattr(module, "OBJECTIVES") and (hasattr(module, "METRIC") or hasattr(module, "MODE")):
            raise SweepError("sets both OBJECTIVES and METRIC/MODE; keep OBJECTIVES (its first metric ranks "
                             "the table)")
        objectives = objectives_lib.parse_objectives(module.OBJECTIVES) if hasattr(module, "OBJECTIVES") else ()
        return objectives, objectives_lib.check_constraints(getattr(module, "CONSTRAINTS", ()))
    except SweepError as e:
        raise SweepError(f"{spec}: {e}") from None


def check_settings(*, metric: str, mode: str, sampler: str, pruner: str, n_trials: int, prune_by: str | None,
                   objectives: tuple = ()) -> None:
    """One line for each setting that cannot work, before anything runs (`objectives`: several, or ())."""
    if mode not in ("max", "min") or "/" not in metric:
        raise SweepError(f"rank by <split>/<metric> (e.g. eval/accuracy) with mode max or min, got {metric} {mode}")
    if sampler not in SAMPLERS:
        raise SweepError(f"unknown sampler {sampler!r}; use one of {', '.join(SAMPLERS)}")
    if pruner not in PRUNERS:
        raise SweepError(f"unknown pruner {pruner!r}; use one of {', '.join(PRUNERS)}")
    if not isinstance(n_trials, int) or n_trials < 1:
        raise SweepError(f"n_trials must be an integer >= 1, got {n_trials!r} (N_TRIALS or --n_trials)")
    if prune_by not in (None, "step", "examples"):
        raise SweepError(f"PRUNE_BY must be step or examples, got {prune_by!r}")
    if len(objectives) > 1 and pruner != "none":
        raise SweepError(f"PRUNER {pruner!r} with {len(objectives)} OBJECTIVES: Optuna's pruners judge one "
                         f"objective (Trial.report refuses a multi-objective study); use PRUNER = 'none'")
    if len(objectives) > 1 and sampler == "cmaes":
        raise SweepError(f"SAMPLER 'cmaes' optimises one objective, not {len(objectives)}; use tpe, nsga2 or random")


# ---------------------------------------------------------------------------- a trial's overrides

def to_json(overrides: Mapping[str, Any]) -> str:
    """Overrides as canonical JSON (sorted keys; tuples as lists): a user attr, and the identity of a point."""
    return json.dumps(overrides, sort_keys=True, default=repr)


def from_json(text: str) -> Overrides:
    return plan.normalize(json.loads(text))


def search_overrides(sweep: SweepFile, trial: optuna.trial.BaseTrial) -> Overrides:
    """The overrides `search_space(trial)` gives: its config-key parameters, then the dict it returns."""
    try:
        returned = sweep.space(trial)
    except (optuna.TrialPruned, SweepError):
        raise
    # The sweep file's own bug: one line naming the file.
    except Exception as e:
        raise SweepError(f"{sweep.spec}: search_space raised {type(e).__name__}: {e}") from e
    if returned is not None and not isinstance(returned, Mapping):
        raise SweepError(f"{sweep.spec}: search_space must return None or a dict of overrides, got {returned!r}")
    overrides = {key: value for key, value in trial.params.items() if not key.startswith("_")}
    for key, value in (returned or {}).items():
        if key in overrides and overrides[key] != value:
            raise SweepError(f"{sweep.spec}: search_space returns {key}={value!r} but suggested {overrides[key]!r}")
        overrides[key] = value
    return plan.normalize(overrides)


def probe(sweep: SweepFile, samples: int = PROBE_SAMPLES) -> tuple[list[Overrides], dict[str, Any]]:
    """Samples a search space with a seeded random sampler, in memory; returns (distinct overrides,
    every parameter's distribution). Nothing is stored."""
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen: dict[str, Overrides] = {}
    distributions: dict[str, Any] = {}
    for _ in range(samples):
        trial = study.ask()
        overrides = search_overrides(sweep, trial)
        seen.setdefault(to_json(overrides), overrides)
        distributions.update(trial.distributions)
        study.tell(trial, 0.0)
    return list(seen.values()), distributions


def check(sweep: SweepFile, config_spec: str) -> list[Overrides]:
    """Checks a sweep against its config before anything runs; returns the overrides checked.

    A grid: every point through `plan.plan` (the check mwloop always did). A search: PROBE_SAMPLES random
    samples of the space, each through the same check, so an unknown key or a wrong type fails here.
    """
    if sweep.points is not None:
        plan.plan(config_spec, sweep.points)
        return sweep.points
    samples, _ = probe(sweep)
    base = plan.base_config(config_spec)
    for overrides in samples:
        try:
            plan.check_point(config_spec, base, overrides)
        except SweepError as e:
            raise SweepError(f"search_space sample {overrides}: {e}") from None
    return samples


def grid_space(sweep: SweepFile) -> dict[str, list]:
    """SAMPLER = "grid" on a search space: every parameter must be categorical and unconditional."""
    samples, distributions = probe(sweep)
    not_categorical = [name for name, d in distributions.items()
                       if not isinstance(d, optuna.distributions.CategoricalDistribution)]
    if not_categorical:
        raise SweepError(f"{sweep.spec}: SAMPLER 'grid' needs suggest_categorical parameters only; "
                         f"{not_categorical[0]!r} is not (or write the grid with get_sweep())")
    params = [set(s) for s in samples]
    if any(p != params[0] for p in params):
        raise SweepError(f"{sweep.spec}: SAMPLER 'grid' cannot run conditional parameters; write the grid with "
                         f"get_sweep()")
    return {name: list(d.choices) for name, d in distributions.items()}
