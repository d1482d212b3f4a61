"""results.png: a sweep's ranking metric against each swept key, over training for every trial, and (a search)
the best value so far. matplotlib is imported only when a plot is drawn (it is the `sweep` extra).
"""

from __future__ import annotations

from typing import Any

from mwloop.artifacts import jsonl
from mwloop.sweep.report import PointResult
from mwloop.sweep.values import format_value


def _text(value: Any) -> str:
    """A value as one line of plain text on the plot: a newline or other control character shows as its escape
    ("\\n"), not as a second line, and a `$` as itself, not the start of mathtext ("$x^$" raised at savefig,
    "$\\alpha$" drew another text). (Mathtext stays on for matplotlib's own labels: a log axis's 10^-1.)"""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in format_value(value))
    return text.replace("$", r"\$")


def _numeric(values: list) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def _order(value: Any) -> tuple:
    """Sorts numbers by value and anything else by its text, without comparing the two."""
    return (0, value, "") if _numeric([value]) else (1, 0, format_value(value))


def _plot_against(ax, results: list[PointResult], key: str, keys: list[str], labels: dict[str, str],
                  metric: str, scatter: bool = False) -> None:
    """`metric` against `key`, one line per combination of the other swept values; failed points as red x."""
    xs = list(dict.fromkeys(r.values[key] for r in results if key in r.values))
    numeric = _numeric(xs)

    def position(value: Any) -> Any:
        """The value itself if numeric; strings, tuples, bools: evenly spaced categories in sweep order."""
        return value if numeric else xs.index(value)

    groups: dict[tuple, list[tuple[Any, float]]] = {}
    for r in results:
        if r.status == "complete" and metric in r.final and key in r.values:
            rest = () if scatter else tuple((k, r.values.get(k)) for k in keys if k != key)
            groups.setdefault(rest, []).append((position(r.values[key]), r.final[metric]))
    for rest in sorted(groups, key=lambda rest: [_order(v) for _, v in rest]):
        pairs = groups[rest]
        label = ",".join(f"{labels[k]}={_text(v)}" for k, v in rest)
        pairs.sort()
        ax.plot([x for x, _ in pairs], [y for _, y in pairs], "o" if scatter else "o-", label=label or None)
    failed = [position(r.values[key]) for r in results if r.status == "failed" and key in r.values]
    # At the bottom of the axes: a failed point has no metric to place it by.
    if failed:
        ax.plot(failed, [0.03] * len(failed), "rx", markersize=9, transform=ax.get_xaxis_transform(), label="failed")
    positive = [x for x in xs if numeric and x > 0]
    if numeric and positive and max(positive) / min(positive) >= 10:
        # learning rates and decays span decades; symlog keeps a 0 on the axis
        ax.set_xscale("log" if len(positive) == len(xs) else "symlog", **({} if len(positive) == len(xs) else
                                                                           {"linthresh": min(positive)}))
    ticks = sorted(xs) if numeric else list(range(len(xs)))
    # A search's sampled values are too many to label each.
    if not (scatter and numeric):
        ax.set_xticks(ticks, [_text(x) for x in (ticks if numeric else xs)], rotation=30 if len(xs) > 5 else 0)
    ax.minorticks_off()
    ax.set_xlabel(key)
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} vs {labels[key]}")
    ax.grid(alpha=0.3)
    if len(groups) > 1 or failed:
        ax.legend(fontsize="small")


def _best_so_far(ax, results: list[PointResult], metric: str, mode: str) -> None:
    """The best `metric` of the complete trials against the trial number: how fast the search found it."""
    done = sorted((r.number, r.final[metric]) for r in results
                  if r.status == "complete" and metric in r.final and r.number is not None)
    best, curve = None, []
    for number, value in done:
        best = value if best is None else (max if mode == "max" else min)(best, value)
        curve.append((number, best))
    ax.plot([n for n, _ in done], [v for _, v in done], "o", alpha=0.4, label="trial")
    ax.step([n for n, _ in curve], [v for _, v in curve], where="post", label="best so far")
    ax.set_xlabel("trial")
    ax.set_ylabel(metric)
    ax.set_title(f"best {metric} so far")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def _pareto(ax, results: list[PointResult], objectives: list[tuple[str, str]]) -> None:
    """The first two objectives of every complete trial, the Pareto front (`study.best_trials`) joined and
    labelled by trial number, infeasible trials (CONSTRAINTS) as grey crosses."""
    (x_metric, x_mode), (y_metric, y_mode) = objectives[:2]
    done = [r for r in results if r.status == "complete" and x_metric in r.final and y_metric in r.final]
    for feasible, style in ((True, dict(marker="o", color="tab:blue", alpha=0.5, label="trial")),
                            (False, dict(marker="x", color="grey", label="infeasible"))):
        points = [(r.final[x_metric], r.final[y_metric]) for r in done if (r.feasible is not False) == feasible]
        if points:
            ax.plot(*zip(*points), linestyle="none", **style)
    front = sorted((r.final[x_metric], r.final[y_metric], r.number) for r in done if r.pareto)
    if front:
        # The boundary of what the front attains: with x maximised, a step's y holds up to its point.
        ax.step([x for x, _, _ in front], [y for _, y, _ in front], "o-", where="pre" if x_mode == "max" else "post",
                color="tab:red", label="Pareto front")
        for x, y, number in front:
            ax.annotate(str(number), (x, y), textcoords="offset points", xytext=(4, 4), fontsize="small")
    ax.set_xlabel(f"{x_metric} ({x_mode})")
    ax.set_ylabel(f"{y_metric} ({y_mode})")
    ax.set_title("Pareto front" + (f" (of {len(objectives)} objectives: the first two)" if len(objectives) > 2 else ""))
    ax.grid(alpha=0.3)
    if done:
        ax.legend(fontsize="small")


def write_plot(path: str, results: list[PointResult], keys: list[str], labels: dict[str, str], *,
               metric: str, mode: str = "max", search: bool = False, objectives: list[tuple[str, str]] = ()) -> None:
    """results.png: `metric` against each swept key, then `metric` over training for every trial (pruned ones
    dashed, ending in a cross); a search also gets the best value so far against the trial number, and several
    `objectives` their Pareto front instead."""
    import matplotlib
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    # A search's panel of the best so far, or (a grid's too) the Pareto front.
    panels = len(keys) + 1 + (search or bool(objectives))
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.2), squeeze=False)
    for ax, key in zip(axes[0], keys):
        _plot_against(ax, results, key, keys, labels, metric, scatter=search)
    if objectives:
        _pareto(axes[0][len(keys)], results, objectives)
    elif search:
        _best_so_far(axes[0][len(keys)], results, metric, mode)
    ax = axes[0][-1]
    # A label per trial only while the legend stays readable.
    many = len(results) > 12
    for r in results:
        curve = r.curve(metric)
        if curve:
            style = "o-" if r.status == "complete" else "--"
            line, = ax.plot([s for s, _ in curve], [v for _, v in curve], style, markersize=3,
                            label=None if many else (r.name if r.number is None else f"{r.number}: {r.name}"))
            if r.status == "pruned":
                ax.plot(*curve[-1], "x", color=line.get_color(), markersize=8)
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} during training" + (" (x: pruned)" if any(r.status == "pruned" for r in results) else ""))
    ax.grid(alpha=0.3)
    # The legend beside the axes: inside it would hide the curves.
    if not many and any(r.curve(metric) for r in results):
        ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    with jsonl.atomic_open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
