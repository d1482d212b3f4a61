"""A PBT study's results (docs/pbt.md): the lineage as a table in results.md, the members' hyperparameter
schedules as pbt_schedules.png, and one command that retrains the winner's schedule from scratch.

Everything is read from the study: each segment's trial holds its lineage (`pbt_runner.LINEAGE`).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence

from optuna.trial import FrozenTrial, TrialState

from mwloop.artifacts import jsonl
from mwloop.sweep import pbt_runner, plan, report, runner
from mwloop.sweep import study as studies
from mwloop.sweep.values import format_value

PLOT = "pbt_schedules.png"


def _lineage(trial: FrozenTrial) -> dict:
    return trial.user_attrs[pbt_runner.LINEAGE]


def final_segments(trials: Sequence[FrozenTrial]) -> list[FrozenTrial]:
    """The complete segments of the last interval: each member's final score (none before the last interval)."""
    segments = pbt_runner.live(trials)
    last = max((k for _, k in segments), default=None)
    return [t for (_, k), t in segments.items()
            if k == last and t.state == TrialState.COMPLETE and _lineage(t)["last"]]


def winner(trials: Sequence[FrozenTrial], mode: str) -> FrozenTrial | None:
    """The best complete segment of the last interval (a member's final score), or None before there is one."""
    final = final_segments(trials)
    if not final:
        return None
    return (max if mode == "max" else min)(final, key=lambda t: (t.value, -t.number))


def chain(trials: Sequence[FrozenTrial], last: FrozenTrial) -> list[FrozenTrial]:
    """The segments `last`'s member trained through, first to last: its parents, back to a member's first."""
    segments = pbt_runner.live(trials)
    found = [last]
    while (parent := _lineage(found[-1])["parent"]) is not None:
        found.append(segments[tuple(parent)])
    return found[::-1]


def reproduce_command(trials: Sequence[FrozenTrial], last: FrozenTrial, config_spec: str, out_dir: str) -> str:
    """One shell line that retrains `last`'s schedule from scratch in `out_dir`/k<i>: a `mwloop.main` per step
    range with the values of that range, each continuing the one before (its whole state), joined by &&."""
    base = plan.base_config(config_spec)
    commands, previous = [], None
    for i, segment in enumerate(chain(trials, last)):
        lineage = dict(_lineage(segment))
        workdir = os.path.join(out_dir, f"k{i}")
        flags = pbt_runner.segment_flags(lineage, out_dir)
        if previous is not None:
            flags["init_checkpoint"] = os.path.join(previous, "checkpoints", f"ckpt-{lineage['start']}")
        override_flags, _ = plan.check_point(config_spec, base, {**lineage["values"], **flags})
        commands.append(shlex.join(["python", *runner.command(config_spec, workdir, override_flags)[1:]]))
        previous = workdir
    return " && ".join(commands)


def lineage_markdown(trials: Sequence[FrozenTrial], metric: str, keys: Sequence[str]) -> str:
    """The lineage table: a row per segment, by member then interval: its steps, where its state came from,
    its values and its score."""
    header = ["segment", "steps", "from", "copied", *keys, metric, "status"]
    lines = ["| " + " | ".join(map(report.escape_cell, header)) + " |", "|" + "---|" * len(header)]
    for (member, interval), trial in sorted(pbt_runner.live(trials).items()):
        lineage = _lineage(trial)
        parent = lineage["parent"]
        row = [f"m{member}/k{interval}", f"{lineage['start']}-{lineage['stop']}",
               "scratch" if parent is None else f"m{parent[0]}/k{parent[1]}", "yes" if lineage["exploit"] else "",
               *(_short(lineage["values"].get(k)) for k in keys),
               "" if trial.value is None else f"{trial.value:.4f}", trial.state.name.lower()]
        lines.append("| " + " | ".join(map(report.escape_cell, row)) + " |")
    return "\n".join(lines)


def _short(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else format_value(value)


def append_markdown(path: str, trials: Sequence[FrozenTrial], settings: studies.Settings, sweep_dir: str) -> None:
    """Adds the lineage table and the winner's reproduce command to results.md (written just before)."""
    keys = sorted(settings.pbt["perturb"])
    lines = ["", "## Population-based training: lineage", "",
             f"Each member's segments of {settings.pbt['interval_steps']} steps; `from` is the segment whose "
             f"checkpoint (weights, optimizer, step) it continued, `copied` marks an exploit (its values perturbed). "
             f"{PLOT} shows the schedules.", "", lineage_markdown(trials, settings.metric, keys), ""]
    best = winner(trials, settings.mode)
    if best is not None:
        member = _lineage(best)["member"]
        command = reproduce_command(trials, best, settings.config, os.path.join(sweep_dir, "reproduce"))
        lines += [f"Winner: member m{member} ({report.escape_cell(settings.metric)} {best.value:.4f}). Retrain its "
                  f"schedule from scratch with:", "", report.fence(command) + "sh", command, report.fence(command), ""]
    with open(path, "a") as f:
        f.write("\n".join(lines))


def write_plot(path: str, trials: Sequence[FrozenTrial], settings: studies.Settings) -> None:
    """pbt_schedules.png: each perturbed value against the step, a line per member as its weights trained (its
    lineage: the segments of the members it copied, then its own), and the metric at each interval's end; the
    winner's lines thick."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted(settings.pbt["perturb"])
    segments = pbt_runner.live(trials)
    members = sorted({m for m, _ in segments})
    best = winner(trials, settings.mode)
    best_member = _lineage(best)["member"] if best is not None else None
    fig, axes = plt.subplots(1, len(keys) + 1, figsize=(5.2 * (len(keys) + 1), 4.2), squeeze=False)
    for ax, key in zip(axes[0], [*keys, settings.metric]):
        for member in members:
            # What the member's weights trained with: its lineage, through the members it copied.
            own = chain(trials, segments[max((m, k) for m, k in segments if m == member)])
            width = 2.5 if member == best_member else 1.0
            if key == settings.metric:
                points = [(_lineage(t)["stop"], t.value) for t in own if t.value is not None]
                ax.plot([s for s, _ in points], [v for _, v in points], "o-", linewidth=width, label=f"m{member}")
            else:
                xs = [s for t in own for s in (_lineage(t)["start"], _lineage(t)["stop"])]
                ys = [_lineage(t)["values"].get(key) for t in own for _ in range(2)]
                ax.plot(xs, ys, linewidth=width, label=f"m{member}")
        if key != settings.metric and all(v > 0 for t in segments.values()
                                          if isinstance(v := _lineage(t)["values"].get(key), (int, float))):
            ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title(key)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    with jsonl.atomic_open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
