"""Sweeps on Optuna: grids and searches, each trial its own training process.

  python -m mwloop.sweep --sweep=experiments/resnet_search.py --workdir=DIR [--parallel=P]   # create + run here
  python -m mwloop.sweep create --sweep=... --workdir=DIR [--study=NAME] [--storage=URL] [--n_trials=N]
  python -m mwloop.sweep agent --sweep=... --workdir=DIR --study=NAME --storage=URL   # one agent of a study
  python -m mwloop.sweep report --workdir=DIR [--study=NAME] [--storage=URL]          # results.* from the study
  python -m mwloop.sweep --backend=slurm|k8s ...   # create, then write the batch script / Job whose tasks are agents

The default command creates the study (checking everything before any
training), then runs `--parallel` agents on this machine (`--backend=local`).
Exit status: 0 when every trial ran (complete or pruned), 1 when any failed,
2 for a bad sweep (one `error:` line), 130 when interrupted (rerun to resume).
See docs/sweeps.md.
"""

from __future__ import annotations

import signal
import sys
import threading

from mwloop import errors
from mwloop.launcher import attempt
from mwloop.sweep import runner

COMMANDS = ("run", "create", "agent", "report")


def _define_flags() -> None:
    from absl import flags

    # Only when run as a program: importing this module (a test, a tool) must not define global flags.
    flags.DEFINE_string("sweep", None, "Sweep file experiments/<name>.py[:arg]: get_sweep() or search_space(trial).")
    flags.DEFINE_string("config", None, "Base config FILE[:ARG] (default: the sweep file's CONFIG).")
    flags.DEFINE_string("workdir", None, "Sweep directory: one subdirectory per trial, results.* at the top.")
    flags.DEFINE_integer("parallel", 1, "Trials run at the same time (local agents, or Slurm/Kubernetes tasks at "
                         "once).", lower_bound=1)
    flags.DEFINE_integer("num_workers", 1, "Worker processes per trial (> 1: through mwloop.launch).", lower_bound=1)
    flags.DEFINE_string("metric", None, "Rank by <split>/<metric> (default: the sweep's METRIC or eval/accuracy).")
    flags.DEFINE_enum("mode", None, ["max", "min"], "Whether a higher or lower metric is better.")
    flags.DEFINE_string("study", None, "Study name (default: the sweep file's name without .py, and -ARG for FILE:ARG: "
                        "experiments/resnet_search.py:short -> resnet_search-short).")
    flags.DEFINE_string("storage", None, "Optuna storage URL (default: sqlite:///WORKDIR/study.db); many "
                        "machines: postgresql://USER:PASSWORD@HOST/DB.")
    flags.DEFINE_integer("n_trials", None, "Trial budget of a search (default: the sweep's N_TRIALS).")
    flags.DEFINE_string("sampler", None, "tpe | random | cmaes | grid (default: the sweep's SAMPLER or tpe).")
    flags.DEFINE_string("pruner", None, "median | asha | successive_halving | hyperband | none (default: the "
                        "sweep's PRUNER; median for a search, none for a grid).")
    flags.DEFINE_integer("seed", None, "Sampler seed (each agent adds its index).")
    flags.DEFINE_integer("heartbeat_s", 30, "Seconds between a running trial's heartbeats; a trial silent for two "
                         "is failed and retried by another agent.", lower_bound=1)
    flags.DEFINE_float("trial_stall_s", 1800, "A trial whose log and metrics.jsonl stay unchanged this long (a run "
                       "stuck on its input or a peer) is stopped and failed; 0: no limit.", lower_bound=0)
    flags.DEFINE_float("storage_outage_s", 300, "How long agents wait for the study's storage when it does not "
                       "answer (a database restart); past it the running trial saves and the agent exits 75.",
                       lower_bound=0)
    flags.DEFINE_enum("backend", "local", ["local", "slurm", "k8s"], "Where agents run: here, as a Slurm array "
                      "job, or as a Kubernetes Indexed Job (written to WORKDIR/agents.sbatch | agents.yaml).")
    flags.DEFINE_integer("num_agents", None, "Slurm/Kubernetes: agents in the job (default: --parallel).")
    flags.DEFINE_multi_string("sbatch", [], "Slurm: KEY=VALUE passed to #SBATCH --KEY=VALUE (gres, time, mem, ...).")
    flags.DEFINE_string("image", "", "Kubernetes: the container image with mwloop installed.")
    flags.DEFINE_multi_string("resource", [], "Kubernetes: KEY=VALUE resource limits per pod (cpu, memory, "
                              "nvidia.com/gpu).")
    flags.DEFINE_string("storage_secret", "", "Kubernetes: SECRET[:KEY] holding the storage URL (key default url), "
                        "read by the pods at run time instead of written into the manifest.")
    flags.DEFINE_string("volume_claim", "", "Kubernetes: a ReadWriteMany PersistentVolumeClaim holding --workdir, "
                        "mounted in every pod at --mount_path.")
    flags.DEFINE_string("mount_path", "", "Kubernetes: where --volume_claim is mounted in the pods.")
    flags.mark_flags_as_required(["workdir"])


def _interrupt(signum, frame) -> None:
    # SIGTERM as Ctrl-C: stop the trials (they save) rather than orphan them. Raised as the launcher's handler
    # raises it: one Python drops (inside a fork hook or a __del__) is raised again at the sweep's next wait.
    attempt.on_signal(signal.SIGINT, frame)


def _pairs(values: list[str], flag: str) -> dict[str, str]:
    from mwloop.sweep import SweepError

    pairs = {}
    for value in values:
        key, sep, rest = value.partition("=")
        if not sep or not key:
            raise SweepError(f"--{flag}={value}: give KEY=VALUE")
        pairs[key] = rest
    return pairs


def _run(command: str) -> int:
    from absl import flags, logging

    from mwloop.sweep import SweepError, local

    FLAGS = flags.FLAGS
    if command != "report" and not FLAGS.sweep:
        raise SweepError("--sweep=FILE[:arg] is required")
    create_args = dict(n_trials=FLAGS.n_trials, sampler=FLAGS.sampler, pruner=FLAGS.pruner, seed=FLAGS.seed,
                       study_name=FLAGS.study, storage_url=FLAGS.storage, heartbeat_s=FLAGS.heartbeat_s,
                       storage_outage_s=FLAGS.storage_outage_s)
    if command == "agent":
        if not FLAGS.study or not FLAGS.storage:
            raise SweepError("an agent needs --study=NAME and --storage=URL of a study created before")
        # SIGTERM (Slurm's time limit, a pod's eviction) or Ctrl-C: stop the running trial cleanly (it saves and
        # is retried, resuming, by whichever agent asks next), then exit.
        stop = threading.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
        local.run_agent(sweep_spec=FLAGS.sweep, sweep_dir=FLAGS.workdir, study_name=FLAGS.study,
                        storage_url=FLAGS.storage, config_spec=FLAGS.config, num_workers=FLAGS.num_workers,
                        heartbeat_s=FLAGS.heartbeat_s, trial_stall_s=FLAGS.trial_stall_s, stop=stop,
                        storage_outage_s=FLAGS.storage_outage_s)
        return errors.INTERRUPTED if stop.is_set() else 0
    if command == "report":
        return 1 if local.write_results(sweep_dir=FLAGS.workdir, study_name=FLAGS.study, storage_url=FLAGS.storage,
                                        sweep_spec=FLAGS.sweep) else 0
    if command == "create" or FLAGS.backend != "local":
        created = local.create_sweep(sweep_spec=FLAGS.sweep, sweep_dir=FLAGS.workdir, config_spec=FLAGS.config,
                                     metric=FLAGS.metric, mode=FLAGS.mode, **create_args)
        if command == "create":
            return 0
        path = local.launch_agents(created, backend=FLAGS.backend, num_agents=FLAGS.num_agents or FLAGS.parallel,
                                   parallel=FLAGS.parallel, num_workers=FLAGS.num_workers,
                                   options=_pairs(FLAGS.sbatch, "sbatch"), image=FLAGS.image,
                                   resources=_pairs(FLAGS.resource, "resource"),
                                   agent_options=dict(heartbeat_s=FLAGS.heartbeat_s, trial_stall_s=FLAGS.trial_stall_s,
                                                      storage_outage_s=FLAGS.storage_outage_s),
                                   k8s_options=dict(storage_secret=FLAGS.storage_secret,
                                                    volume_claim=FLAGS.volume_claim, mount_path=FLAGS.mount_path))
        how = f"sbatch {path}" if FLAGS.backend == "slurm" else f"kubectl apply -f {path}"
        logging.info("wrote %s; submit it with: %s", path, how)
        print(path, flush=True)
        return 0
    failed = local.run_sweep(sweep_spec=FLAGS.sweep, sweep_dir=FLAGS.workdir, config_spec=FLAGS.config,
                             parallel=FLAGS.parallel, num_workers=FLAGS.num_workers, metric=FLAGS.metric,
                             mode=FLAGS.mode, trial_stall_s=FLAGS.trial_stall_s, **create_args)
    return 1 if failed else 0


def main(argv: list[str]) -> None:
    from absl import app

    from mwloop.launcher import console
    from mwloop.sweep.outage import EXIT_OUTAGE, StorageOutageError

    console.use_console_format()
    command = argv[1] if len(argv) > 1 else "run"
    if command not in COMMANDS or len(argv) > 2:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}; commands are {', '.join(COMMANDS)}")
    for signum in (signal.SIGTERM, signal.SIGINT):
        # A background job's ignored Ctrl-C stays ignored, as Python leaves it.
        if signum == signal.SIGTERM or signal.getsignal(signum) != signal.SIG_IGN:
            signal.signal(signum, _interrupt)
    try:
        sys.exit(_run(command))
    except StorageOutageError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(EXIT_OUTAGE)
    # SweepError, and WorkdirBusyError (a second runner on a busy sweep directory).
    except errors.UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(errors.USER_ERROR)
    except KeyboardInterrupt:
        print("interrupted: run the same command again to resume the sweep", file=sys.stderr, flush=True)
        sys.exit(errors.INTERRUPTED)


if __name__ == "__main__":
    from mwloop.launcher import closed_output
    # `sweep | head`: the trials go on.
    closed_output.survive_closed_output()
    # A sweep or config file may import TensorFlow: its C++ start-up lines say nothing about the sweep.
    # (Trials get the environment as it was: mwloop.main quiets them itself; runner.child_env.)
    runner.quiet_tensorflow()
    from absl import app

    _define_flags()
    app.run(main)
