"""Sweep results people can read: results.csv, results.md, results.png and TensorBoard HParams.

Everything here reads `DIR/<point>/metrics.jsonl` (one JSON event per line:
`step`, `split`, metrics) and never imports TensorFlow, so the sweep runner
stays a light process beside its training subprocesses.
"""

from __future__ import annotations

import csv
import dataclasses
import glob
import math
import os
import time
from typing import Any

from absl import logging

from mwloop.artifacts import files, jsonl
from mwloop.sweep.values import format_value

STATUSES = ("complete", "pruned", "running", "failed", "waiting")  # Optuna's trial states, ranked in this order
# The columns of results.md, in this order when present; results.csv has every metric.
TABLE_METRICS = ("train/loss", "train/accuracy", "eval/loss", "eval/accuracy", "train/examples_per_sec")
HPARAMS_SUFFIX = ".sweep_hparams"  # marks the event files the sweep writes, so a rerun replaces only those


@dataclasses.dataclass
class PointResult:
    """One trial: what it ran with and how it ended."""
    name: str
    workdir: str
    values: dict[str, Any]  # swept config key -> the value this trial ran with
    status: str = "waiting"  # one of STATUSES
    wall_s: float | None = None
    error: str = ""
    events: list[dict] = dataclasses.field(default_factory=list)
    number: int | None = None  # the Optuna trial number
    command: str = ""  # the exact command that reruns it

    @property
    def final(self) -> dict[str, float]:
        """The last value of every metric, keyed "<split>/<name>" (e.g. "eval/accuracy")."""
        final: dict[str, float] = {}
        for event in self.events:
            for key, value in event.items():
                if key not in ("step", "split") and isinstance(value, (int, float)):  # not a stop's reason
                    final[f"{event['split']}/{key}"] = value
        return final

    @property
    def steps(self) -> int | None:
        return max((event["step"] for event in self.events if event["split"] == "train"), default=None)

    def curve(self, metric: str) -> list[tuple[int, float]]:
        """(step, value) of `metric` ("<split>/<name>") over the run."""
        split, name = metric.split("/", 1)
        return [(e["step"], e[name]) for e in self.events if e["split"] == split and name in e]


def read_events(workdir: str) -> list[dict]:
    """The events of workdir/metrics.jsonl; none when the run wrote none yet or the file is corrupt.

    A last line torn by a crash is skipped with a warning; a corrupt file is reported, and its point
    shows no metrics rather than stopping the whole sweep.
    """
    try:
        return files.read_metrics(workdir)
    except jsonl.CorruptFileError as e:
        logging.warning("%s; leaving its metrics out of the results", e)
        return []


def ranked(results: list[PointResult], metric: str, mode: str) -> list[PointResult]:
    """Complete trials best first by `metric`, then pruned ones (by their last value), running, failed and
    waiting ones in trial order."""
    def key(result: PointResult) -> tuple:
        value = result.final.get(metric)
        group = STATUSES.index(result.status) if result.status in STATUSES else len(STATUSES)
        if result.status not in ("complete", "pruned") or value is None or not math.isfinite(value):
            return (group, 0.0)
        return (group, -value if mode == "max" else value)
    return sorted(results, key=key)  # stable: ties keep trial order


def format_seconds(seconds: float | None) -> str:
    if seconds is None:
        return ""
    seconds = round(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def _metric_columns(results: list[PointResult]) -> list[str]:
    seen: dict[str, None] = {}
    for result in results:
        seen.update(dict.fromkeys(result.final))
    preferred = [m for m in TABLE_METRICS if m in seen]
    return preferred + sorted(m for m in seen if m not in preferred)


def write_csv(path: str, results: list[PointResult], keys: list[str]) -> None:
    """One row per trial: rank, trial number, name, status, swept values, steps, every final metric, wall time,
    error."""
    metrics = _metric_columns(results)
    with jsonl.atomic_open(path, "w", newline="") as f:  # rewritten after every point: never half a table
        writer = csv.writer(f)
        writer.writerow(["rank", "trial", "name", "status", *keys, "steps", *metrics, "wall_s", "error"])
        for rank, result in enumerate(results, 1):
            wall = "" if result.wall_s is None else f"{result.wall_s:.1f}"
            number = "" if result.number is None else result.number
            writer.writerow([rank, number, result.name, result.status, *(result.values.get(k, "") for k in keys),
                             result.steps if result.steps is not None else "",
                             *(result.final.get(m, "") for m in metrics), wall, result.error])


def _cell(metric: str, value: float | None) -> str:
    if value is None:
        return ""
    return f"{value:.0f}" if metric.endswith("examples_per_sec") else f"{value:.4f}"


def markdown_table(results: list[PointResult], keys: list[str], labels: dict[str, str], metric: str,
                   numbers: bool = False) -> str:
    """The results table in Markdown, best first, the ranking metric in bold (always a column)."""
    metrics = [m for m in TABLE_METRICS if any(m in r.final for r in results) or m == metric]
    if metric not in metrics:  # a task's own metric, e.g. eval/f1
        metrics.insert(0, metric)
    header = ["#", *(["trial"] if numbers else []), *(labels[k] for k in keys), "status", "steps",
              *(f"**{m}**" if m == metric else m.replace("examples_per_sec", "examples/s") for m in metrics), "wall"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    # A grid's values exactly as in its file; a search's sampled floats to 4 digits (results.csv has them all).
    short = (lambda v: f"{v:.4g}" if isinstance(v, float) else format_value(v)) if numbers else format_value
    for rank, r in enumerate(results, 1):
        row = [str(rank), *([str(r.number)] if numbers else []),
               *(short(r.values[k]) if k in r.values else "" for k in keys), r.status,
               "" if r.steps is None else str(r.steps), *(_cell(m, r.final.get(m)) for m in metrics),
               format_seconds(r.wall_s)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def write_markdown(path: str, results: list[PointResult], keys: list[str], labels: dict[str, str], *,
                   metric: str, mode: str, title: str, numbers: bool = False) -> None:
    """results.md: a heading, the table, the best trial's command, and each failure's error with its log."""
    counts = ", ".join(f"{sum(r.status == s for r in results)} {s}" for s in STATUSES
                       if s in ("complete", "pruned", "failed") or any(r.status == s for r in results))
    lines = [f"# {title}", "", f"{len(results)} trials: {counts}. Ranked by {metric} ({mode}).", "",
             markdown_table(results, keys, labels, metric, numbers), ""]
    best = results[0] if results and results[0].status == "complete" and metric in results[0].final else None
    if best is not None and best.command:
        lines += [f"Best: trial {best.number} ({metric} {_cell(metric, best.final[metric])}). Reproduce it with:", "",
                  "```sh", best.command, "```", ""]
    failed = [r for r in results if r.status == "failed"]
    if failed:
        lines += ["## Failed", ""]
        lines += [f"- `{r.name}`: {r.error} (log: `{os.path.join(r.workdir, files.LOG)}`)" for r in failed]
        lines.append("")
    with jsonl.atomic_open(path) as f:
        f.write("\n".join(lines))


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

    def position(value: Any) -> Any:  # strings, tuples, bools: evenly spaced categories in sweep order
        return value if numeric else xs.index(value)

    groups: dict[tuple, list[tuple[Any, float]]] = {}
    for r in results:
        if r.status == "complete" and metric in r.final and key in r.values:
            rest = () if scatter else tuple((k, r.values.get(k)) for k in keys if k != key)
            groups.setdefault(rest, []).append((position(r.values[key]), r.final[metric]))
    for rest in sorted(groups, key=lambda rest: [_order(v) for _, v in rest]):
        pairs = groups[rest]
        label = ",".join(f"{labels[k]}={format_value(v)}" for k, v in rest)
        pairs.sort()
        ax.plot([x for x, _ in pairs], [y for _, y in pairs], "o" if scatter else "o-", label=label or None)
    failed = [position(r.values[key]) for r in results if r.status == "failed" and key in r.values]
    if failed:  # at the bottom of the axes: a failed point has no metric to place it by
        ax.plot(failed, [0.03] * len(failed), "rx", markersize=9, transform=ax.get_xaxis_transform(), label="failed")
    positive = [x for x in xs if numeric and x > 0]
    if numeric and positive and max(positive) / min(positive) >= 10:
        # learning rates and decays span decades; symlog keeps a 0 on the axis
        ax.set_xscale("log" if len(positive) == len(xs) else "symlog", **({} if len(positive) == len(xs) else
                                                                           {"linthresh": min(positive)}))
    ticks = sorted(xs) if numeric else list(range(len(xs)))
    if not (scatter and numeric):  # a search's sampled values are too many to label each
        ax.set_xticks(ticks, [format_value(x) for x in (ticks if numeric else xs)], rotation=30 if len(xs) > 5 else 0)
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


def write_plot(path: str, results: list[PointResult], keys: list[str], labels: dict[str, str], *,
               metric: str, mode: str = "max", search: bool = False) -> None:
    """results.png: `metric` against each swept key, then `metric` over training for every trial (pruned ones
    dashed, ending in a cross); a search also gets the best value so far against the trial number."""
    import matplotlib
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    panels = len(keys) + 1 + search
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.2), squeeze=False)
    for ax, key in zip(axes[0], keys):
        _plot_against(ax, results, key, keys, labels, metric, scatter=search)
    if search:
        _best_so_far(axes[0][len(keys)], results, metric, mode)
    ax = axes[0][-1]
    many = len(results) > 12  # a label per trial only while the legend stays readable
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
    if not many and any(r.curve(metric) for r in results):  # beside the axes: inside it would hide the curves
        ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    with jsonl.atomic_open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)


def _hparam_value(value: Any) -> bool | float | str:
    """HParams take bool, number or string: a tuple becomes its text."""
    if isinstance(value, bool) or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return float(value)  # the dashboard stores numbers as float64 anyway
    return format_value(value)


def _write_events(logdir: str, summary) -> None:
    """One event file holding `summary`. (tensorboard's EventFileWriter would import TensorFlow: seconds.)"""
    import socket

    from tensorboard.compat.proto import event_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter

    for old in glob.glob(os.path.join(logdir, f"events.out.tfevents.*{HPARAMS_SUFFIX}")):
        os.remove(old)  # a rerun replaces the sweep's own files, never the run's summaries
    now = time.time()
    path = os.path.join(logdir, f"events.out.tfevents.{int(now):010d}.{socket.gethostname()}{HPARAMS_SUFFIX}")
    writer = RecordWriter(open(path, "wb"))
    writer.write(event_pb2.Event(wall_time=now, file_version="brain.Event:2").SerializeToString())
    writer.write(event_pb2.Event(wall_time=now, summary=summary).SerializeToString())
    writer.close()


def write_hparams(sweep_dir: str, results: list[PointResult], keys: list[str]) -> None:
    """TensorBoard HParams: the experiment at `sweep_dir`, one session per point at `sweep_dir/<point>`.

    The session metrics are the scalars each run already writes under
    `<point>/summaries/<split>`, so nothing is copied.
    """
    # summary_v2 is what hparams.api exports, without importing TensorFlow.
    from tensorboard.plugins.hparams import summary_v2 as hp

    hparams = {}
    for key in keys:
        values = sorted({_hparam_value(r.values[key]) for r in results if key in r.values})
        hparams[key] = hp.HParam(key, hp.Discrete(values))
    metrics = [hp.Metric(name.split("/", 1)[1], group=f"summaries/{name.split('/', 1)[0]}", display_name=name,
                         dataset_type=hp.Metric.VALIDATION if name.startswith("eval/") else hp.Metric.TRAINING)
               for name in _metric_columns(results) if name.split("/", 1)[0] in ("train", "eval")]
    _write_events(sweep_dir, hp.hparams_config_pb(list(hparams.values()), metrics))
    for r in results:
        if r.status != "waiting" and os.path.isdir(r.workdir):  # a trial that failed before it ran has no directory
            session = {hparams[k]: _hparam_value(r.values[k]) for k in keys if k in r.values}
            _write_events(r.workdir, hp.hparams_pb(session, trial_id=r.name))


def write_all(sweep_dir: str, results: list[PointResult], *, keys: list[str], all_keys: list[str],
              labels: dict[str, str], metric: str, mode: str, title: str, final: bool, search: bool = False) -> None:
    """results.csv and results.md; with `final`, also results.png and the HParams summaries.

    `keys` tell the trials apart (table, plot); `all_keys` are every key the sweep sets (csv, HParams).
    """
    results = ranked(results, metric, mode)
    write_csv(os.path.join(sweep_dir, "results.csv"), results, all_keys)
    write_markdown(os.path.join(sweep_dir, "results.md"), results, keys, labels, metric=metric, mode=mode,
                   title=title, numbers=search)
    if not final:
        return
    try:
        write_plot(os.path.join(sweep_dir, "results.png"), results, keys, labels, metric=metric, mode=mode,
                   search=search)
    except ImportError:
        logging.warning("matplotlib is not installed (pip install mwloop[sweep]): no results.png")
    write_hparams(sweep_dir, results, all_keys)
