"""Local multi-worker launcher: N `mwloop.main` processes on this machine.

    python -m mwloop.launch --num_workers=2 [--max_restarts=K] -- --config=configs/mlp.py --workdir=DIR

Each worker gets its own TF_CONFIG (worker-only form, worker 0 is chief) on
free localhost ports, and each line it prints is prefixed with `[worker i] `.
Synchronous training cannot go on without every worker: when one exits
non-zero (or is killed by a signal, or fails because a peer froze or its link
went down: mwloop.cluster.peers) the others are stopped, and all workers are started
again on fresh ports, up to `--max_restarts` times (default 3: such faults are
mostly transient), resuming from the chief's latest checkpoint. Exit code 42 (a
preemption: every worker saved, then exited) is restarted the same way; exit
code 2 (a user error, which would only repeat) and 130 (Ctrl-C) are not. With
`--max_restarts=0` the launcher fails fast. Its last line is then one
`error: ...` line naming the task and that task's own error. Every task is
forked from one process that imported TensorFlow once (mwloop.launcher.warm),
so a start, restart or re-form pays no import.

With `--num_workers=MIN:MAX` the job is elastic (mwloop.launcher.elastic): a lost worker shrinks it, down to MIN,
instead of restarting it; a worker given notice saves with the others first; a lost place comes back after
`--rejoin_s` at a checkpoint; below MIN it waits up to `--wait_for_min_s`.

With `--num_ps=M` it starts a parameter-server cluster instead: a chief (`[chief] `), the N workers and
M ps tasks (`[ps i] `), with chief + worker + ps TF_CONFIGs. The run ends when the chief does; a worker
that dies is restarted on its own address while the chief goes on; a ps that dies ends the attempt
(restarted like a crash with --max_restarts). See docs/multi_worker.md, "Parameter servers".

With `--rdzv=etcd://HOST:PORT/JOB` it is one machine's agent of a multi-machine elastic job instead
(mwloop.launcher.agent; `--workers_per_host`, `--host_id`, `--address`;
docs/multi_worker.md, "Across machines: etcd").

SIGTERM or SIGHUP (its terminal closed) to the launcher: every worker saves
and exits 42, the launcher exits 143 / 129. Ctrl-C to the launcher asks every
worker to save and exit 130 (forwarded as errors.INTERRUPT_SIGNAL, so a
terminal's Ctrl-C that reached the workers too is not counted twice), waits
up to --grace_s, then exits 130; a second Ctrl-C
kills the workers at once. The workers die with the launcher, even when it is
SIGKILLed (mwloop.launcher.children).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from absl import app, flags, logging

from mwloop import errors
from mwloop.launcher import agent, closed_output, console, elastic, netns, warm
from mwloop.launcher.attempt import (
    Attempt,
    Terminated,
    describe_exit,
    forget_signals,
    handle_signals,
    run_parameter_servers,
    run_workers,
)

FLAGS = flags.FLAGS
flags.DEFINE_string("num_workers", "2", "Worker processes to start on this machine: N, or MIN:MAX for an elastic "
                    "job that goes on with at least MIN when workers are lost (docs/multi_worker.md, \"Elastic "
                    "training\").")
flags.DEFINE_float("rejoin_s", 60.0, "Elastic jobs: seconds after a worker is lost (counted from when the job went "
                   "on without it) before its place comes back (a new worker, admitted at a coordinated save); "
                   "inf: never.", lower_bound=0)
flags.DEFINE_float("wait_for_min_s", 300.0, "Elastic jobs: seconds to wait with fewer than MIN workers before "
                   "giving up (the checkpoint stays).", lower_bound=0)
flags.DEFINE_integer("num_ps", 0, "> 0: parameter-server training: a chief, the workers and this many ps tasks "
                     "(ParameterServerStrategy; docs/multi_worker.md).", lower_bound=0)
# 3 by default: a frozen or unreachable worker, a preemption or a lost node is usually transient, and a restart from
# the last checkpoint costs one start-up; a user error (exit 2) and Ctrl-C are never restarted, and a crash that
# repeats gives up after 3 tries with its one-line error. --max_restarts=0 fails fast.
DEFAULT_MAX_RESTARTS = 3
flags.DEFINE_integer("max_restarts", DEFAULT_MAX_RESTARTS, "Restart all workers up to this many times after a "
                     "crash, a lost worker or a preemption (never after a user error, exit 2, or Ctrl-C).",
                     lower_bound=0)
flags.DEFINE_float("grace_s", 10.0, "Seconds a stopped worker gets between SIGTERM and SIGKILL.", lower_bound=0)
flags.DEFINE_bool("standby", False, "Superseded by --warm_starts (on by default), which forks every task, the first "
                  "attempt's included, from one process that imported TensorFlow once; accepted and ignored.")
flags.DEFINE_bool("warm_starts", True, "Fork every task from one process that has imported TensorFlow already "
                  "(mwloop.launcher.warm, ~0.7 GB while the launcher runs): a start, restart or re-form pays no "
                  "import. --nowarm_starts: every task is a fresh python process.")
flags.DEFINE_string("module", "mwloop.main", "Python module each worker runs: python -m MODULE ARGS.")
flags.DEFINE_string("rdzv", None, "etcd://HOST:PORT/JOB: run this machine's agent of a multi-machine elastic job "
                    "that meets the others in etcd; --num_workers then bounds the whole job (docs/multi_worker.md, "
                    "'Across machines: etcd').")
flags.DEFINE_integer("workers_per_host", 1, "With --rdzv: worker processes this agent runs.", lower_bound=1)
flags.DEFINE_string("host_id", None, "With --rdzv: this agent's id in the job (default: hostname-pid).")
flags.DEFINE_string("address", "127.0.0.1", "With --rdzv: the address the other machines reach this one's workers at "
                    "(its IP or DNS name on the cluster network; 127.0.0.1 only when every agent is on one machine).")
flags.DEFINE_integer("rdzv_ttl_s", agent.DEFAULT_TTL_S, "With --rdzv: seconds after which a silent agent (dead, cut "
                     "off) leaves the job.", lower_bound=2)
flags.DEFINE_enum("network", "isolated", ["isolated", "host"],
                  "isolated: the workers' unauthenticated TensorFlow ports are reachable only on this job's own "
                  "loopback (a network namespace; the workers then have no network); host: the machine's network.")


def launch(args: list[str], num_workers: int | elastic.Bounds, max_restarts: int = DEFAULT_MAX_RESTARTS,
           env: dict[str, str] | None = None, grace_s: float = 10.0, module: str = "mwloop.main",
           num_ps: int = 0, rejoin_s: float = 60.0, wait_for_min_s: float = 300.0,
           warm_starts: bool = True) -> int:
    """Runs `python -m MODULE ARGS` as `num_workers` local workers, restarting all up to `max_restarts` times.

    `num_workers` as `elastic.Bounds(MIN, MAX)` with MIN < MAX: an elastic job (`elastic.ElasticJob`): a lost
    worker shrinks the job (down to MIN) instead of restarting it, and its place comes back `rejoin_s` later;
    below MIN it waits up to `wait_for_min_s`; `max_restarts` then bounds the workers lost to crashes.

    `warm_starts`: every task is forked from one process that imported TensorFlow once (`warm.WarmServer`),
    not started as a fresh `python`.

    With `num_ps` > 0, a parameter-server cluster instead (`attempt.run_parameter_servers`): a chief, the workers and
    `num_ps` ps tasks; the run ends when the chief does.

    Returns 0 when every worker exits 0, else non-zero: the failing worker's
    exit code, 128 + N when it was killed by signal N, 130 / 143 / 129 when the
    launcher itself got SIGINT / SIGTERM / SIGHUP (SIGHUP, a closed terminal, is handled like SIGTERM:
    the workers save and exit 42). A worker's user error (exit 2) or
    Ctrl-C (exit 130) stops all workers without a restart.
    """
    command = [sys.executable, "-m", module, *args]
    interrupt_signal = signal.SIGTERM if num_ps else errors.INTERRUPT_SIGNAL
    env = dict(os.environ if env is None else env)
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = handle_signals() if in_main_thread else {}
    server = warm.WarmServer() if warm_starts else None
    bounds = num_workers if isinstance(num_workers, elastic.Bounds) else elastic.Bounds(num_workers, num_workers)
    num_workers = bounds.max
    job = None
    if bounds.elastic:
        if num_ps:
            print(f"error: --num_workers={bounds} (elastic) with --num_ps={num_ps}: parameter-server jobs already go "
                  f"on when a worker is lost; give a plain --num_workers", file=sys.stderr, flush=True)
            return errors.USER_ERROR
        job = elastic.ElasticJob(command, env, bounds, workdir=elastic.workdir_of(args), grace_s=grace_s,
                                 rejoin_s=rejoin_s, wait_for_min_s=wait_for_min_s, max_restarts=max_restarts,
                                 warm=server)
    try:
        restarts, attempt = 0, None
        if job is not None:
            return job.run()
        while True:
            attempt = Attempt(command, env, grace_s, interrupt_signal, warm=server)
            with attempt:
                failure = (run_parameter_servers(attempt, num_workers, num_ps, max_restarts) if num_ps
                           else run_workers(attempt, num_workers))
            if failure is None:
                break
            name, code = failure
            if code == errors.USER_ERROR:
                # The last line a user reads: plain, like a worker's own one-line errors.
                message = attempt.last_errors.get(name, "a user error (see its output above)")
                print(f"error: {name}: {message} (stopped all workers, no restart: it would repeat)",
                      file=sys.stderr, flush=True)
                return code
            if code == errors.INTERRUPTED:
                logging.warning("%s was interrupted (exit %d); stopped all workers, no restart", name, code)
                return code
            said = attempt.last_errors.get(name)
            if restarts == max_restarts:
                # The last line a user reads: one line, naming the task and its own error if it printed one.
                print(f"error: {name} {describe_exit(code)}{' (' + said + ')' if said else ''}; stopped all workers "
                      f"({restarts} of {max_restarts} restarts done); rerun to resume from the last checkpoint",
                      file=sys.stderr, flush=True)
                return code if code > 0 else 128 - code
            restarts += 1
            logging.warning("restart %d/%d: %s %s%s; restarting all workers", restarts,
                            max_restarts, name, describe_exit(code), f" ({said})" if said else "")
        logging.info("all %d workers finished", num_workers)
        return 0
    except KeyboardInterrupt:
        logging.warning("interrupted: stopped all workers")
        return errors.INTERRUPTED
    except Terminated as e:
        attempt = job.attempt if job is not None else attempt
        # A chief stuck on a frozen ps cannot save: say so rather than claim a save.
        if attempt is not None and attempt.killed:
            logging.warning("%s: %d process(es) did not stop within --grace_s=%g and were killed (pid %s); a rerun "
                            "resumes from the last checkpoint saved before", e, len(attempt.killed), grace_s,
                            ", ".join(map(str, attempt.killed)))
        else:
            logging.warning("%s: the workers saved a checkpoint and stopped (a rerun resumes there)", e)
        return 128 + e.signum
    finally:
        if server is not None:
            server.close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if previous:
            forget_signals()


def main(argv: list[str]) -> None:
    console.use_console_format()
    if len(argv) < 2:
        raise app.UsageError("give the arguments for the workers after '--', e.g. "
                             "python -m mwloop.launch --num_workers=2 -- --config=configs/mlp.py --workdir=DIR")
    if FLAGS.standby:
        logging.warning("--standby is superseded by warm starts (on by default: every task is forked from one "
                        "process that imported TensorFlow once); ignored")
    try:
        bounds = elastic.parse_bounds(FLAGS.num_workers)
        if FLAGS.rdzv:
            sys.exit(_run_agent(argv[1:], bounds))
        _protect_ports(FLAGS.network)
        sys.exit(launch(argv[1:], bounds if bounds.elastic else bounds.max, FLAGS.max_restarts,
                        grace_s=FLAGS.grace_s, module=FLAGS.module, num_ps=FLAGS.num_ps, rejoin_s=FLAGS.rejoin_s,
                        wait_for_min_s=FLAGS.wait_for_min_s, warm_starts=FLAGS.warm_starts))
    # errors.EXIT_CODES: a user error is one line, exit 2, like a worker's.
    except Exception as e:
        if (code := errors.exit_code(e)) is None:
            raise
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(code)


def _run_agent(args: list[str], bounds: elastic.Bounds) -> int:
    """This machine's agent of a multi-machine job (mwloop.launcher.agent); SIGTERM/SIGHUP: it saves and leaves."""
    # No network namespace: the other machines' workers must reach this one's.
    logging.warning("the workers' TensorFlow ports listen on every interface, unauthenticated (--rdzv: the other "
                    "machines must reach them): use a firewalled or private network (SECURITY.md)")
    handle_signals()
    server = warm.WarmServer() if FLAGS.warm_starts else None
    job = agent.Agent(FLAGS.rdzv, [sys.executable, "-m", FLAGS.module, *args], dict(os.environ), bounds,
                      workers_per_host=FLAGS.workers_per_host, host_id=FLAGS.host_id or agent.default_host_id(),
                      address=FLAGS.address, workdir=elastic.workdir_of(args), grace_s=FLAGS.grace_s,
                      wait_for_min_s=FLAGS.wait_for_min_s, max_restarts=FLAGS.max_restarts, ttl_s=FLAGS.rdzv_ttl_s,
                      warm=server)
    try:
        return job.run()
    finally:
        if server is not None:
            server.close()


def _protect_ports(network: str) -> None:
    """Keeps the workers' ports off the network (SECURITY.md), or says plainly that they are not."""
    reason = netns.isolate() if network == "isolated" else "--network=host"
    if reason is None:
        logging.info("workers run in a network namespace of their own: their ports are reachable only from "
                     "each other (--network=host gives them the machine's network)")
        if os.environ.get("MLFLOW_TRACKING_URI", "").startswith(("http://", "https://")):
            logging.warning("MLFLOW_TRACKING_URI=%s is out of reach from the workers' namespace (no network): use "
                            "--network=host, or unset it for the SQLite store beside the workdir (docs/tracking.md)",
                            os.environ["MLFLOW_TRACKING_URI"])
        return
    logging.warning("the workers' TensorFlow ports listen on every interface, unauthenticated (%s): any host that "
                    "reaches them can run TensorFlow ops as you; use a firewalled or private network (SECURITY.md)",
                    reason)


if __name__ == "__main__":
    # `launch | head`: the job goes on, the workers never block.
    closed_output.survive_closed_output()
    try:
        app.run(main)
    # A Ctrl-C that came between launch()'s own handlers: still no traceback.
    except KeyboardInterrupt:
        sys.exit(errors.INTERRUPTED)
