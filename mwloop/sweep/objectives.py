"""Several objectives and constraints: what a sweep file's OBJECTIVES and CONSTRAINTS mean, and what a finished
trial tells the study.

    OBJECTIVES = {"eval/accuracy": "max", "cost/params": "min"}   # an Optuna multi-objective study
    CONSTRAINTS = ["cost/params <= 2e6"]                          # Optuna's trial.set_constraint

Every objective and constraint is a "<split>/<name>" metric of the trial's metrics.jsonl, its last value (a run
records its cost without being asked: cost/params, cost/examples_per_sec, cost/peak_rss_mb, export/latency_ms;
mwloop.run.cost). A constraint's value is how far the metric is past its bound (<= 0: feasible), set on the trial
before it is told, so the sampler (TPE, NSGA-II) steers away from infeasible values and `study.best_trials`, the
Pareto front, holds feasible trials only. (Optuna 5 deprecated the samplers' `constraints_func` for
`Trial.set_constraint`: the same values, recorded on the trial, for every sampler.)

Pruning judges one curve: Optuna's pruners are single-objective and `Trial.report` refuses a multi-objective
study, so a sweep with several objectives runs every trial to its end (PRUNER "none"; another is refused).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from mwloop.artifacts import files
from mwloop.sweep.values import SweepError

# An objective: (metric, mode).
Objective = tuple[str, str]
_CONSTRAINT = re.compile(r"^\s*(?P<metric>[^\s<>=]+/[^\s<>=]+)\s*(?P<op><=|>=)\s*(?P<bound>\S+)\s*$")


def final_metrics(events: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The last value of every metric of metrics.jsonl's events, keyed "<split>/<name>" (e.g. "eval/accuracy")."""
    final: dict[str, float] = {}
    for event in events:
        for key, value in event.items():
            # Numbers only: not a stop's reason.
            if key not in files.ENVELOPE and isinstance(value, (int, float)):
                final[f"{event['split']}/{key}"] = value
    return final


def parse_objectives(value: Any) -> tuple[Objective, ...]:
    """OBJECTIVES (a dict metric -> mode, or (metric, mode) pairs) as a tuple of pairs; SweepError if malformed."""
    pairs = list(value.items()) if isinstance(value, Mapping) else value
    try:
        objectives = tuple((str(metric), str(mode)) for metric, mode in pairs)
    except (TypeError, ValueError):
        raise SweepError(f"OBJECTIVES must map each metric to max or min, e.g. {{'eval/accuracy': 'max', "
                         f"'cost/params': 'min'}}; got {value!r}") from None
    if not objectives:
        raise SweepError("OBJECTIVES is empty; name at least one metric, e.g. {'eval/accuracy': 'max'}")
    for metric, mode in objectives:
        if mode not in ("max", "min") or "/" not in metric:
            raise SweepError(f"OBJECTIVES: {metric!r}: {mode!r}: each is a <split>/<metric> with max or min")
    if len({m for m, _ in objectives}) != len(objectives):
        raise SweepError(f"OBJECTIVES names a metric twice: {[m for m, _ in objectives]}")
    return objectives


def parse_constraint(text: str) -> tuple[str, str, float]:
    """"cost/params <= 2e6" -> ("cost/params", "<=", 2000000.0); SweepError if malformed."""
    match = _CONSTRAINT.match(text) if isinstance(text, str) else None
    bound = _number(match["bound"]) if match else None
    if bound is None:
        raise SweepError(f"CONSTRAINTS: {text!r} is not '<split>/<metric> <= number' or '>= number' "
                         f"(e.g. 'cost/params <= 2e6')")
    return match["metric"], match["op"], bound


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def check_constraints(constraints: Sequence[str]) -> tuple[str, ...]:
    """CONSTRAINTS, each checked, as a tuple."""
    if isinstance(constraints, str) or not isinstance(constraints, Sequence):
        raise SweepError(f"CONSTRAINTS must be a list of strings like 'cost/params <= 2e6', got {constraints!r}")
    for text in constraints:
        parse_constraint(text)
    return tuple(constraints)


def violation(text: str, value: float) -> float:
    """How far `value` is past the constraint's bound: <= 0 feasible (Optuna's convention)."""
    _, op, bound = parse_constraint(text)
    return value - bound if op == "<=" else bound - value


def feasible(constraints: Sequence[str], final: Mapping[str, float]) -> bool | None:
    """Whether every constraint holds on a trial's final metrics; None when one of their metrics is missing."""
    holds = []
    for text in constraints:
        metric = parse_constraint(text)[0]
        if not isinstance(final.get(metric), (int, float)) or not math.isfinite(final[metric]):
            return None
        holds.append(violation(text, final[metric]) <= 0)
    return all(holds)


def outcome(objectives: Sequence[Objective], constraints: Sequence[str], final: Mapping[str, float]
            ) -> tuple[list[float], dict[str, float]] | str:
    """What a complete trial tells the study: (its objective values in order, constraint name -> violation), or
    why it cannot (one line naming the metric the run did not write, or wrote non-finite)."""
    for metric in [m for m, _ in objectives] + [parse_constraint(c)[0] for c in constraints]:
        value = final.get(metric)
        if value is None:
            written = ", ".join(sorted(final)) or "nothing"
            return f"the run wrote no {metric} to metrics.jsonl (it wrote: {written})"
        if not math.isfinite(value):
            return f"the run ended with {metric} = {value}"
    values = [float(final[m]) for m, _ in objectives]
    violations = {text: violation(text, float(final[parse_constraint(text)[0]])) for text in constraints}
    return values, violations


def tell(study, trial, objectives: Sequence[Objective], values: Sequence[float], violations: Mapping[str, float]
         ) -> str:
    """Tells `study` a complete trial: its constraints set first (Trial.set_constraint: the sampler and the
    Pareto front read them), then its value (one objective) or values. Returns what it told, for the log."""
    for name, amount in violations.items():
        trial.set_constraint(name, amount)
    study.tell(trial, list(values) if len(objectives) > 1 else values[0])
    shown = ", ".join(f"{metric} {value:.4g}" for (metric, _), value in zip(objectives, values))
    broken = [name for name, amount in violations.items() if amount > 0]
    return shown + (f" (infeasible: {', '.join(broken)})" if broken else "")
