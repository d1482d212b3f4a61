"""The Optuna study behind a sweep: storage, sampler, pruner, creating it once, its budget and its retries.

A study's settings (metric, mode, budget, sampler, pruner, config) are stored
in it as user attributes when it is created, so every agent, on any machine,
runs the same sweep from `--study` and `--storage` alone. Each trial stores
its overrides, directory name and reproduce command as user attributes.

Default storage: SQLite in the sweep directory (`sqlite:///DIR/study.db`):
nothing to install or start, transactional (a killed sweep leaves it whole),
read directly by `optuna-dashboard`, and an RDB storage, so Optuna's heartbeat
(a dead agent's trial is failed and retried) works exactly as on PostgreSQL.
(Optuna's journal file has no heartbeat.) Many machines: `--storage=postgresql://...`.

Every use of Optuna's private attributes (the study's storage, a trial's storage id, heartbeats, the trials as
stored now, the Pareto front) is optuna_private.py's; its names are importable from here too.
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from collections.abc import Sequence
from typing import Any

import optuna
from absl import logging
from optuna.trial import FrozenTrial, TrialState

from mwloop.sweep import outage
from mwloop.sweep.optuna_private import all_trials as all_trials
from mwloop.sweep.optuna_private import fail_running as fail_running
from mwloop.sweep.optuna_private import heartbeat_s as heartbeat_s
from mwloop.sweep.optuna_private import pareto_front as pareto_front
from mwloop.sweep.optuna_private import record_heartbeat as record_heartbeat
from mwloop.sweep.optuna_private import storage_of as storage_of
from mwloop.sweep.optuna_private import stored_trial as stored_trial
from mwloop.sweep.optuna_private import trial_id as trial_id
from mwloop.sweep.space import Choices, SweepFile, check_settings, grid_space, to_json
from mwloop.sweep.values import SweepError, redact

DB_FILE = "study.db"
# The prefix of every attribute mwloop stores in a study or a trial.
ATTR = "mwloop:"
# A trial asked after the budget was met by another agent: never run.
SURPLUS = ATTR + "surplus"
INTERRUPTED = ATTR + "interrupted"
POSTGRES_CONNECT_TIMEOUT_S = 10
# How many times a new database is opened while another process creates its tables (_new_rdb_storage).
_CREATE_ATTEMPTS = 5

# Optuna's per-trial INFO lines off: the agent prints its own.
optuna.logging.set_verbosity(optuna.logging.WARNING)
# fail_stale_trials and the heartbeat are experimental in Optuna.
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
# Optuna's heartbeat expects Study.optimize; the agent records it itself while a trial runs (agent.follow_trial).
warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")


@dataclasses.dataclass(frozen=True)
class Settings(Choices):
    """How a study is run, stored in the study itself: the sweep file's choices as the study was created with
    them (config, n_trials and prune_by always set), and these.

    Attributes:
      kind: grid | search | pbt.
      sweep: the sweep file spec it was created from.
    """
    kind: str
    sweep: str
    seed: int | None

    @property
    def directions(self) -> list[str]:
        """Optuna's direction of each objective."""
        return ["maximize" if mode == "max" else "minimize" for _, mode in self.all_objectives]


def default_storage(sweep_dir: str) -> str:
    return f"sqlite:///{os.path.abspath(os.path.join(sweep_dir, DB_FILE))}"


def default_study_name(sweep_spec: str) -> str:
    path, _, arg = sweep_spec.partition(":")
    return os.path.basename(path).removesuffix(".py") + (f"-{arg}" if arg else "")


def open_storage(url: str, heartbeat_s: int | None = 60,
                 outage_s: float = outage.OUTAGE_S) -> optuna.storages.BaseStorage:
    """The storage at `url` (sqlite:///, postgresql://, mysql://, or journal:PATH), with Optuna's heartbeat on
    RDB storages; SweepError naming the URL when it does not answer. An RDB storage rides out an outage of up
    to `outage_s` seconds once open (outage.py; 0: it does not)."""
    if url.startswith("journal:"):
        from optuna.storages.journal import JournalFileBackend
        return optuna.storages.JournalStorage(JournalFileBackend(url[len("journal:"):]))
    # pool_pre_ping: a pooled connection the server dropped (a restart) is replaced, not used and failed.
    engine_kwargs = {"connect_args": {"connect_timeout": POSTGRES_CONNECT_TIMEOUT_S},
                     "pool_pre_ping": True} if url.startswith("postgresql") else {}
    url = _with_driver(url)
    kwargs = {"heartbeat_interval": heartbeat_s, "grace_period": 2 * heartbeat_s,
              "heartbeat_stale_trial_callback": retry} if heartbeat_s else {}
    if url.startswith("sqlite"):
        # Agents wait for each other's writes, not fail.
        engine_kwargs = {"connect_args": {"timeout": 60}}
    try:
        storage = _new_rdb_storage(url, engine_kwargs, kwargs)
    except ImportError as e:
        missing = getattr(e.__cause__, "name", None) or e.name or "database driver"
        raise SweepError(f"storage {redact(url)} needs the {missing} package "
                         f"(PostgreSQL's: pip install 'mwloop[sweep]')") from None
    # sqlalchemy's OperationalError / ArgumentError: a bad URL, a server that is down.
    except Exception as e:
        reason = str(getattr(e, "orig", None) or e).strip().splitlines()[0]
        raise SweepError(f"storage {redact(url)} does not answer: {reason}") from None
    if url.startswith("sqlite"):
        _serialize_sqlite(storage.engine)
    return outage.riding(storage, url, outage_s) if outage_s else storage


def _new_rdb_storage(url: str, engine_kwargs: dict, kwargs: dict) -> optuna.storages.RDBStorage:
    """optuna's RDBStorage, opened again (a few times, a moment apart) while another process is creating the same
    new database's tables (a table that "already exists", a schema version inserted twice): two agents starting
    on a fresh database, or a dashboard opening study.db while the sweep creates it, race there."""
    import sqlalchemy.exc
    for attempt in range(_CREATE_ATTEMPTS):
        try:
            return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs, **kwargs)
        except sqlalchemy.exc.DatabaseError as e:
            racing = isinstance(e, sqlalchemy.exc.IntegrityError) or "already exists" in str(e)
            if not racing or attempt == _CREATE_ATTEMPTS - 1:
                raise
            time.sleep(0.2 * (attempt + 1))


def _serialize_sqlite(engine) -> None:
    """Every SQLite transaction takes the write lock when it begins (BEGIN IMMEDIATE; SQLAlchemy's recipe).

    Optuna pops an enqueued trial by reading that it is WAITING and then marking it RUNNING; on PostgreSQL
    the read locks the row (SELECT ... FOR UPDATE), but SQLite ignores that, and two agents popped the same
    grid point (measured here). With the lock taken first, the second agent reads RUNNING and moves on.
    """
    import sqlalchemy

    @sqlalchemy.event.listens_for(engine, "connect")
    def _no_implicit_begin(dbapi_connection, connection_record):
        # pysqlite's own BEGIN would come too late.
        dbapi_connection.isolation_level = None

    @sqlalchemy.event.listens_for(engine, "begin")
    def _begin_immediate(connection):
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    # Connections opened before the listeners would begin the old way.
    engine.dispose()


def _with_driver(url: str) -> str:
    """postgresql:// with the driver mwloop installs (psycopg2-binary, the `sweep` extra): SQLAlchemy 2.1 takes
    a bare postgresql:// to mean psycopg 3."""
    if url.startswith("postgresql://"):
        import importlib.util
        if importlib.util.find_spec("psycopg") is None and importlib.util.find_spec("psycopg2") is not None:
            return "postgresql+psycopg2://" + url[len("postgresql://"):]
    return url


def make_sampler(settings: Settings, sweep: SweepFile | None, seed_offset: int = 0) -> optuna.samplers.BaseSampler:
    """The study's sampler; each agent gets its own seed (seed + agent index), or its random draws would repeat."""
    seed = None if settings.seed is None else settings.seed + seed_offset
    options = dict(settings.sampler_options)
    # A grid's trials (and PBT's segments) are all enqueued; a sampler only ever sees surplus asks.
    if settings.kind in ("grid", "pbt"):
        return optuna.samplers.RandomSampler(seed=seed)
    if settings.sampler == "tpe":
        # Optuna's default of 10 random start-up trials is a whole small budget: a third of it, 3 to 10.
        options.setdefault("n_startup_trials", max(3, min(10, settings.n_trials // 3)))
        # Parallel agents: running trials count as bad, not unseen.
        options.setdefault("constant_liar", True)
        return optuna.samplers.TPESampler(seed=seed, **options)
    if settings.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed, **options)
    if settings.sampler == "cmaes":
        return optuna.samplers.CmaEsSampler(seed=seed, **options)
    if settings.sampler == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed, **options)
    if sweep is None:
        raise SweepError("the grid sampler needs the sweep file (--sweep)")
    return _GridSampler(grid_space(sweep), seed=seed)


class _GridSampler(optuna.samplers.GridSampler):
    """Optuna's grid sampler without its `study.stop()` after the last point: that works only inside
    Study.optimize (ask/tell raises RuntimeError there); the agents stop on the budget instead."""

    def after_trial(self, study, trial, state, values) -> None:
        pass


def make_pruner(settings: Settings) -> optuna.pruners.BasePruner:
    """The study's pruner from PRUNER and PRUNER_OPTIONS (Optuna's own, with the defaults below)."""
    options = dict(settings.pruner_options)
    if settings.pruner == "median":
        options.setdefault("n_startup_trials", 3)  # Optuna's 5 is half a small budget
        return optuna.pruners.MedianPruner(**options)
    if settings.pruner in ("asha", "successive_halving"):
        if "min_resource" not in options:
            return FirstEvalHalvingPruner(**options)
        return optuna.pruners.SuccessiveHalvingPruner(**options)
    if settings.pruner == "hyperband":
        return optuna.pruners.HyperbandPruner(**options)
    return optuna.pruners.NopPruner()


class FirstEvalHalvingPruner(optuna.pruners.BasePruner):
    """ASHA (Optuna's SuccessiveHalvingPruner) whose first rung is the first step trials report at: their first
    eval, the least training that can be judged. Rungs follow at that step x reduction_factor^k.

    The default when PRUNER_OPTIONS sets no min_resource. Optuna's own default ("auto") takes a hundredth of the
    first complete trial's steps: nothing is pruned before a trial completes, and then the first eval (a trial
    of 500 steps evaluated every 25: min_resource 5, rungs at steps 5 and 20) decides two or more rungs at once
    on one value, keeping only the top 1/reduction_factor^2 of trials past their first eval.
    `"min_resource": "auto"` in PRUNER_OPTIONS still gets Optuna's. Each agent takes the first step of the first
    trial it judges: set min_resource when trials report first at different steps (PRUNE_BY = "examples" with
    the batch size swept), so that every agent's rungs agree.
    """

    def __init__(self, **options: Any):
        # Bad options fail now, before any trial.
        optuna.pruners.SuccessiveHalvingPruner(min_resource=1, **options)
        self._options = options
        self._pruner: optuna.pruners.SuccessiveHalvingPruner | None = None

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        if self._pruner is None:
            if not trial.intermediate_values:
                return False
            self._pruner = optuna.pruners.SuccessiveHalvingPruner(
                min_resource=max(1, min(trial.intermediate_values)), **self._options)
        return self._pruner.prune(study, trial)


def _check_sampler(settings: Settings, sweep: SweepFile) -> None:
    try:
        make_sampler(settings, sweep)
        make_pruner(settings)
    except SweepError:
        raise
    except ImportError as e:
        raise SweepError(f"sampler {settings.sampler!r} needs the {e.name} package: pip install {e.name}") from None
    except (TypeError, ValueError) as e:
        raise SweepError(f"SAMPLER_OPTIONS / PRUNER_OPTIONS: {e}") from None


def objectives_text(objectives: Sequence[tuple[str, str]]) -> str:
    """"eval/accuracy (max), cost/params (min)": objectives in messages."""
    return ", ".join(f"{metric} ({mode})" for metric, mode in objectives)


def settings_attrs(settings: Settings) -> dict[str, Any]:
    return {ATTR + key: value for key, value in dataclasses.asdict(settings).items()}


def stored_settings(study: optuna.Study) -> Settings:
    attrs = study.user_attrs
    fields = dataclasses.fields(Settings)
    missing = [f.name for f in fields if ATTR + f.name not in attrs and f.default is dataclasses.MISSING]
    if missing:
        raise SweepError(f"study {study.study_name!r} was not created by mwloop.sweep (no {ATTR}{missing[0]}); "
                         f"use another --study")
    stored = {f.name: attrs[ATTR + f.name] for f in fields if ATTR + f.name in attrs}
    # JSON keeps tuples as lists.
    stored["objectives"] = tuple(tuple(pair) for pair in stored.get("objectives", ()))
    stored["constraints"] = tuple(stored.get("constraints", ()))
    return Settings(**stored)


def create(storage: optuna.storages.BaseStorage, name: str, settings: Settings, sweep: SweepFile) -> optuna.Study:
    """Creates the study (and the schema) or checks the existing one against `settings`; enqueues a grid's
    points that have no trial yet, and a retry of every failed trial. Run once before agents start: two
    processes creating one study on a fresh PostgreSQL at once fail with a UniqueViolation."""
    check_settings(metric=settings.metric, mode=settings.mode, sampler=settings.sampler, pruner=settings.pruner,
                   n_trials=settings.n_trials, prune_by=settings.prune_by, objectives=settings.objectives)
    _check_sampler(settings, sweep)
    study = optuna.create_study(storage=storage, study_name=name, directions=settings.directions, load_if_exists=True)
    attrs = study.user_attrs
    directions = [d.name.lower() for d in study.directions]
    if ATTR + "metric" in attrs:
        old = stored_settings(study).all_objectives
        if old != settings.all_objectives or directions != settings.directions:
            raise SweepError(f"study {name!r} exists and ranks by {objectives_text(old)}; this sweep ranks by "
                             f"{objectives_text(settings.all_objectives)}: use another --study, or the same "
                             f"--metric/--mode (OBJECTIVES)")
        if attrs[ATTR + "kind"] != settings.kind:
            raise SweepError(f"study {name!r} exists and is a {attrs[ATTR + 'kind']}; this sweep is a "
                             f"{settings.kind}: use another --study")
        if settings.kind == "pbt" and (to_json(attrs.get(ATTR + "pbt")) != to_json(settings.pbt)
                                       or attrs[ATTR + "n_trials"] != settings.n_trials):
            # Its segments and lineage were planned with the stored one.
            raise SweepError(f"study {name!r} exists with another PBT plan ({attrs[ATTR + 'n_trials']} segments, "
                             f"{to_json(attrs.get(ATTR + 'pbt'))}): use another --study, or the sweep file it was "
                             f"created from")
    elif directions != settings.directions:
        raise SweepError(f"study {name!r} exists with directions {directions}: use another --study")
    for key, value in settings_attrs(settings).items():
        if key not in attrs or attrs[key] != value:
            study.set_user_attr(key, value)
    trials = all_trials(study)
    for trial in trials:
        if needs_retry(trial, trials):
            logging.info("trial %d %s: retrying it", trial.number,
                         "was interrupted" if trial.user_attrs.get(INTERRUPTED) else "failed")
            retry(study, trial)
    if sweep.points is not None:
        _enqueue_grid(study, sweep.points, all_trials(study))
    return study


def _enqueue_grid(study: optuna.Study, points: Sequence[dict], trials: Sequence[FrozenTrial]) -> None:
    have = {t.user_attrs.get(ATTR + "point") for t in trials if not t.user_attrs.get(SURPLUS)}
    for point in points:
        key = to_json(point)
        if key not in have:
            study.enqueue_trial({}, user_attrs={ATTR + "point": key})


def retry(study: optuna.Study, trial: FrozenTrial) -> None:
    """Enqueues `trial` again with its parameters and attributes (Optuna's RetryHeartbeatStaleTrialCallback):
    the retry runs in the same directory and resumes from its checkpoint. Also the heartbeat's callback for a trial
    whose agent died."""
    optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=None)(study, trial)


def retried(trials: Sequence[FrozenTrial]) -> set[int]:
    """Numbers of the trials that a later trial retries (the retry callback's retry_history)."""
    return {n for t in trials for n in t.system_attrs.get("retry_history", ())}


def needs_retry(trial: FrozenTrial, trials: Sequence[FrozenTrial]) -> bool:
    return (trial.state == TrialState.FAIL and not trial.user_attrs.get(SURPLUS)
            and trial.number not in retried(trials))


def counted(trials: Sequence[FrozenTrial]) -> list[FrozenTrial]:
    """The trials that use up the budget: complete, pruned, running, and failed ones not retried."""
    again = retried(trials)
    return [t for t in trials
            if t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
            or (t.state == TrialState.FAIL and not t.user_attrs.get(SURPLUS) and t.number not in again)]


def shown(trials: Sequence[FrozenTrial]) -> list[FrozenTrial]:
    """The trials results show: one per run (a retried trial is shown as its retry), no surplus asks."""
    again = retried(trials)
    return [t for t in trials if t.number not in again and not t.user_attrs.get(SURPLUS)]


def load(storage: optuna.storages.BaseStorage, name: str, *, storage_url: str, sweep: SweepFile | None = None,
         seed_offset: int = 0) -> tuple[optuna.Study, Settings]:
    """An existing study with its settings, its sampler (seeded for this agent) and its pruner."""
    try:
        study = optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        # A misspelt or defaulted name: say which ones there are.
        names = optuna.get_all_study_names(storage)
        held = f"it holds {', '.join(map(repr, sorted(names)))}" if names else "it holds no study"
        raise SweepError(f"no study {name!r} in {redact(storage_url)} ({held}): pass one with --study, or create "
                         f"it first (python -m mwloop.sweep create --sweep=... --workdir=... --study={name} "
                         f"--storage=...)") from None
    settings = stored_settings(study)
    study = optuna.load_study(study_name=name, storage=storage, sampler=make_sampler(settings, sweep, seed_offset),
                              pruner=make_pruner(settings))
    return study, settings
