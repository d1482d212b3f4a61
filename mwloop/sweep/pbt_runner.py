"""Population-based training on the study (docs/pbt.md): each segment of a member is one enqueued Optuna trial.

Segment (m, k), member m's steps [k*I, (k+1)*I), is enqueued with `mwloop:point` = "pbt/m<m>/k<k>" and its
lineage in `mwloop:pbt` (its values, its parent segment, whether it copied another member). It runs like any
trial (`agent.run_trial`) in DIR/m<m>/k<k>, warm-starting the whole training state from its parent's checkpoint
(`config.init_checkpoint_state="all"`) and stopping at (k+1)*I (`config.train.stop_at_step`). Interval k+1 is
enqueued once every segment of k is finished, by whichever agent sees it first; the plan is `pbt.decide`, a pure
function of the stored scores, and a point already held by a trial is never enqueued again, so an interval is
decided once however many runners (or reruns) see it. A duplicate enqueued in a race is failed as surplus.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Sequence
from typing import Any

import optuna
from absl import logging
from optuna.trial import FrozenTrial, TrialState

from mwloop.sweep import pbt, space
from mwloop.sweep import study as studies
from mwloop.sweep.values import Overrides, SweepError

PREFIX = "pbt/"
# A segment's lineage, a user attribute: member, interval, parent [member, interval] or None, exploit, values,
# start and stop steps, last (the member's final segment).
LINEAGE = studies.ATTR + "pbt"
# How often an agent with no segment to run looks again.
POLL_S = 0.5


def point(member: int, interval: int) -> str:
    return f"{PREFIX}m{member}/k{interval}"


def is_segment(key: str | None) -> bool:
    return bool(key) and key.startswith(PREFIX)


def directory(member: int, interval: int) -> str:
    """A segment's directory under the sweep's."""
    return os.path.join(f"m{member}", f"k{interval}")


def check_sweep(sweep: space.SweepFile, samples: Sequence[Overrides], steps: int, n_trials: int | None,
                pruner: str) -> int:
    """Checks a PBT sweep at start (its keys, the probed population values, the budget); returns its budget:
    POPULATION x intervals segments. `steps`: the config's train.steps (search_space may set another, the same
    for every member)."""
    spec = pbt.Spec.from_dict(sweep.pbt)
    if sweep.multi:
        raise SweepError("ALGORITHM = 'pbt' ranks members by one METRIC, not several OBJECTIVES")
    if pruner != "none":
        raise SweepError(f"PRUNER {pruner!r} with ALGORITHM = 'pbt': PBT replaces the worst members itself; "
                         f"leave PRUNER out")
    for overrides in samples:
        missing = [key for key in spec.perturb if key not in overrides]
        if missing:
            raise SweepError(f"PERTURB {missing[0]!r} is not drawn by search_space(trial); suggest it there (the "
                             f"population's first values)")
    lengths = {overrides.get("train.steps", steps) for overrides in samples}
    if len(lengths) > 1:
        raise SweepError(f"search_space gives train.steps {sorted(lengths)}: every member of a population trains "
                         f"as long; set one value")
    budget = spec.population * spec.intervals(lengths.pop())
    if n_trials not in (None, budget):
        raise SweepError(f"--n_trials={n_trials} but PBT runs POPULATION x intervals = {budget} segments; leave "
                         f"--n_trials out")
    return budget


def draw(sweep: space.SweepFile, seed: int) -> Overrides:
    """One draw from the search space with a seeded random sampler, in memory (nothing stored)."""
    trial = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed)).ask()
    return space.search_overrides(sweep, trial)


def live(trials: Sequence[FrozenTrial]) -> dict[tuple[int, int], FrozenTrial]:
    """(member, interval) -> the trial that is that segment: a retry stands for the trial it retries, and of
    two that hold one point (a race), the first."""
    found: dict[tuple[int, int], FrozenTrial] = {}
    for trial in sorted(studies.shown(trials), key=lambda t: t.number):
        lineage = trial.user_attrs.get(LINEAGE)
        if lineage:
            found.setdefault((lineage["member"], lineage["interval"]), trial)
    return found


@dataclasses.dataclass
class Segments:
    """One agent's view of a PBT study: it enqueues the segments due and says whether one waits to run."""
    sweep: space.SweepFile
    settings: studies.Settings

    def __post_init__(self):
        self.spec = pbt.Spec.from_dict(self.settings.pbt)
        self.intervals = self.settings.n_trials // self.spec.population

    def advance(self, study: optuna.Study, trials: Sequence[FrozenTrial] | None = None) -> int:
        """Enqueues the segments whose turn has come and that no trial holds yet; returns how many."""
        trials = studies.all_trials(study) if trials is None else trials
        segments = live(trials)
        members = range(self.spec.population)
        for k in range(self.intervals):
            missing = [m for m in members if (m, k) not in segments]
            if not missing:
                continue
            if k == 0:
                plan = {m: (None, False, draw(self.sweep, self._seed(0, m))) for m in missing}
            else:
                plan = self._decide(k - 1, segments, missing)
            for m, (parent, exploit, values) in plan.items():
                self._enqueue(study, m, k, parent, exploit, values)
            if plan:
                drop_waiting_duplicates(study)
            return len(plan)
        return 0

    def _decide(self, k: int, segments: dict, missing: list[int]) -> dict[int, tuple]:
        """The plan of interval k + 1 once every segment of k is finished ({} before): member -> (parent
        member, exploit, values)."""
        ended = [segments[(m, k)] for m in range(self.spec.population)]
        if not all(t.state in (TrialState.COMPLETE, TrialState.FAIL) for t in ended):
            return {}
        scores = {m: t.value for m, t in enumerate(ended) if t.state == TrialState.COMPLETE}
        if not scores:
            return {}
        parents = pbt.decide(scores, mode=self.settings.mode, quantile=self.spec.quantile,
                             seed=pbt.seed_for(self.settings.seed, k))
        best = (max if self.settings.mode == "max" else min)(sorted(scores), key=scores.get)
        plan = {}
        for m in missing:
            # A failed segment left no checkpoint to continue from: its member copies the best one.
            parent = parents.get(m, best)
            values = segments[(parent, k)].user_attrs[LINEAGE]["values"]
            if parent != m:
                seed = self._seed(k + 1, m)
                values = pbt.perturb(values, self.spec.perturb, seed, lambda: draw(self.sweep, seed))
            plan[m] = (parent, parent != m, values)
        return plan

    def _seed(self, interval: int, member: int) -> int:
        return pbt.seed_for(self.settings.seed, interval) * 1009 + member

    def _enqueue(self, study: optuna.Study, member: int, interval: int, parent: int | None, exploit: bool,
                 values: Overrides) -> None:
        steps = self.spec.interval_steps
        lineage = {"member": member, "interval": interval, "parent": None if parent is None else [parent, interval - 1],
                   "exploit": exploit, "values": dict(values), "start": interval * steps,
                   "stop": (interval + 1) * steps, "last": interval == self.intervals - 1}
        study.enqueue_trial({}, user_attrs={studies.ATTR + "point": point(member, interval), LINEAGE: lineage})
        logging.info("PBT: segment m%d/k%d enqueued (%s) with %s", member, interval,
                     "initial" if parent is None else f"copies m{parent}" if exploit else "continues",
                     space.to_json(values))

    def ready(self, study: optuna.Study, trials: Sequence[FrozenTrial]) -> bool:
        """Enqueues what is due; whether a segment now waits to be asked."""
        if self.advance(study, trials):
            return True
        return any(t.state == TrialState.WAITING for t in trials)

    def wait(self, study: optuna.Study, stop: threading.Event) -> bool:
        """Waits a moment for running segments to end; False when none runs (nothing can become due)."""
        running = studies.all_trials(study, states=(TrialState.RUNNING,))
        # The last running segment may have ended since this agent looked (another agent told it and has not yet
        # enqueued the next interval): look again before giving up, or this agent would leave a live study.
        if not running and not self.ready(study, studies.all_trials(study)):
            logging.warning("PBT: no segment is running or waiting and the budget is not met (a whole interval "
                            "failed?); see results.md")
            return False
        stop.wait(POLL_S)
        return True


def overrides(trial: optuna.Trial | FrozenTrial, sweep_dir: str) -> tuple[Overrides, str]:
    """(overrides, directory name) of a segment's trial: its values, its stop step and its parent's checkpoint."""
    lineage = trial.user_attrs[LINEAGE]
    result = dict(lineage["values"])
    result.update(segment_flags(lineage, os.path.abspath(sweep_dir)))
    return result, directory(lineage["member"], lineage["interval"])


def segment_flags(lineage: dict[str, Any], sweep_dir: str) -> Overrides:
    """What makes a run a segment: where it stops, and the checkpoint its whole state starts from. Only a
    member's last segment exports (as the config says)."""
    flags: Overrides = {"train.stop_at_step": lineage["stop"]}
    if not lineage["last"]:
        flags["export"] = False
    if lineage["parent"] is not None:
        parent = os.path.join(sweep_dir, directory(*lineage["parent"]), "checkpoints", f"ckpt-{lineage['start']}")
        flags.update({"init_checkpoint": parent, "init_checkpoint_state": "all"})
    return flags


def drop_waiting_duplicates(study: optuna.Study) -> int:
    """Drops the waiting trials that hold a segment an earlier trial holds (another runner enqueued it in the
    same moment); returns how many. Of two runners that raced, the later one to enqueue always sees the earlier
    trial, so no duplicate is left waiting once the budget is met (it would be shown as a segment never run)."""
    storage, dropped = studies.storage_of(study), 0
    held: set[str] = set()
    for trial in sorted(studies.shown(studies.all_trials(study)), key=lambda t: t.number):
        key = trial.user_attrs.get(studies.ATTR + "point")
        if not is_segment(key):
            continue
        if key not in held:
            held.add(key)
            continue
        if trial.state != TrialState.WAITING:
            continue  # asked already: its agent drops it (discard_duplicate)
        try:
            # Marked first: were this runner to die here, the mark keeps it out of results and the budget.
            storage.set_trial_user_attr(studies.trial_id(trial), studies.SURPLUS, True)
            # Claimed as an ask claims it (only one can move it out of WAITING): if an agent asked for it first,
            # that agent drops it.
            if not storage.set_trial_state_values(studies.trial_id(trial), TrialState.RUNNING):
                continue
            storage.set_trial_state_values(studies.trial_id(trial), TrialState.FAIL)
        except optuna.exceptions.UpdateFinishedTrialError:
            continue  # the other runner of the race dropped it since this one looked
        dropped += 1
        logging.info("PBT: trial %d repeats segment %s: dropped before it ran", trial.number, key)
    return dropped


def discard_duplicate(study: optuna.Study, trial: optuna.Trial) -> bool:
    """Whether `trial` holds a segment that an earlier trial holds too (two runners enqueued it in a race): then
    it is failed as surplus, never run, and not enqueued again."""
    key = trial.user_attrs.get(studies.ATTR + "point")
    if not is_segment(key):
        return False
    earlier = [t for t in studies.shown(studies.all_trials(study))
               if t.number < trial.number and t.user_attrs.get(studies.ATTR + "point") == key]
    if not earlier:
        return False
    trial.set_user_attr(studies.SURPLUS, True)
    study.tell(trial, state=TrialState.FAIL)
    logging.info("PBT: trial %d repeats segment %s of trial %d: dropped", trial.number, key, earlier[0].number)
    return True
