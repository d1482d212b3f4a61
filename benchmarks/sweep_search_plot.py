"""The figure of benchmarks/sweep_search.py: OUT/sweep_search.png from its summaries (docs/sweep_search.png)."""

from __future__ import annotations

import os
import statistics

LABELS = {"none": "TPE, no pruner", "asha": "TPE + ASHA, rungs 25/75/225", "asha100": "TPE + ASHA, rungs 100/300",
          "median": "TPE + median, from step 100"}


def best_so_far(rows: list[dict]) -> list[float]:
    """The best complete value after each trial (-inf before the first)."""
    best, curve = float("-inf"), []
    for row in rows:
        if row["state"] == "COMPLETE" and row["value"] is not None:
            best = max(best, row["value"])
        curve.append(best)
    return curve


def plot(out: str, search_results: dict, prune_results: dict, pruners: list[str]) -> None:
    """OUT/sweep_search.png: search vs grid (best so far vs trials), pruned vs unpruned (best so far vs steps
    trained), and each pruner's intermediate values on its first seed with the pruned trials marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not (search_results or prune_results):
        return
    columns = max(2, len(pruners)) if prune_results else 1
    rows = 2 if prune_results else 1
    fig, grid = plt.subplots(rows, columns, figsize=(5.5 * columns, 4.5 * rows), squeeze=False)
    top = list(grid[0])  # search vs grid, then pruned vs not; below: each pruner's intermediate values
    used = (1 if search_results else 0) + (2 if prune_results and columns >= 2 + bool(search_results) else
                                           1 if prune_results else 0)
    axes = top[:used] + (list(grid[1]) if rows == 2 else [])
    for ax in top[used:]:
        ax.axis("off")
    if search_results:
        ax, summary = axes.pop(0), search_results["summary"]
        n_seeds = len(summary["tpe_none"]["best"])
        for kind, label in (("grid", "grid 3x3"), ("tpe_none", f"TPE (mean of {n_seeds} seeds)")):
            curve = summary[kind]["curve_mean"]
            ax.plot(range(1, len(curve) + 1), curve, "o-", label=label)
        ax.set_xlabel("trials")
        ax.set_ylabel("best eval/accuracy so far")
        ax.set_title("Search vs grid, same budget (200-step trials)")
        ax.grid(alpha=0.3)
        ax.legend()
    if prune_results:
        summary, runs = prune_results["summary"], prune_results["runs"]
        ax = axes.pop(0)
        colors = {"none": "tab:blue", "asha": "tab:red", "asha100": "tab:orange", "median": "tab:green"}
        for pruner in ["none", *pruners]:
            for i, seed in enumerate(summary["seeds"]):
                rows = runs[f"prune_{pruner}_{seed}"]
                spent, total = [], 0
                for row in rows:
                    total += row["steps"]
                    spent.append(total)
                curve = best_so_far(rows)
                start = next((j for j, v in enumerate(curve) if v > float("-inf")), len(curve))
                ax.step(spent[start:], curve[start:], where="post", color=colors.get(pruner), alpha=0.8,
                        label=LABELS.get(pruner, pruner) if i == 0 else None)
        ax.set_xlabel("training steps spent (all trials so far)")
        ax.set_ylabel("best eval/accuracy so far")
        ax.set_ylim(bottom=max(0.9, ax.get_ylim()[0]))
        ax.set_title(f"{summary['trials_per_study']} trials of 500 steps, seeds {summary['seeds']}")
        ax.grid(alpha=0.3)
        ax.legend()
        if used == 2 + bool(search_results):  # a cell to spare: steps and best per pruner, mean of the seeds
            ax, names = axes.pop(0), ["none", *pruners]
            trained = [summary[p]["steps_mean"] for p in names]
            at_decision = [statistics.mean(summary[p]["steps_at_decisions"]) for p in names]
            ax.bar(range(len(names)), trained, color=[colors.get(p) for p in names], alpha=0.8, label="trained")
            ax.bar(range(len(names)), at_decision, fill=False, hatch="//", label="had each stopped at its pruning")
            for i, p in enumerate(names):
                ax.text(i, trained[i], f"{trained[i]:,.0f}\nbest {summary[p]['best_mean']:.4f}\n"
                        f"retrained {summary[p]['best_rerun_mean_over_seeds']:.4f}", ha="center", va="bottom",
                        fontsize=8)
            ax.set_xticks(range(len(names)), [LABELS.get(p, p).replace("TPE + ", "").replace(", ", "\n")
                                              for p in names], fontsize=8)
            ax.set_ylim(0, max(trained) * 1.3)
            ax.set_ylabel("training steps, all trials (mean of seeds)")
            ax.set_title("Steps spent and best eval/accuracy (mean of seeds)")
            ax.legend(loc="upper right", fontsize=8)
        for pruner in pruners:
            ax, seed = axes.pop(0), summary["seeds"][0]
            rows = runs[f"prune_{pruner}_{seed}"]
            for row in rows:
                steps, values = zip(*row["intermediate"]) if row["intermediate"] else ((), ())
                if row["state"] == "PRUNED" and steps:
                    cut = next((i for i, step in enumerate(steps) if step >= (row["decided"] or steps[-1])), -1)
                    line, = ax.plot(steps[:cut + 1], values[:cut + 1], "--", alpha=0.6, linewidth=1)
                    ax.plot(steps[cut:], values[cut:], ":", alpha=0.4, linewidth=1, color=line.get_color())
                    ax.plot(steps[cut], values[cut], "x", color=line.get_color(), markersize=8)
                else:
                    ax.plot(steps, values, "-", linewidth=1.5)
            n_pruned = sum(r["state"] == "PRUNED" for r in rows)
            ax.set_xlabel("step")
            ax.set_ylabel("eval/accuracy (intermediate values)")
            ax.set_ylim(0.0, 1.0)
            ax.set_title(f"{LABELS.get(pruner, pruner)}, seed {seed}: {n_pruned}/{len(rows)} pruned\n"
                         f"(x: pruned; dotted: trained while the stop reached the run)", fontsize=10)
            ax.grid(alpha=0.3)
    for ax in axes:  # cells left over
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "sweep_search.png"), dpi=80)
