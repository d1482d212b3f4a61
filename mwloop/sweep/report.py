"""A sweep's results as rows and tables: one `PointResult` per trial, ranked, written as results.csv and
results.md. (results.png: plots.py; TensorBoard HParams: hparams.py; all of them from a study: results.py.)

Everything here reads `DIR/<point>/metrics.jsonl` (one JSON event per line:
`step`, `split`, metrics) and never imports TensorFlow, so the sweep runner
stays a light process beside its training subprocesses.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
import re
from typing import Any

from absl import logging

from mwloop.artifacts import files, jsonl
from mwloop.sweep import objectives as objectives_lib
from mwloop.sweep.values import format_value

# Optuna's trial states, ranked in this order; "interrupted": stopped by Ctrl-C or SIGTERM with a save, to resume
STATUSES = ("complete", "pruned", "running", "interrupted", "failed", "waiting")
# The columns of results.md, in this order when present; results.csv has every metric.
TABLE_METRICS = ("train/loss", "train/accuracy", "eval/loss", "eval/accuracy", "train/examples_per_sec")


@dataclasses.dataclass
class PointResult:
    """One trial: what it ran with and how it ended.

    Attributes:
      values: swept config key -> the value this trial ran with.
      status: one of STATUSES.
      number: the Optuna trial number.
      command: the exact command that reruns it.
      pareto: with several objectives, whether it is on the Pareto front (`study.best_trials`); None: one.
      feasible: with CONSTRAINTS, whether its final metrics meet them all (None: none, or not finished).
    """
    name: str
    workdir: str
    values: dict[str, Any]
    status: str = "waiting"
    wall_s: float | None = None
    error: str = ""
    events: list[dict] = dataclasses.field(default_factory=list)
    number: int | None = None
    command: str = ""
    pareto: bool | None = None
    feasible: bool | None = None

    @property
    def final(self) -> dict[str, float]:
        """The last value of every metric, keyed "<split>/<name>" (e.g. "eval/accuracy")."""
        return objectives_lib.final_metrics(self.events)

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
    """Complete trials best first by `metric` (the Pareto front first, and infeasible ones after the feasible),
    then pruned ones (by their last value), running, failed and waiting ones in trial order."""
    def key(result: PointResult) -> tuple:
        value = result.final.get(metric)
        group = STATUSES.index(result.status) if result.status in STATUSES else len(STATUSES)
        if result.status not in ("complete", "pruned") or value is None or not math.isfinite(value):
            return (group, False, False, 0.0)
        return (group, result.feasible is False, result.pareto is False, -value if mode == "max" else value)
    # Stable: ties keep trial order.
    return sorted(results, key=key)


def format_seconds(seconds: float | None) -> str:
    if seconds is None:
        return ""
    seconds = round(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def metric_columns(results: list[PointResult]) -> list[str]:
    """Every metric any trial reports: TABLE_METRICS first (those present), then the rest by name."""
    seen: dict[str, None] = {}
    for result in results:
        seen.update(dict.fromkeys(result.final))
    preferred = [m for m in TABLE_METRICS if m in seen]
    return preferred + sorted(m for m in seen if m not in preferred)


# results.csv's own columns besides the swept keys and the metrics (which hold a "/").
CSV_COLUMNS = ("rank", "trial", "name", "status", "pareto", "feasible", "steps", "wall_s", "error")


def csv_column(key: str) -> str:
    """A swept key's column in results.csv: the key, or "config.<key>" for one named as a column of its own
    (config.name): a reader by column name would otherwise get the other one."""
    return f"config.{key}" if key in CSV_COLUMNS else key


def write_csv(path: str, results: list[PointResult], keys: list[str]) -> None:
    """One row per trial: rank, trial number, name, status, swept values, steps, every final metric, wall time,
    error."""
    metrics = metric_columns(results)
    # With several objectives or constraints: whether each trial is on the front, meets them.
    marks = [m for m in ("pareto", "feasible") if any(getattr(r, m) is not None for r in results)]
    # Rewritten after every point: never half a table.
    with jsonl.atomic_open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["rank", "trial", "name", "status", *marks, *map(csv_column, keys), "steps", *metrics,
                         "wall_s", "error"])
        for rank, result in enumerate(results, 1):
            wall = "" if result.wall_s is None else f"{result.wall_s:.1f}"
            number = "" if result.number is None else result.number
            writer.writerow([rank, number, result.name, result.status,
                             *("" if getattr(result, m) is None else getattr(result, m) for m in marks),
                             *(result.values.get(k, "") for k in keys),
                             result.steps if result.steps is not None else "",
                             *(result.final.get(m, "") for m in metrics), wall, result.error])


# CommonMark's backslash escapes, for the ASCII punctuation that changes a cell's text when rendered: `|` ends the
# cell, ` * ~ $ [ ] < > & start code, emphasis, math (GitHub), links, HTML and entities. `_` only where it can
# start or end emphasis (not inside a word: learning_rate stays readable).
_MARKDOWN_SPECIAL = re.compile(r"[\\`*|~$\[\]<>&]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")
# What Python's str.splitlines() breaks at; a Markdown renderer ends the row at the first of \n and \r.
_LINE_BREAK = re.compile("\r\n|[\n\r\x0b\x0c\x1c-\x1e\x85\u2028\u2029]")


def escape_cell(text: str) -> str:
    """Text that renders as itself in a Markdown table cell (CommonMark + GitHub's tables).

    A `|` would end the cell and a newline the row; each line break shows as `<br>` (a line break in the
    rendered cell), so "c\\nd" and "c d" stay two different values.
    """
    escaped = _MARKDOWN_SPECIAL.sub(lambda m: "\\" + m.group(0), text)
    return _LINE_BREAK.sub("<br>", escaped)


def fence(text: str) -> str:
    """A code fence for `text`: longer than any run of backticks in it, so the text cannot close it."""
    longest = max((len(run) for run in re.findall("`+", text)), default=0)
    return "`" * max(3, longest + 1)


def _cell(metric: str, value: float | None) -> str:
    if value is None:
        return ""
    if metric.endswith(("examples_per_sec", "/params")):
        return f"{value:.0f}"
    # Costs span decades (MB, ms): significant digits.
    return f"{value:.4g}" if metric.startswith(("cost/", "export/")) else f"{value:.4f}"


def _mark(value: bool | None) -> str:
    return "" if value is None else "yes" if value else "no"


def markdown_table(results: list[PointResult], keys: list[str], labels: dict[str, str], metric: str,
                   numbers: bool = False, objectives: list[str] | None = None, constrained: list[str] = ()) -> str:
    """The results table in Markdown, best first, the ranking metric (`objectives`: each) in bold (always a
    column), and the metrics of `constrained` (CONSTRAINTS) too; a Pareto and a feasible column when trials have
    them."""
    ranked_by = objectives or [metric]
    metrics = [m for m in TABLE_METRICS if any(m in r.final for r in results) or m == metric]
    # Several objectives: first, in their order. A task's own metric (e.g. eval/f1), a cost: first.
    first = [*objectives, *constrained] if objectives else [metric, *constrained]
    metrics = list(dict.fromkeys([*(m for m in first if objectives or m not in metrics), *metrics]))
    marks = [m for m in ("pareto", "feasible") if any(getattr(r, m) is not None for r in results)]
    header = [*map(escape_cell, ["#", *(["trial"] if numbers else []), *(labels[k] for k in keys), "status",
                                 *(m.capitalize() if m == "pareto" else m for m in marks), "steps"]),
              *(f"**{escape_cell(m)}**" if m in ranked_by else escape_cell(m.replace("examples_per_sec", "examples/s"))
                for m in metrics), "wall"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    # A grid's values exactly as in its file; a search's sampled floats to 4 digits (results.csv has them all).
    short = (lambda v: f"{v:.4g}" if isinstance(v, float) else format_value(v)) if numbers else format_value
    for rank, r in enumerate(results, 1):
        row = [str(rank), *([str(r.number)] if numbers else []),
               *(short(r.values[k]) if k in r.values else "" for k in keys), r.status,
               *(_mark(getattr(r, m)) for m in marks), "" if r.steps is None else str(r.steps),
               *(_cell(m, r.final.get(m)) for m in metrics), format_seconds(r.wall_s)]
        lines.append("| " + " | ".join(map(escape_cell, row)) + " |")
    return "\n".join(lines)


def write_markdown(path: str, results: list[PointResult], keys: list[str], labels: dict[str, str], *,
                   metric: str, mode: str, title: str, numbers: bool = False,
                   objectives: list[tuple[str, str]] = (), constraints: list[str] = ()) -> None:
    """results.md: a heading, the table, the best trial's command (several objectives: each Pareto-front
    trial's), and each failure's error with its log."""
    counts = ", ".join(f"{sum(r.status == s for r in results)} {s}" for s in STATUSES
                       if s in ("complete", "pruned", "failed") or any(r.status == s for r in results))
    front = [r for r in results if r.pareto]
    ranking = (f"Pareto front of {', '.join(f'{escape_cell(m)} ({d})' for m, d in objectives)}: {len(front)} "
               f"trial(s), first in the table" if objectives else f"Ranked by {escape_cell(metric)} ({mode})")
    if constraints:
        ranking += f"; constraints {', '.join(map(escape_cell, constraints))} (infeasible trials last)"
    constrained = [objectives_lib.parse_constraint(c)[0] for c in constraints]
    # The title holds the sweep file's path: one line, rendered as itself.
    lines = [f"# {escape_cell(' '.join(title.split()))}", "", f"{len(results)} trials: {counts}. {ranking}.", "",
             markdown_table(results, keys, labels, metric, numbers, [m for m, _ in objectives], constrained), ""]
    best = results[0] if results and results[0].status == "complete" and metric in results[0].final else None
    if objectives and front:
        block = "\n".join(f"# trial {r.number}: " + ", ".join(f"{m} {_cell(m, r.final.get(m))}" for m, _ in objectives)
                          + f"\n{r.command}" for r in front if r.command)
        lines += ["Reproduce a trial of the Pareto front with its command:", "", fence(block) + "sh", block,
                  fence(block), ""]
    elif not objectives and best is not None and best.command and best.feasible is not False:
        lines += [f"Best: trial {best.number} ({escape_cell(metric)} {_cell(metric, best.final[metric])}). "
                  "Reproduce it with:", "", fence(best.command) + "sh", best.command, fence(best.command), ""]
    failed = [r for r in results if r.status == "failed"]
    if failed:
        lines += ["## Failed", ""]
        # An error of many lines would end its list item at its first newline; a path may hold any character.
        lines += [f"- {escape_cell(r.name)}: {escape_cell(' '.join(r.error.split()))} "
                  f"(log: {escape_cell(os.path.join(r.workdir, files.LOG))})" for r in failed]
        lines.append("")
    with jsonl.atomic_open(path) as f:
        f.write("\n".join(lines))
