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

from mwloop import jsonl

STATUSES = ("done", "failed", "pending")
# The columns of results.md, in this order when present; results.csv has every metric.
TABLE_METRICS = ("train/loss", "train/accuracy", "eval/loss", "eval/accuracy", "train/examples_per_sec")
HPARAMS_SUFFIX = ".sweep_hparams"  # marks the event files the sweep writes, so a rerun replaces only those


@dataclasses.dataclass
class PointResult:
    """One sweep point: what it ran with and how it ended."""
    name: str
    workdir: str
    values: dict[str, Any]  # swept config key -> the value this point ran with
    status: str = "pending"  # done | failed | pending
    wall_s: float | None = None
    error: str = ""
    events: list[dict] = dataclasses.field(default_factory=list)

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
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    try:
        return jsonl.read(path)
    except jsonl.CorruptFileError as e:
        logging.warning("%s; leaving its metrics out of the results", e)
        return []


def ranked(results: list[PointResult], metric: str, mode: str) -> list[PointResult]:
    """Finished points best first by `metric`; then points without it (failed, pending) in sweep order."""
    def key(result: PointResult) -> tuple:
        value = result.final.get(metric)
        if result.status != "done" or value is None or not math.isfinite(value):
            return (1, 0.0)
        return (0, -value if mode == "max" else value)
    return sorted(results, key=key)  # stable: ties keep sweep order


def format_value(value: Any) -> str:
    """A short, exact text for a config value: 0.0005, 5e-05, 16x32, true."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        short = f"{value:g}"
        return short if float(short) == value else repr(value)
    if isinstance(value, (tuple, list)):
        return "x".join(format_value(v) for v in value)
    return str(value)


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
    """One row per point: rank, name, status, swept values, steps, every final metric, wall time, error."""
    metrics = _metric_columns(results)
    with jsonl.atomic_open(path, "w", newline="") as f:  # rewritten after every point: never half a table
        writer = csv.writer(f)
        writer.writerow(["rank", "name", "status", *keys, "steps", *metrics, "wall_s", "error"])
        for rank, result in enumerate(results, 1):
            wall = "" if result.wall_s is None else f"{result.wall_s:.1f}"
            writer.writerow([rank, result.name, result.status, *(result.values.get(k, "") for k in keys),
                             result.steps if result.steps is not None else "",
                             *(result.final.get(m, "") for m in metrics), wall, result.error])


def _cell(metric: str, value: float | None) -> str:
    if value is None:
        return ""
    return f"{value:.0f}" if metric.endswith("examples_per_sec") else f"{value:.4f}"


def markdown_table(results: list[PointResult], keys: list[str], labels: dict[str, str], metric: str) -> str:
    """The results table in Markdown, best first, the ranking metric in bold."""
    metrics = [m for m in TABLE_METRICS if any(m in r.final for r in results)]
    header = ["#", *(labels[k] for k in keys), "status", "steps",
              *(f"**{m}**" if m == metric else m.replace("examples_per_sec", "examples/s") for m in metrics), "wall"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for rank, r in enumerate(results, 1):
        row = [str(rank), *(format_value(r.values[k]) if k in r.values else "" for k in keys), r.status,
               "" if r.steps is None else str(r.steps), *(_cell(m, r.final.get(m)) for m in metrics),
               format_seconds(r.wall_s)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def write_markdown(path: str, results: list[PointResult], keys: list[str], labels: dict[str, str], *,
                   metric: str, mode: str, title: str) -> None:
    """results.md: a heading, the table, and each failure's error with the path of its log."""
    counts = {s: sum(r.status == s for r in results) for s in STATUSES}
    lines = [f"# {title}", "",
             f"{len(results)} points: {counts['done']} done, {counts['failed']} failed, {counts['pending']} pending. "
             f"Ranked by {metric} ({mode}).", "", markdown_table(results, keys, labels, metric), ""]
    failed = [r for r in results if r.status == "failed"]
    if failed:
        lines += ["## Failed", ""]
        lines += [f"- `{r.name}`: {r.error} (log: `{os.path.join(r.workdir, 'log.txt')}`)" for r in failed]
        lines.append("")
    with jsonl.atomic_open(path) as f:
        f.write("\n".join(lines))


def _numeric(values: list) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def _order(value: Any) -> tuple:
    """Sorts numbers by value and anything else by its text, without comparing the two."""
    return (0, value, "") if _numeric([value]) else (1, 0, format_value(value))


def _plot_against(ax, results: list[PointResult], key: str, keys: list[str], labels: dict[str, str],
                  metric: str) -> None:
    """`metric` against `key`, one line per combination of the other swept values; failed points as red x."""
    xs = list(dict.fromkeys(r.values[key] for r in results))
    numeric = _numeric(xs)

    def position(value: Any) -> Any:  # strings, tuples, bools: evenly spaced categories in sweep order
        return value if numeric else xs.index(value)

    groups: dict[tuple, list[tuple[Any, float]]] = {}
    for r in results:
        if r.status == "done" and metric in r.final:
            rest = tuple((k, r.values[k]) for k in keys if k != key)
            groups.setdefault(rest, []).append((position(r.values[key]), r.final[metric]))
    for rest in sorted(groups, key=lambda rest: [_order(v) for _, v in rest]):
        pairs = groups[rest]
        label = ",".join(f"{labels[k]}={format_value(v)}" for k, v in rest)
        pairs.sort()
        ax.plot([x for x, _ in pairs], [y for _, y in pairs], "o-", label=label or None)
    failed = [position(r.values[key]) for r in results if r.status == "failed"]
    if failed:  # at the bottom of the axes: a failed point has no metric to place it by
        ax.plot(failed, [0.03] * len(failed), "rx", markersize=9, transform=ax.get_xaxis_transform(), label="failed")
    positive = [x for x in xs if numeric and x > 0]
    if numeric and positive and max(positive) / min(positive) >= 10:
        # learning rates and decays span decades; symlog keeps a 0 on the axis
        ax.set_xscale("log" if len(positive) == len(xs) else "symlog", **({} if len(positive) == len(xs) else
                                                                           {"linthresh": min(positive)}))
    ticks = sorted(xs) if numeric else list(range(len(xs)))
    ax.set_xticks(ticks, [format_value(x) for x in (ticks if numeric else xs)], rotation=30 if len(xs) > 5 else 0)
    ax.minorticks_off()
    ax.set_xlabel(key)
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} vs {labels[key]}")
    ax.grid(alpha=0.3)
    if len(groups) > 1 or failed:
        ax.legend(fontsize="small")


def write_plot(path: str, results: list[PointResult], keys: list[str], labels: dict[str, str], *,
               metric: str) -> None:
    """results.png: `metric` against each swept key, then `metric` over training for every point."""
    import matplotlib
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(keys) + 1, figsize=(5.2 * (len(keys) + 1), 4.2), squeeze=False)
    for ax, key in zip(axes[0], keys):
        _plot_against(ax, results, key, keys, labels, metric)
    ax = axes[0][-1]
    for r in results:
        curve = r.curve(metric)
        if curve:
            style = "o-" if r.status == "done" else "x--"
            ax.plot([s for s, _ in curve], [v for _, v in curve], style, markersize=3, label=r.name)
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} during training")
    ax.grid(alpha=0.3)
    if any(r.curve(metric) for r in results):  # beside the axes: inside it would hide the curves
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
        if r.status != "pending":
            session = {hparams[k]: _hparam_value(r.values[k]) for k in keys if k in r.values}
            _write_events(r.workdir, hp.hparams_pb(session, trial_id=r.name))


def write_all(sweep_dir: str, results: list[PointResult], *, keys: list[str], all_keys: list[str],
              labels: dict[str, str], metric: str, mode: str, title: str, final: bool) -> None:
    """results.csv and results.md; with `final`, also results.png and the HParams summaries.

    `keys` tell the points apart (table, plot); `all_keys` are every key the sweep sets (csv, HParams).
    """
    results = ranked(results, metric, mode)
    write_csv(os.path.join(sweep_dir, "results.csv"), results, all_keys)
    write_markdown(os.path.join(sweep_dir, "results.md"), results, keys, labels, metric=metric, mode=mode,
                   title=title)
    if not final:
        return
    try:
        write_plot(os.path.join(sweep_dir, "results.png"), results, keys, labels, metric=metric)
    except ImportError:
        logging.warning("matplotlib is not installed (pip install mwloop[sweep]): no results.png")
    write_hparams(sweep_dir, results, all_keys)
