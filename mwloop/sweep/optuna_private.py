"""Optuna's private attributes, every use of them in one module, so that an Optuna upgrade that moves one breaks
here and nowhere else.

Checked against Optuna 5.0. The agents drive trials with ask/tell, and that API leaves out what they need:
a study's storage (Study has no public accessor), a trial's storage id (Trial and FrozenTrial show only their
number, and the storage's methods take the id), a running trial's system attributes (Optuna 5 removed
Trial.system_attrs), heartbeats (recorded only by Study.optimize's own thread), and the trials as stored
now (all_trials), also for the Pareto front (pareto_front). study.py re-exports every name.
"""

from __future__ import annotations

from collections.abc import Sequence

import optuna
from optuna.trial import FrozenTrial, TrialState


def storage_of(study: optuna.Study) -> optuna.storages.BaseStorage:
    """The storage `study` reads and writes (for an RDB storage, the cache Optuna wraps it in)."""
    return study._storage


def trial_id(trial: optuna.Trial | FrozenTrial) -> int:
    """The trial's id in its storage, which the storage's methods take (a trial shows only its number)."""
    return trial._trial_id


def stored_trial(study: optuna.Study, trial: optuna.Trial | FrozenTrial) -> FrozenTrial:
    """`trial` as the storage holds it now, with its system attributes (the retry history)."""
    return storage_of(study).get_trial(trial._trial_id)


def heartbeat_s(study: optuna.Study) -> int | None:
    """Seconds between the heartbeats of the study's storage; None when it keeps none."""
    storage = storage_of(study)
    return storage.get_heartbeat_interval() if hasattr(storage, "get_heartbeat_interval") else None


def record_heartbeat(study: optuna.Study, trial: optuna.Trial) -> None:
    """One heartbeat of a running trial: what Study.optimize's heartbeat thread records."""
    storage_of(study).record_heartbeat(trial._trial_id)


def fail_running(study: optuna.Study, trial: FrozenTrial) -> None:
    """Marks a RUNNING trial FAIL in the storage, as Optuna's heartbeat does a stale one (`fail_stale_trials`,
    the public call, waits out the grace period; `study.tell` would also run the sampler's `after_trial`)."""
    storage_of(study).set_trial_state_values(trial._trial_id, state=TrialState.FAIL)


def all_trials(study: optuna.Study, states: Sequence[TrialState] | None = None) -> list[FrozenTrial]:
    """Every trial of the study as the storage holds it now.

    Not `study.get_trials()`: Optuna's cache keeps a trial this process created (an enqueued retry, an asked
    trial) without ever reading it again once a later trial has finished, so another agent's updates to it
    were missed (a trial shown running after it had failed, measured here).
    """
    # Under the cache: read it all again.
    storage = getattr(storage_of(study), "_backend", storage_of(study))
    return storage.get_all_trials(study._study_id, deepcopy=False, states=states)


def pareto_front(trials: Sequence[FrozenTrial], directions: Sequence[str]) -> list[FrozenTrial]:
    """`study.best_trials` of `trials` as stored now (`all_trials`; `best_trials` reads Optuna's cache): the
    complete, feasible trials that no other dominates."""
    from optuna.study import StudyDirection
    from optuna.study._multi_objective import _get_pareto_front_trials_by_trials

    return _get_pareto_front_trials_by_trials(trials, [StudyDirection[d.upper()] for d in directions],
                                              consider_constraint=True)
