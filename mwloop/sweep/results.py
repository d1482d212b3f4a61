"""A study's trials as results: one row per run, read from the study and each trial's metrics.jsonl, written
as results.csv/md (report.py), results.png (plots.py) and TensorBoard HParams (hparams.py).

`Results` keeps the events of finished trials in memory, so rewriting the
tables after every trial reads only the files of trials that changed.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

from absl import logging
from optuna.trial import FrozenTrial, TrialState

from mwloop.sweep import hparams, objectives, pbt_report, pbt_runner, plan, plots, report, space
from mwloop.sweep import study as studies

_STATUS = {TrialState.COMPLETE: "complete", TrialState.PRUNED: "pruned", TrialState.FAIL: "failed",
           TrialState.RUNNING: "running", TrialState.WAITING: "waiting"}


def status(trial: FrozenTrial) -> str:
    """A trial's status in results: Optuna's state, except that the retry of a trial stopped with a save
    (Ctrl-C, SIGTERM) is "interrupted" until an agent takes it (a retry copies the trial's attributes)."""
    if trial.state == TrialState.WAITING and trial.user_attrs.get(studies.INTERRUPTED):
        return "interrupted"
    return _STATUS.get(trial.state, "failed")


def became_complete(result: report.PointResult, trial: FrozenTrial, metric: str) -> bool:
    """Whether a pruned trial was later run to its end by hand (its reproduce command resumes its kept
    checkpoint in the same directory): its metrics.jsonl then has the ranking metric at the trial's last step."""
    steps, pruned_at = trial.user_attrs.get(studies.ATTR + "steps"), trial.user_attrs.get(studies.ATTR + "pruned_at")
    if result.status != "pruned" or steps is None or pruned_at is None or pruned_at >= steps:
        return False
    return any(step >= steps for step, _ in result.curve(metric))


def trial_result(trial: FrozenTrial, sweep_dir: str) -> report.PointResult:
    """One trial as a result row (its events not read yet)."""
    attrs = trial.user_attrs
    # A PBT segment not yet started: its point is a name, its values in its lineage.
    lineage = attrs.get(pbt_runner.LINEAGE)
    values = space.from_json(attrs.get(studies.ATTR + "values") or attrs.get(studies.ATTR + "overrides")
                             or (space.to_json(lineage["values"]) if lineage else None)
                             or attrs.get(studies.ATTR + "point") or "{}")
    name = attrs.get(studies.ATTR + "name") or (pbt_runner.directory(lineage["member"], lineage["interval"])
                                                if lineage else f"trial-{trial.number}")
    wall = attrs.get(studies.ATTR + "wall_s")
    if wall is None and trial.datetime_start and trial.datetime_complete:
        wall = (trial.datetime_complete - trial.datetime_start).total_seconds()
    return report.PointResult(name, os.path.join(sweep_dir, name), values, status(trial),
                              wall, attrs.get(studies.ATTR + "error", ""), number=trial.number,
                              command=attrs.get(studies.ATTR + "command", ""))


def write_all(sweep_dir: str, results: list[report.PointResult], *, keys: list[str], all_keys: list[str],
              labels: dict[str, str], metric: str, mode: str, title: str, final: bool, search: bool = False,
              several: Sequence[tuple[str, str]] = (), constraints: Sequence[str] = ()) -> None:
    """results.csv and results.md; with `final`, also results.png and the HParams summaries.

    `keys` tell the trials apart (table, plot); `all_keys` are every key the sweep sets (csv, HParams);
    `several`: the objectives of a multi-objective sweep (their Pareto front shown), else ().
    """
    results = report.ranked(results, metric, mode)
    report.write_csv(os.path.join(sweep_dir, "results.csv"), results, all_keys)
    report.write_markdown(os.path.join(sweep_dir, "results.md"), results, keys, labels, metric=metric, mode=mode,
                          title=title, numbers=search, objectives=list(several), constraints=list(constraints))
    if not final:
        return
    try:
        plots.write_plot(os.path.join(sweep_dir, "results.png"), results, keys, labels, metric=metric, mode=mode,
                         search=search, objectives=list(several))
    except ImportError:
        logging.warning("matplotlib is not installed (pip install mwloop[sweep]): no results.png")
    hparams.write_hparams(sweep_dir, results, all_keys)


class Results:
    """Writes results.csv/md (after each trial event) and results.png + HParams (at the end) for one study.

    Local agents are threads: `_lock` lets one write at a time. `_events` holds the finished trials' events,
    by trial number.
    """

    def __init__(self, sweep_dir: str, settings: studies.Settings, title: str,
                 grid_points: Sequence[dict] | None = None):
        self.sweep_dir, self.settings, self.title = sweep_dir, settings, title
        self.grid_points = [plan.normalize(p) for p in grid_points] if grid_points else None
        self._events: dict[int, list[dict]] = {}
        self._lock = threading.Lock()

    def collect(self, trials: Sequence[FrozenTrial]) -> list[report.PointResult]:
        results = []
        for trial in studies.shown(trials):
            result = trial_result(trial, self.sweep_dir)
            if trial.number in self._events:
                result.events = self._events[trial.number]
            elif trial.state != TrialState.WAITING:
                result.events = report.read_events(result.workdir)
                # A pruned trial's directory may still grow (its reproduce command run by hand): read it again.
                if trial.state.is_finished() and trial.state != TrialState.PRUNED:
                    self._events[trial.number] = result.events
            if became_complete(result, trial, self.settings.metric):
                result.status = "complete"
            if self.settings.constraints and result.status == "complete":
                result.feasible = objectives.feasible(self.settings.constraints, result.final)
            results.append(result)
        if self.settings.multi:
            front = {t.number for t in studies.pareto_front(trials, self.settings.directions)}
            for result in results:
                result.pareto = result.number in front
        return results

    def keys(self, results: Sequence[report.PointResult]) -> tuple[list[str], list[str]]:
        """(keys that tell trials apart, every key set): a grid's from its points, as it always named them."""
        if self.grid_points:
            return plan.name_keys(self.grid_points), plan.swept_keys(self.grid_points)
        overrides = [r.values for r in results]
        all_keys = plan.swept_keys(overrides)
        varying = [k for k in all_keys if len({repr(o.get(k)) for o in overrides}) > 1]
        return varying or all_keys, all_keys

    def write(self, trials: Sequence[FrozenTrial], final: bool = False) -> list[report.PointResult]:
        """Writes the result files from `trials`; returns the results, best first."""
        with self._lock:
            results = self.collect(trials)
            keys, all_keys = self.keys(results)
            write_all(self.sweep_dir, results, keys=keys, all_keys=all_keys, labels=plan.short_labels(keys),
                             metric=self.settings.metric, mode=self.settings.mode, title=self.title, final=final,
                             search=self.settings.kind in ("search", "pbt"), several=self.settings.objectives,
                             constraints=self.settings.constraints)
            if self.settings.pbt:
                self._write_pbt(trials, final)
            return report.ranked(results, self.settings.metric, self.settings.mode)

    def _write_pbt(self, trials: Sequence[FrozenTrial], final: bool) -> None:
        """A PBT study's lineage and winner in results.md; at the end its schedules in pbt_schedules.png."""
        pbt_report.append_markdown(os.path.join(self.sweep_dir, "results.md"), trials, self.settings, self.sweep_dir)
        if final:
            try:
                pbt_report.write_plot(os.path.join(self.sweep_dir, pbt_report.PLOT), trials, self.settings)
            except ImportError:
                logging.warning("matplotlib is not installed (pip install mwloop[sweep]): no %s", pbt_report.PLOT)
