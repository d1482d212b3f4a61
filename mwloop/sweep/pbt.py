"""Population-based training's decisions (docs/pbt.md): which members exploit whom at an interval, how their
values are perturbed, and which config keys may be. Pure functions of what the study stores and a seed, so that
two runners that decide one interval decide it the same way; no storage, processes or TensorFlow here.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Mapping
from typing import Any

from mwloop.config import schema
from mwloop.config.knobs import Table
from mwloop.sweep.values import Overrides, SweepError

# Keys that shape a checkpoint's state or the data order: a member that copies another's checkpoint could not
# restore it, or would read other examples at the same step, if they differed.
STATE_SHAPING = ("model", "optimizer.name", "optimizer.kwargs", "optimizer.ema", "dataset", "train.global_batch_size",
                 "seed", "task", "deterministic", "distribution")
# A perturbation: factors drawn uniformly (e.g. (0.8, 1.25)), or "resample" (a fresh draw from the space).
Rule = tuple[float, ...] | str
# Keys every segment sets itself (its end, its parent's checkpoint): a member cannot perturb them.
SEGMENT_KEYS = ("train.steps", "train.stop_at_step", "init_checkpoint", "init_checkpoint_state",
                "init_checkpoint_include", "export")
# The sweep file's names of a PBT study, besides METRIC, MODE and search_space.
KEYS = ("ALGORITHM", "POPULATION", "INTERVAL_STEPS", "QUANTILE", "PERTURB")


@dataclasses.dataclass(frozen=True)
class Spec:
    """What a PBT sweep file sets (docs/pbt.md), stored in the study as a dict (`as_dict`).

    Attributes:
      population: members trained side by side.
      interval_steps: the steps of one segment; train.steps is a multiple of it.
      quantile: the fraction of members that copy (and that is copied) at each interval.
      perturb: config key -> its Rule.
    """
    population: int
    interval_steps: int
    quantile: float
    perturb: dict[str, Rule]

    @classmethod
    def from_module(cls, module) -> Spec | None:
        """The PBT settings of a sweep file's module; None when it sets no ALGORITHM."""
        algorithm = getattr(module, "ALGORITHM", None)
        if algorithm is None:
            extra = [name for name in KEYS if hasattr(module, name)]
            if extra:
                raise SweepError(f"{extra[0]} is a setting of population-based training; add ALGORITHM = 'pbt'")
            return None
        if algorithm != "pbt":
            raise SweepError(f"ALGORITHM {algorithm!r} is unknown; use 'pbt' (or leave it out for SAMPLER's search)")
        missing = [name for name in ("POPULATION", "INTERVAL_STEPS", "PERTURB") if not hasattr(module, name)]
        if missing:
            raise SweepError(f"ALGORITHM = 'pbt' needs {', '.join(missing)} (docs/pbt.md)")
        return cls.from_dict({"population": module.POPULATION, "interval_steps": module.INTERVAL_STEPS,
                              "quantile": getattr(module, "QUANTILE", 0.25), "perturb": module.PERTURB})

    @classmethod
    def from_dict(cls, stored: Mapping[str, Any]) -> Spec:
        """A Spec from `as_dict` (JSON keeps factor tuples as lists), checked."""
        perturb = stored["perturb"]
        if not isinstance(perturb, Mapping) or not perturb:
            raise SweepError(f"PERTURB must be a dict of config key -> factors or 'resample', got {perturb!r}")
        spec = cls(stored["population"], stored["interval_steps"], stored["quantile"],
                   {key: tuple(rule) if isinstance(rule, list) else rule for key, rule in perturb.items()})
        spec.check()
        return spec

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def check(self) -> None:
        """One line for the first setting that cannot work."""
        for name, value in (("POPULATION", self.population), ("INTERVAL_STEPS", self.interval_steps)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1 + (name == "POPULATION"):
                raise SweepError(f"{name} must be an integer >= {1 + (name == 'POPULATION')}, got {value!r}")
        if not isinstance(self.quantile, (int, float)) or not 0 <= self.quantile <= 0.5:
            raise SweepError(f"QUANTILE must be in [0, 0.5], got {self.quantile!r}")
        for key, rule in self.perturb.items():
            perturbable(key)
            if rule != "resample" and not (isinstance(rule, tuple) and rule and all(
                    isinstance(f, (int, float)) and not isinstance(f, bool) and f > 0 for f in rule)):
                raise SweepError(f"PERTURB {key!r}: {rule!r} is neither a tuple of positive factors nor 'resample'")

    def intervals(self, steps: int) -> int:
        """Segments per member in a run of `steps`."""
        if steps % self.interval_steps:
            raise SweepError(f"INTERVAL_STEPS {self.interval_steps} does not divide train.steps {steps}; use a "
                             f"divisor of it")
        return steps // self.interval_steps


def perturbable(key: str, table: Table = schema.TABLE) -> None:
    """Refuses, in one line, a key PBT may not perturb: one mwloop does not declare (a task's own key may shape
    the model), or one that shapes the checkpoint or the data order (STATE_SHAPING). Every other declared key
    is one a resume may change (its policy, or train.allow_changed naming it, which a segment passes)."""
    if key in SEGMENT_KEYS:
        raise SweepError(f"PERTURB {key!r}: every segment sets it itself (its end or its parent's checkpoint); "
                         f"perturb a hyperparameter such as optimizer.learning_rate")
    if not table.declares(key):
        raise SweepError(f"PERTURB {key!r}: mwloop cannot tell whether this key shapes the checkpoint (it is not a "
                         f"declared knob); perturb declared knobs such as optimizer.learning_rate")
    shaping = next((p for p in STATE_SHAPING if key == p or key.startswith(p + ".")), None)
    if shaping:
        raise SweepError(f"PERTURB {key!r}: {shaping} shapes the checkpoint or the data order, so a member could not "
                         f"continue from another's checkpoint with another value; search it with a grid instead")


def seed_for(study_seed: int | None, interval: int) -> int:
    """The seed of one interval's decision: the same for every runner that makes it."""
    return (study_seed or 0) * 1_000_003 + interval


def decide(scores: Mapping[int, float], *, mode: str, quantile: float, seed: int) -> dict[int, int]:
    """Each member's parent for the next interval: itself (continue), or, for the bottom `quantile` of members by
    score, a member of the top `quantile` drawn with `seed` (exploit). Ties go by member number.

    Args:
      scores: member -> its metric at the end of the interval (every member of the population).
      mode: max | min.
      quantile: the fraction that exploits (and that is copied), in [0, 0.5].
      seed: `seed_for(...)`.
    Returns:
      member -> parent member.
    """
    if not 0 <= quantile <= 0.5:
        raise SweepError(f"QUANTILE must be in [0, 0.5], got {quantile!r}")
    order = sorted(scores, key=lambda m: (-scores[m] if mode == "max" else scores[m], m))
    count = math.floor(quantile * len(order)) if len(order) > 1 else 0
    top, bottom = order[:count], order[len(order) - count:] if count else []
    rng = random.Random(seed)
    parents = {member: member for member in order}
    for member in sorted(bottom):
        parents[member] = rng.choice(top)
    return parents


def perturb(values: Overrides, rules: Mapping[str, Rule], seed: int,
            resample: Callable[[], Mapping[str, Any]]) -> Overrides:
    """An exploiting member's values: its parent's `values` with each key of `rules` perturbed (a factor drawn
    from the rule's, or a fresh draw from `resample()`, the search space)."""
    rng = random.Random(seed)
    drawn: Mapping[str, Any] | None = None
    perturbed = dict(values)
    for key, rule in sorted(rules.items()):
        if rule == "resample":
            drawn = drawn if drawn is not None else resample()
            perturbed[key] = drawn[key]
        elif isinstance(rule, tuple) and rule and all(isinstance(f, (int, float)) for f in rule):
            perturbed[key] = values[key] * rng.choice(rule)
        else:
            raise SweepError(f"PERTURB {key!r}: {rule!r} is neither a tuple of factors nor 'resample'")
    return perturbed
