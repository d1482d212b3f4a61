"""The agent: asks the study for trials and runs each as a training process until the budget is met.

For each trial it resolves the overrides (a grid point, or `search_space(trial)`),
checks them against the config (`plan.check_point`), starts `mwloop.main` (or
`mwloop.launch`) in the trial's directory, follows its metrics.jsonl and
reports every eval of the ranking metric as an intermediate value (at its step,
or at examples seen), and when the pruner says so stops it the way a run
stops cleanly: SIGTERM, the run saves and exits 42, the trial is PRUNED and its
directory kept. It records a heartbeat while the trial runs, so a trial whose
agent died is failed and retried by the next agent that asks (Optuna's heartbeat).
A trial that shows no progress (log and metrics.jsonl unchanged) for `stall_s`
is named meanwhile, then stopped and failed, so a stuck input never holds the
sweep.
Training processes never see Optuna: the agent talks to them through the
command line and the workdir's files only. The trial's process itself (`TrialRun`, `start_trial`,
`report_new`, `Stall`) is trial_run.py's; its names stay importable from here.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

import ml_collections
import optuna
from absl import logging
from optuna.trial import TrialState

from mwloop import errors
from mwloop.artifacts import files
from mwloop.launcher.warm import WarmServer
from mwloop.sweep import objectives, outage, pbt_runner, plan, runner, space
from mwloop.sweep import study as studies
from mwloop.sweep.space import SweepFile
from mwloop.sweep.trial_run import Stall, TrialRun, metric_values, report_new, reproduce_command, start_trial
from mwloop.sweep.values import SweepError

# How often a running trial's metrics.jsonl is read and its exit noticed.
POLL_S = 0.1
# A stopped trial's time to save its checkpoint before SIGKILL.
STOP_GRACE_S = 120.0
# A trial whose log and metrics.jsonl stay unchanged this long is stopped and failed.
STALL_S = 1800.0
# Agents of one process (local --parallel) check the budget and ask one at a time: two that both saw a trial
# left would both ask, and one ask would be thrown away as surplus (an extra failed trial in the study).
_ASK_LOCK = threading.Lock()


@dataclasses.dataclass
class Agent:
    """What one agent needs besides its study.

    Attributes:
      stop: set it to stop the running trial (it saves) and this agent.
      stall_s: a trial showing no progress this long is stopped and failed (0: no limit).
      timings: per trial, the agent's overhead in ms (asked to started, exited to told).
      _grid_names: a grid point's JSON -> its directory name.
      grid_keys: every key a grid sets.
      warm: the warm-start server its one-process trials are forked from (mwloop.launcher.warm), and the
        launchers of its multi-worker trials fork theirs from; shared by the agents of one process; its process
        starts with the first trial (from the calling thread) unless opened before, and whoever made the agent
        closes it.
      segments: a PBT study's segments (pbt_runner), None otherwise.
    """
    sweep: SweepFile
    settings: studies.Settings
    sweep_dir: str
    config_spec: str
    base_config: ml_collections.ConfigDict
    num_workers: int = 1
    stop: threading.Event = dataclasses.field(default_factory=threading.Event)
    on_event: Callable[[optuna.Study, str], None] = lambda study, line: logging.info("%s", line)
    grace_s: float = STOP_GRACE_S
    stall_s: float = STALL_S
    timings: list[dict[str, float]] = dataclasses.field(default_factory=list)
    _grid_names: dict[str, str] = dataclasses.field(default_factory=dict)
    grid_keys: list[str] = dataclasses.field(default_factory=list)
    warm: WarmServer = dataclasses.field(default_factory=lambda: WarmServer(listen=True))
    segments: pbt_runner.Segments | None = None

    def __post_init__(self):
        if self.settings.pbt:
            self.segments = pbt_runner.Segments(self.sweep, self.settings)
        if self.sweep.points is not None:
            points = [plan.normalize(p) for p in self.sweep.points]
            self._grid_names = dict(zip([space.to_json(p) for p in points], plan.point_names(points)))
            self.grid_keys = plan.swept_keys(points)


# ---------------------------------------------------------------------------- the loop

def run(agent: Agent, study: optuna.Study) -> int:
    """Asks for trials and runs them until the study's budget is met or `agent.stop` is set; returns how many
    trials this agent ran. `agent.warm` stays open (its owner closes it)."""
    ran, waiting = 0, False
    heartbeat = studies.heartbeat_s(study)
    while not agent.stop.is_set():
        with _ASK_LOCK:
            # A dead agent's trial: failed, then retried by the callback.
            if not _just_recovered(study, heartbeat):
                optuna.storages.fail_stale_trials(study)
            trials = studies.all_trials(study)
            full = len(studies.counted(trials)) >= agent.settings.n_trials
            # PBT: ask only for a segment that is due (the next interval waits for this one to end).
            idle = not full and agent.segments is not None and not agent.segments.ready(study, trials)
            if not full and not idle:
                asked = time.perf_counter()
                # RUNNING once this returns: the next agent's count includes it.
                trial = study.ask()
        if idle:
            if not agent.segments.wait(study, agent.stop):
                break
            continue
        if full:
            running = [t.number for t in trials if t.state == TrialState.RUNNING]
            if not running or not heartbeat:
                break
            # Another agent's trial may never end (its agent died): stay until its heartbeat says so.
            if not waiting:
                logging.info("budget met; waiting for running trial(s) %s of other agents (one whose agent stops "
                             "its heartbeat for %ds is retried here)", ", ".join(map(str, running)), 2 * heartbeat)
                waiting = True
            agent.stop.wait(min(heartbeat, 5))
            continue
        waiting = False
        # The lock covers this process only: agents in other processes can still race.
        if _surplus(study, trial, agent.settings.n_trials):
            break
        ran += 1
        run_trial(agent, study, trial, asked)
    return ran


def _just_recovered(study: optuna.Study, heartbeat: int | None) -> bool:
    """Whether the storage was down within the heartbeats' grace (plus an agent's longest wait between
    retries): no agent could record a heartbeat then, so a trial whose heartbeat is old is not yet stale
    (failing it would run it twice)."""
    riding = getattr(studies.storage_of(study), "outage", None)
    return bool(heartbeat and riding is not None and riding.recovered_within(3 * heartbeat + outage.MAX_WAIT_S))


def _surplus(study: optuna.Study, trial: optuna.Trial, n_trials: int) -> bool:
    """Whether `trial` is beyond the budget: two agents that both saw one trial left both asked. The lower
    trial numbers win; the other is failed as surplus (never run, left out of results and the budget)."""
    if pbt_runner.discard_duplicate(study, trial):
        return True
    numbers = [t.number for t in studies.counted(studies.all_trials(study))]
    late = sorted(numbers).index(trial.number) >= n_trials if trial.number in numbers else True
    grid_without_point = (study.user_attrs.get(studies.ATTR + "kind") in ("grid", "pbt")
                          and studies.ATTR + "point" not in trial.user_attrs)
    if not (late or grid_without_point):
        return False
    trial.set_user_attr(studies.SURPLUS, True)
    frozen = study.tell(trial, state=TrialState.FAIL)
    # An enqueued trial (a grid point, a retry) is enqueued again: it is not lost.
    if studies.ATTR + "point" in frozen.user_attrs or frozen.system_attrs.get("retry_history"):
        studies.retry(study, frozen)
    return True


# ---------------------------------------------------------------------------- one trial

def trial_overrides(agent: Agent, trial: optuna.Trial) -> tuple[dict[str, Any], str]:
    """(overrides, directory name) of a trial: a grid point as enqueued, or what search_space suggests."""
    point = trial.user_attrs.get(studies.ATTR + "point")
    if pbt_runner.is_segment(point):
        return pbt_runner.overrides(trial, agent.sweep_dir)
    if point is not None:
        overrides = space.from_json(point)
        name = agent._grid_names.get(point) or plan.search_name(overrides, list(overrides))
        return overrides, name
    overrides = space.search_overrides(agent.sweep, trial)
    return overrides, plan.search_name(overrides, [k for k in trial.params if not k.startswith("_")])


def run_trial(agent: Agent, study: optuna.Study, trial: optuna.Trial, asked: float) -> TrialState:
    """Runs one asked trial to its end and tells the study how it ended: prepare, start, follow, tell."""
    run = prepare_trial(agent, study, trial)
    if run is None:
        return TrialState.FAIL
    # A retried trial's earlier evals: the pruner may stop it before it starts again.
    report_new(run)
    timing = {"asked_to_started_ms": 0.0, "exited_to_told_ms": 0.0}
    stall = None
    if run.pruned_at is not None:
        returncode, wall_s, exited = errors.PREEMPTED, 0.0, time.perf_counter()
    else:
        process, start = start_trial(study, run, agent.warm)
        timing["asked_to_started_ms"] = (time.perf_counter() - asked) * 1e3
        stall = Stall(run.workdir)
        try:
            returncode = follow_trial(agent, study, run, process, stall)
        except outage.StorageOutageError:
            _stop_for_outage(agent, run, process)
            raise
        exited = time.perf_counter()
        wall_s = time.time() - start
    report_new(run)
    state = tell_trial(agent, study, run, returncode, wall_s, stall.seconds if stall else 0.0)
    timing["exited_to_told_ms"] = (time.perf_counter() - exited) * 1e3
    agent.timings.append(timing)
    return state


def prepare_trial(agent: Agent, study: optuna.Study, trial: optuna.Trial) -> TrialRun | None:
    """Resolves the trial's overrides and directory, checks them against the config and the directory, records
    them on the trial (overrides, name, values shown, reproduce command) and says it starts or resumes.
    None when the check fails: the trial is then told FAIL with the reason, before any process starts."""
    try:
        overrides, name = trial_overrides(agent, trial)
        override_flags, config = plan.check_point(agent.config_spec, agent.base_config, overrides)
        # What the trial costs, recorded (mwloop.run.cost): objectives and constraints may name it.
        override_flags = [*override_flags, *plan.trial_flags(config)]
        workdir = os.path.join(agent.sweep_dir, name)
        plan.check_workdir(workdir, config)
    # TrialPruned: a value search_space never gave while probing.
    except (SweepError, optuna.TrialPruned) as e:
        trial.set_user_attr(studies.ATTR + "error", str(e))
        study.tell(trial, state=TrialState.FAIL)
        agent.on_event(study, f"trial {trial.number} failed before it started: {e}")
        return None
    command = runner.command(agent.config_spec, workdir, override_flags, agent.num_workers)
    # The values results show: a grid's every swept key as the run resolves it (constants and defaults too).
    shown = ({k: plan.config_value(config, k) for k in agent.grid_keys} if agent.grid_keys else
             trial.user_attrs[pbt_runner.LINEAGE]["values"] if agent.segments else overrides)
    for key, value in (("overrides", space.to_json(overrides)), ("name", name), ("values", space.to_json(shown)),
                       ("command", reproduce_command(agent.config_spec, workdir, override_flags, agent.num_workers)),
                       ("steps", config.train.steps)):  # a pruned trial run on by hand is complete at this step
        trial.set_user_attr(studies.ATTR + key, value)
    scale = config.train.global_batch_size if agent.settings.prune_by == "examples" else 1
    history = studies.stored_trial(study, trial).system_attrs.get("retry_history") or [None]
    retry_of = history[-1]
    resume = files.newest_checkpoint_step(workdir)
    what = f" (retry of trial {retry_of})" if retry_of is not None else ""
    if resume is not None:
        agent.on_event(study, f"resuming trial {trial.number}{what} from step {resume}: {name}")
    else:
        agent.on_event(study, f"trial {trial.number}{what} started: {name}")
    return TrialRun(trial, workdir, command, agent.settings.metric, scale, files.MetricsTail(workdir),
                    single=not agent.settings.multi)


def follow_trial(agent: Agent, study: optuna.Study, run: TrialRun, process: subprocess.Popen, stall: Stall) -> int:
    """Waits for the trial's process, reporting its evals and recording heartbeats; stops it (SIGTERM: save,
    exit 42) when pruned, when the agent stops, or when it shows no progress for `agent.stall_s` (saying so
    meanwhile). Returns its exit code."""
    heartbeat = studies.heartbeat_s(study)
    last_beat, stop_sent, grace, warn_at = 0.0, None, agent.grace_s, agent.stall_s / 4
    while True:
        if heartbeat and time.monotonic() - last_beat >= heartbeat:
            studies.record_heartbeat(study, run.trial)
            last_beat = time.monotonic()
        try:
            return process.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass
        report_new(run)
        idle = stall.idle_s()
        if stop_sent is None and agent.stall_s and idle >= agent.stall_s:
            stall.seconds = idle
            logging.warning("trial %d: no progress for %.0fs (its last line: %s); stopping it", run.trial.number, idle,
                            stall.last_line())
            # A stuck run is unlikely to save: do not wait long.
            grace = min(agent.grace_s, agent.stall_s)
        elif agent.stall_s and idle >= warn_at:
            agent.on_event(study, f"trial {run.trial.number}: no progress for {idle:.0f}s (its last line: "
                                  f"{stall.last_line()}); it is stopped at {agent.stall_s:.0f}s (--trial_stall_s)")
            warn_at += agent.stall_s / 4
        elif idle < 1:
            warn_at = agent.stall_s / 4
        if stop_sent is None and (run.pruned_at is not None or agent.stop.is_set() or stall.seconds):
            # mwloop.main: checkpoint, exit 42; mwloop.launch passes it to every worker.
            process.terminate()
            stop_sent = time.monotonic()
        elif stop_sent is not None and time.monotonic() - stop_sent > grace:
            logging.warning("trial %d still running %.0fs after SIGTERM; killing it", run.trial.number, grace)
            process.kill()


def _stop_for_outage(agent: Agent, run: TrialRun, process: subprocess.Popen) -> None:
    """The storage stayed away past --storage_outage_s: the trial saves and stops (SIGTERM; exit 42) so that
    the agent run again (or any other) resumes it from its checkpoint once its RUNNING state is failed."""
    logging.warning("trial %d: stopping it (it saves a checkpoint): the study's storage is gone", run.trial.number)
    process.terminate()
    try:
        process.wait(timeout=agent.grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def tell_trial(agent: Agent, study: optuna.Study, run: TrialRun, returncode: int, wall_s: float,
               stalled_s: float) -> TrialState:
    """Tells the study how the trial ended, and says it in one line."""
    settings, trial, events = agent.settings, run.trial, run.tail.events
    values = metric_values(events, settings.metric)
    trial.set_user_attr(studies.ATTR + "wall_s", round(wall_s, 3))
    log = os.path.join(run.workdir, files.LOG)
    if returncode == 0 and (settings.multi or settings.constraints):
        told = objectives.outcome(settings.all_objectives, settings.constraints, objectives.final_metrics(events))
        if isinstance(told, str):
            error = told
        else:
            summary = objectives.tell(study, trial, settings.all_objectives, *told)
            agent.on_event(study, f"trial {trial.number} complete: {summary} in {wall_s:.1f}s")
            return TrialState.COMPLETE
    elif returncode == 0:
        final = values[-1][1] if values else None
        if final is not None and math.isfinite(final):
            study.tell(trial, final)
            agent.on_event(study, f"trial {trial.number} complete: {settings.metric} {final:.4f} in "
                                  f"{wall_s:.1f}s")
            return TrialState.COMPLETE
        written = sorted({f"{e['split']}/{k}" for e in events for k in e if k not in ("step", "split")})
        error = (f"the run ended with {settings.metric} = {final}" if final is not None else
                 f"the run wrote no {settings.metric} to metrics.jsonl (it wrote: {', '.join(written) or 'nothing'})")
    # Before "interrupted": a stuck trial is failed, not retried (it would stall again).
    elif stalled_s:
        error = (f"no progress for {stalled_s:.0f}s (log.txt and metrics.jsonl unchanged; stopped, exit "
                 f"{returncode}); find what it waits for in its log, or raise --trial_stall_s")
    elif run.pruned_at is not None:
        trial.set_user_attr(studies.ATTR + "pruned_at", run.pruned_at)
        study.tell(trial, state=TrialState.PRUNED)
        # The eval that condemned it, not the last one: a stop lands after the run's loop call, so a fast trial
        # may write an eval or two more before it exits.
        agent.on_event(study, f"trial {trial.number} pruned at step {run.pruned_at} ({settings.metric} "
                              f"{run.pruned_value:.4f}); its checkpoint is kept")
        return TrialState.PRUNED
    elif returncode in (errors.PREEMPTED, errors.INTERRUPTED, 128 + 15) or (agent.stop.is_set() and returncode < 0):
        # Saved and stopped (Ctrl-C, SIGTERM to the agent or to the run): retried, it resumes from its checkpoint.
        trial.set_user_attr(studies.INTERRUPTED, True)
        # Under the ask lock: an agent of this process never sees it failed and not yet retried (PBT would take
        # the member as failed).
        with _ASK_LOCK:
            studies.retry(study, study.tell(trial, state=TrialState.FAIL))
        agent.on_event(study, f"trial {trial.number} interrupted (exit {returncode}); it resumes from its "
                              f"checkpoint when the sweep runs again")
        return TrialState.FAIL
    else:
        error = runner.error_line(runner.log_tail(log), returncode)
    trial.set_user_attr(studies.ATTR + "error", error)
    study.tell(trial, state=TrialState.FAIL)
    agent.on_event(study, f"trial {trial.number} failed: {error} (log: {log})")
    return TrialState.FAIL
