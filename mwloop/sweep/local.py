"""The sweep's commands: create a study once, run agents (here, or as Slurm / Kubernetes jobs), write results.

`create_sweep` checks everything before any training (the sweep file, the
search space sampled against the config, sampler, pruner, budget, storage, an
existing study's metric) and creates the study. `run_sweep` is the local
backend: create, then `parallel` agents as threads of this process, each
running its trials as child processes. `run_agent` is one agent of a study
created before (`python -m mwloop.sweep agent`, what Slurm tasks and
Kubernetes pods run).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import threading

import optuna
from absl import logging
from optuna.trial import TrialState

from mwloop.artifacts import workdir_lock
from mwloop.launcher import attempt
from mwloop.launcher.warm import WarmServer
from mwloop.sweep import agent as agents
from mwloop.sweep import outage, pbt_report, pbt_runner, plan, report, runner, space
from mwloop.sweep import study as studies
from mwloop.sweep.results import Results
from mwloop.sweep.values import SweepError

# A dead agent's trial is retried 2 heartbeats after its last one.
DEFAULT_HEARTBEAT_S = 30


@dataclasses.dataclass
class Created:
    """A study ready for agents."""
    sweep: space.SweepFile
    settings: studies.Settings
    name: str
    storage_url: str
    storage: optuna.storages.BaseStorage
    sweep_dir: str


def create_sweep(*, sweep_spec: str, sweep_dir: str, config_spec: str | None = None, metric: str | None = None,
                 mode: str | None = None, n_trials: int | None = None, sampler: str | None = None,
                 pruner: str | None = None, seed: int | None = None, study_name: str | None = None,
                 storage_url: str | None = None, heartbeat_s: int = DEFAULT_HEARTBEAT_S,
                 storage_outage_s: float = outage.OUTAGE_S) -> Created:
    """Checks the sweep before any training and creates its study (or checks the existing one); nothing is
    written before every check passed."""
    sweep = space.load_sweep(sweep_spec)
    config_spec = config_spec or sweep.config
    if not config_spec:
        raise SweepError(f"no --config given and {sweep_spec} sets no CONFIG")
    if sweep.multi and (metric or mode):
        raise SweepError(f"--metric/--mode with a sweep of {len(sweep.objectives)} OBJECTIVES; change OBJECTIVES in "
                         f"{sweep_spec} instead")
    metric = metric or sweep.metric
    mode = mode or ("min" if metric != sweep.metric and "loss" in metric else sweep.mode)
    if sweep.points is not None and n_trials not in (None, len(sweep.points)):
        raise SweepError(f"--n_trials={n_trials} but the grid {sweep_spec} has {len(sweep.points)} points; "
                         f"a grid runs each point once")
    sampler, pruner = sampler or sweep.sampler, pruner or sweep.pruner
    given_trials = n_trials
    if n_trials is None:
        n_trials = sweep.n_trials
    # A search without N_TRIALS: its whole grid, or the default budget.
    if n_trials is None:
        n_trials = (math.prod(len(v) for v in space.grid_space(sweep).values()) if sampler == "grid"
                    else space.DEFAULT_N_TRIALS)
    space.check_settings(metric=metric, mode=mode, sampler=sampler, pruner=pruner, n_trials=n_trials,
                         prune_by=sweep.prune_by, objectives=sweep.objectives)
    checked = space.check(sweep, config_spec)
    if sweep.pbt:
        n_trials = pbt_runner.check_sweep(sweep, checked, plan.base_config(config_spec).train.steps, given_trials,
                                          pruner)
    if sweep.points is not None:
        plan.check_workdirs(sweep_dir, plan.plan(config_spec, sweep.points))
    batch_swept = any("train.global_batch_size" in overrides for overrides in checked)
    prune_by = sweep.prune_by or ("examples" if batch_swept else "step")
    settings = studies.Settings(kind=sweep.kind, sweep=sweep_spec, config=config_spec, metric=metric, mode=mode,
                                n_trials=n_trials, sampler=sampler, sampler_options=sweep.sampler_options,
                                pruner=pruner, pruner_options=sweep.pruner_options, prune_by=prune_by, seed=seed,
                                objectives=sweep.objectives, constraints=sweep.constraints, pbt=sweep.pbt)
    server = storage_url is not None and not storage_url.startswith("sqlite")
    # A server that does not answer: said before the sweep directory is made.
    if server:
        storage = studies.open_storage(storage_url, heartbeat_s, storage_outage_s)
    # Made before a local storage is opened: a SQLite file may live in it.
    workdir_lock.make(sweep_dir)
    if not server:
        storage_url = storage_url or studies.default_storage(sweep_dir)
        storage = studies.open_storage(storage_url, heartbeat_s, storage_outage_s)
    name = study_name or studies.default_study_name(sweep_spec)
    study = studies.create(storage, name, settings, sweep)
    if settings.pbt:
        # The first interval: the population's draws (an interval a killed runner left undecided is decided too).
        pbt_runner.Segments(sweep, settings).advance(study)
    logging.info("study %s in %s: a %s of %d trials on %s, %s %s%s%s", name,
                 studies.redact(storage_url), sweep.kind, n_trials, config_spec,
                 "Pareto front of" if settings.multi else "ranked by", studies.objectives_text(settings.all_objectives)
                 + "".join(f", {c}" for c in settings.constraints),
                 f", sampler {sampler}" if sweep.kind == "search" else "",
                 f", pruner {pruner}" if pruner != "none" else "")
    return Created(sweep, settings, name, storage_url, storage, sweep_dir)


def _title(settings: studies.Settings) -> str:
    return f"Sweep {settings.sweep} on {settings.config}"


class _Console:
    """One line per trial event, with the study's counts, the best so far and an ETA; results after each."""

    def __init__(self, results: Results, settings: studies.Settings, parallel: int):
        self.results, self.settings, self.parallel = results, settings, parallel

    def __call__(self, study: optuna.Study, line: str) -> None:
        trials = studies.all_trials(study)
        shown = studies.shown(trials)
        count = {state: sum(t.state == state for t in shown) for state in TrialState}
        finished = count[TrialState.COMPLETE] + count[TrialState.PRUNED] + count[TrialState.FAIL]
        status = (f"[{finished}/{self.settings.n_trials}: {count[TrialState.COMPLETE]} complete, "
                  f"{count[TrialState.PRUNED]} pruned, {count[TrialState.FAIL]} failed]")
        complete = [t for t in shown if t.state == TrialState.COMPLETE and t.values]
        if self.settings.multi and complete:
            status += f" Pareto front: {len(studies.pareto_front(trials, self.settings.directions))} trial(s)"
        elif complete:
            # With CONSTRAINTS, the best feasible trial (Optuna's constraint values: <= 0 holds).
            feasible = [t for t in complete if all(v <= 0 for v in t.constraints.values())] or complete
            best = (max if self.settings.mode == "max" else min)(feasible, key=lambda t: t.value)
            status += f" best: trial {best.number} {best.value:.4f}"
        walls = [t.user_attrs.get(studies.ATTR + "wall_s") for t in shown if t.state.is_finished()]
        walls = [w for w in walls if w]
        remaining = self.settings.n_trials - finished
        if walls and 0 < remaining and "started" not in line and "resuming" not in line:
            eta = remaining * sum(walls) / len(walls) / min(self.parallel, remaining)
            status += f" ETA {report.format_seconds(eta)}"
        logging.info("%s %s", line, status)
        try:
            self.results.write(trials)
        # A full disk must not stop the trials: the study has every result.
        except OSError as e:
            logging.warning("could not write results: %s", e)


def _agent(created: Created, config_spec: str, num_workers: int, console, stop: threading.Event,
           seed_offset: int, stall_s: float, warm: WarmServer) -> tuple[agents.Agent, optuna.Study]:
    study, settings = studies.load(created.storage, created.name, storage_url=created.storage_url,
                                   sweep=created.sweep, seed_offset=seed_offset)
    agent = agents.Agent(created.sweep, settings, created.sweep_dir, config_spec, plan.base_config(config_spec),
                         num_workers=num_workers, stop=stop, on_event=console, stall_s=stall_s, warm=warm)
    return agent, study


def _finish(created: Created, results: Results, study: optuna.Study) -> int:
    """Writes every result file; logs the outcome and the best trial's command; returns the number failed."""
    ranked = results.write(studies.all_trials(study), final=True)
    failed = sum(r.status == "failed" for r in ranked)
    metric = created.settings.metric
    reported = {m for r in ranked for m in r.final}
    if reported and metric not in reported:
        logging.warning("no trial reports %s, so nothing is ranked; metrics are: %s", metric,
                        ", ".join(sorted(reported)))
    counts = ", ".join(f"{sum(r.status == s for r in ranked)} {s}" for s in report.STATUSES
                       if any(r.status == s for r in ranked))
    logging.info("sweep done: %s; results in %s", counts or "no trials", os.path.join(created.sweep_dir, "results.md"))
    front = [r for r in ranked if r.pareto]
    best = pbt_report.winner(studies.all_trials(study), created.settings.mode) if created.settings.pbt \
        else None
    if best is not None:
        logging.info("PBT winner: member m%d %s %.4f; retrain its schedule from scratch with: %s",
                     best.user_attrs[pbt_runner.LINEAGE]["member"], metric, best.value,
                     pbt_report.reproduce_command(studies.all_trials(study), best, created.settings.config,
                                                  os.path.join(created.sweep_dir, "reproduce")))
    if created.settings.multi:
        logging.info("Pareto front of %s: %s; results.md has each one's command",
                     studies.objectives_text(created.settings.objectives),
                     ", ".join(f"trial {r.number}" for r in front) or "no feasible complete trial")
    elif ranked and ranked[0].status == "complete" and metric in ranked[0].final and ranked[0].feasible is not False:
        logging.info("best: trial %s %s %.4f; reproduce it with: %s", ranked[0].number, metric,
                     ranked[0].final[metric], ranked[0].command)
    return failed


def _adopt_orphans(study: optuna.Study) -> None:
    """Trials left RUNNING by a local sweep that was killed (this process holds the sweep's lock, so no agent
    runs them): failed and retried at once, rather than after the heartbeat's grace period."""
    for trial in studies.all_trials(study, states=(TrialState.RUNNING,)):
        logging.info("trial %d was running when the last sweep stopped: retrying it", trial.number)
        studies.fail_running(study, trial)
        studies.retry(study, studies.stored_trial(study, trial))


def run_sweep(*, sweep_spec: str, sweep_dir: str, config_spec: str | None = None, parallel: int = 1,
              num_workers: int = 1, metric: str | None = None, mode: str | None = None,
              trial_stall_s: float = agents.STALL_S, **create_args) -> int:
    """The local backend: creates the study, runs `parallel` agents here until its budget is met; returns the
    number of failed trials. Ctrl-C (KeyboardInterrupt) stops the running trials, which save a checkpoint
    and are retried (resuming) by the next run of the same command. A trial that shows no progress for
    `trial_stall_s` seconds (0: no limit) is stopped and failed."""
    created = create_sweep(sweep_spec=sweep_spec, sweep_dir=sweep_dir, config_spec=config_spec, metric=metric,
                           mode=mode, **create_args)
    lock = workdir_lock.acquire(sweep_dir) if create_args.get("storage_url") is None else None
    # One warm-start server for every agent thread (one TensorFlow import, not `parallel`); multi-worker trials'
    # launchers fork theirs from it (warm.PARENT_ENV).
    warm = WarmServer(listen=True)
    try:
        settings = created.settings
        results = Results(sweep_dir, settings, _title(settings), created.sweep.points)
        console = _Console(results, settings, parallel)
        stop = threading.Event()
        pool = [_agent(created, settings.config if config_spec is None else config_spec, num_workers, console, stop,
                       seed_offset=i, stall_s=trial_stall_s, warm=warm) for i in range(parallel)]
        study = pool[0][1]
        if lock is not None:
            _adopt_orphans(study)
        trials = studies.all_trials(study)
        done = [t for t in studies.shown(trials) if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
        logging.info("sweep %s: %d trials, %d finished before, %d at a time, in %s", sweep_spec, settings.n_trials,
                     len(done), parallel, sweep_dir)
        if len(done) < settings.n_trials:
            # From this thread, which outlives the agents' threads (a server started from an agent's thread
            # would die with it, and take the other agents' trials along). Multi-worker trials fork theirs from it.
            warm.open(runner.child_env(created.name))
        crashed: list[BaseException] = []

        def run_agent_thread(*pair) -> None:
            try:
                agents.run(*pair)
            # An agent's bug: stop the others, then raise it here with its traceback.
            except BaseException as e:
                crashed.append(e)
                stop.set()

        threads = [threading.Thread(target=run_agent_thread, args=pair, name=f"agent-{i}", daemon=True)
                   for i, pair in enumerate(pool)]
        for thread in threads:
            thread.start()
        try:
            while any(thread.is_alive() for thread in threads):
                attempt.pause(0.2)
        except KeyboardInterrupt:
            running = len(studies.all_trials(study, states=(TrialState.RUNNING,)))
            logging.warning("interrupted: stopping %d running trial(s); they save a checkpoint and resume when "
                            "the same command runs again", running)
            stop.set()
            for thread in threads:
                thread.join()
            _finish(created, results, study)
            raise
        if crashed:
            try:
                _finish(created, results, study)
            # The agent's own error first (a failure writing results would hide it; it stays chained).
            finally:
                raise crashed[0]
        return _finish(created, results, study)
    finally:
        warm.close()
        if lock is not None:
            lock.close()


def run_agent(*, sweep_spec: str, sweep_dir: str, study_name: str, storage_url: str, config_spec: str | None = None,
              num_workers: int = 1, heartbeat_s: int = DEFAULT_HEARTBEAT_S,
              trial_stall_s: float = agents.STALL_S, stop: threading.Event | None = None,
              storage_outage_s: float = outage.OUTAGE_S) -> int:
    """One agent of a study created before: runs trials until the budget is met (or `stop`); returns how many
    it ran. Each agent seeds its sampler apart (Slurm array task id, Kubernetes completion index, or pid)."""
    sweep = space.load_sweep(sweep_spec)
    storage = studies.open_storage(storage_url, heartbeat_s, storage_outage_s)
    index = os.environ.get("SLURM_ARRAY_TASK_ID") or os.environ.get("JOB_COMPLETION_INDEX") or str(os.getpid())
    # Its settings are read from the study below.
    created = Created(sweep, None, study_name, storage_url, storage, sweep_dir)
    study, settings = studies.load(storage, study_name, storage_url=storage_url, sweep=sweep,
                                   seed_offset=int(index) + 1)
    created.settings = settings
    results = Results(sweep_dir, settings, _title(settings), sweep.points)
    config_spec = config_spec or settings.config
    agent = agents.Agent(sweep, settings, sweep_dir, config_spec, plan.base_config(config_spec),
                         num_workers=num_workers, stop=stop or threading.Event(),
                         on_event=_Console(results, settings, 1), stall_s=trial_stall_s)
    logging.info("agent %s on study %s in %s: %d trials, ranked by %s", index, study_name,
                 studies.redact(storage_url), settings.n_trials, settings.metric)
    try:
        ran = agents.run(agent, study)
    finally:
        agent.warm.close()
    _finish(created, results, study)
    return ran


def write_results(*, sweep_dir: str, study_name: str | None = None, storage_url: str | None = None,
                  sweep_spec: str | None = None) -> int:
    """Writes results.* of an existing study (e.g. while agents run elsewhere); returns the number failed."""
    storage_url = storage_url or studies.default_storage(sweep_dir)
    storage = studies.open_storage(storage_url, None)
    name = study_name or (studies.default_study_name(sweep_spec) if sweep_spec else None)
    if name is None:
        names = optuna.get_all_study_names(storage)
        if len(names) != 1:
            raise SweepError(f"{studies.redact(storage_url)} holds {len(names)} studies "
                             f"({', '.join(names) or 'none'}): name one with --study")
        name = names[0]
    study, settings = studies.load(storage, name, storage_url=storage_url)
    sweep = space.load_sweep(sweep_spec or settings.sweep) if (sweep_spec or os.path.exists(
        settings.sweep.partition(":")[0])) else None
    results = Results(sweep_dir, settings, _title(settings), sweep.points if sweep else None)
    return _finish(Created(sweep, settings, name, storage_url, storage, sweep_dir), results, study)


def agent_argv(created: Created, *, num_workers: int, python: str = sys.executable, config_spec: str | None = None,
               heartbeat_s: int = DEFAULT_HEARTBEAT_S, trial_stall_s: float = agents.STALL_S,
               storage_outage_s: float = outage.OUTAGE_S) -> list[str]:
    """The command every Slurm task or Kubernetes pod runs: one agent of the study."""
    return [python, "-m", "mwloop.sweep", "agent", f"--sweep={created.settings.sweep}",
            f"--workdir={created.sweep_dir}", f"--study={created.name}", f"--storage={created.storage_url}",
            f"--config={config_spec or created.settings.config}", f"--num_workers={num_workers}",
            f"--heartbeat_s={heartbeat_s}", f"--trial_stall_s={trial_stall_s:g}",
            f"--storage_outage_s={storage_outage_s:g}"]


def launch_agents(created: Created, *, backend: str, num_agents: int, parallel: int, num_workers: int,
                  options: dict[str, str], image: str = "", resources: dict[str, str] | None = None,
                  agent_options: dict | None = None, k8s_options: dict[str, str] | None = None) -> str:
    """Writes the Slurm batch script (DIR/agents.sbatch) or the Kubernetes Job (DIR/agents.yaml) whose tasks
    are agents of the created study; returns its path. `agent_options` go to `agent_argv` (heartbeat_s,
    trial_stall_s); `k8s_options` to `backends.render_k8s_job` (storage_secret, volume_claim, mount_path)."""
    try:
        from mwloop.sweep import backends
    except ImportError:
        raise SweepError(f"--backend={backend} is not available in this build (mwloop/sweep/backends.py)") from None
    if created.storage_url.startswith("sqlite") and backend == "k8s":
        logging.warning("pods cannot share a SQLite file reliably: give --storage=postgresql://...")
    job_name = f"sweep-{created.name}".lower().replace("_", "-")[:52]
    if backend == "slurm":
        text = backends.render_sbatch(agent_argv(created, num_workers=num_workers, **(agent_options or {})),
                                      num_agents=num_agents,
                                      parallel=parallel, job_name=job_name,
                                      log_dir=os.path.abspath(os.path.join(created.sweep_dir, "agents")),
                                      options=options)
        path = os.path.join(created.sweep_dir, "agents.sbatch")
    else:
        text = backends.render_k8s_job(agent_argv(created, num_workers=num_workers, python="python",
                                                  **(agent_options or {})),
                                       num_agents=num_agents, parallel=parallel, name=job_name, image=image,
                                       resources=resources or {}, **(k8s_options or {}))
        path = os.path.join(created.sweep_dir, "agents.yaml")
    with open(path, "w") as f:
        f.write(text)
    return path
