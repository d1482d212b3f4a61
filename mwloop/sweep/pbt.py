"""Population-based training's decisions (docs/pbt.md): which members exploit whom at an interval, how their
values are perturbed, and which config keys may be. Pure functions of what the study stores and a seed, so that
two runners that decide one interval decide it the same way; no storage, processes or TensorFlow here.
"""

from __future__ import annotations

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


def perturbable(key: str, table: Table = schema.TABLE) -> None:
    """Refuses, in one line, a key PBT may not perturb: one mwloop does not declare (a task's own key may shape
    the model), or one that shapes the checkpoint or the data order (STATE_SHAPING). Every other declared key
    is one a resume may change (its policy, or train.allow_changed naming it, which a segment passes)."""
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
