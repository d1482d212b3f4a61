"""Fault cases of issue 23 for parameter servers: a frozen ps or worker (SIGSTOP) under the launcher ends the
chief's attempt within config.distribution.peer_timeout_s in one line naming the task (mwloop.cluster.ps_watch), the
launcher restarts the job from the last checkpoint; a task frozen for less than that is waited for. Joined to
`fault_cases.CASES`."""

from __future__ import annotations

import json

import psutil

from tests.stress.fault_harness import Case, Fault, error, ok
from tests.stress.fault_steps import all_of, freeze, in_output, main, not_in_output, train_events_once

DEADLINE = 15  # config.distribution.peer_timeout_s of these runs
# The recommendation example on 2 workers and 2 ps tasks (about 50 steps/s here), a checkpoint every 200 steps.
PS_BASE = {"train.steps": 1500, "train.steps_per_loop": 20, "train.log_every_steps": 100,
           "train.eval_every_steps": 0, "train.checkpoint_every_steps": 200, "dataset.num_ratings": 100000,
           "distribution.peer_timeout_s": DEADLINE, "export": False}
MULTI = {"multi": True, "timeout": 300.0, "fresh_stays_empty": False}


def ps_launch(num_workers: int = 2, num_ps: int = 2, max_restarts: int = 1) -> list[str]:
    # Fresh processes: freeze_task finds a task by the TF_CONFIG in /proc/PID/environ, which a task forked by
    # the warm-start server does not show (its environment is set after the fork).
    return ["mwloop.launch", f"--num_workers={num_workers}", f"--num_ps={num_ps}", f"--max_restarts={max_restarts}",
            "--grace_s=5", "--nowarm_starts", "--", *main(config="configs/recommend.py", base=PS_BASE)[1:]]


def freeze_task(kind: str, index: int, seconds: float | None = None):
    """The launcher's task `kind` `index` (found by its TF_CONFIG) SIGSTOPped, woken (SIGCONT) after `seconds`."""
    def act(proc) -> None:
        def task(child: psutil.Process) -> tuple[str, int] | None:
            try:
                config = json.loads(child.environ().get("TF_CONFIG", "{}"))
                return config["task"]["type"], int(config["task"]["index"])
            except (psutil.Error, ValueError, KeyError):
                return None
        pid = next(c.pid for c in psutil.Process(proc.pid).children() if task(c) == (kind, index))
        freeze(pid, seconds)
        proc.facts = {"frozen": f"{kind} {index} (pid {pid})"}
    return act


def named(kind: str, index: int) -> str:
    """The chief's one line for a frozen task (a regex), within the deadline plus the probe's period."""
    return (rf"\[chief\] error: {kind} {index} \(/job:{kind}/replica:0/task:{index} at localhost:\d+\) has not "
            rf"answered for 1[5-9] s \(frozen, or its host or link is down\): the chief ends this attempt")


def restarted_and_finished(kind: str, index: int):
    return all_of(in_output(named(kind, index)),
                  in_output(rf"\[chief\] waiting for {kind} {index} \(/job:{kind}/replica:0/task:{index} at "
                            rf"localhost:\d+\): no answer for \d+ s"),
                  in_output(rf"restart 1/1: chief exited with -9 \(SIGKILL\) \({kind} {index} "),
                  in_output(r"restart 1/1[\s\S]*resumed from step [1-9]\d*00 "),
                  in_output(rf"done: steps \d+ -> {PS_BASE['train.steps']} of {PS_BASE['train.steps']}"),
                  not_in_output(r"Traceback"), train_events_once)


def stopped_the_chief(kind: str, index: int) -> str:
    """The launcher's last line when no restart is left (a regex)."""
    return (rf"chief exited with -9 \(SIGKILL\) \({kind} {index} \(/job:{kind}/replica:0/task:{index} at "
            rf"localhost:\d+\) has not answered")


CASES: list[Case] = [
    ok("ps_frozen_ps_restarts", f"ps 1 SIGSTOPped: the chief names it in one line within {DEADLINE} s "
       "(peer_timeout_s), the launcher restarts all, resumes from the last checkpoint, finishes",
       ps_launch(), fault=Fault("SIGSTOP ps 1 at step 600", freeze_task("ps", 1), at_step=600),
       check=restarted_and_finished("ps", 1), **MULTI),
    ok("ps_frozen_worker_of_two_restarts", "worker 1 of 2 SIGSTOPped: TensorFlow does not reschedule its step, so "
       "the chief names it within the deadline; restart, resume, finish", ps_launch(),
       fault=Fault("SIGSTOP worker 1 at step 600", freeze_task("worker", 1), at_step=600),
       check=restarted_and_finished("worker", 1), **MULTI),
    error("ps_frozen_only_worker", f"the only worker SIGSTOPped, --max_restarts=0: the chief names worker 0 within "
          f"{DEADLINE} s, the launcher's last line repeats it, exit 137",
          ps_launch(num_workers=1, num_ps=1, max_restarts=0), stopped_the_chief("worker", 0),
          fault=Fault("SIGSTOP worker 0 at step 400", freeze_task("worker", 0), at_step=400), **MULTI),
    error("ps_frozen_ps_fail_fast", "ps 0 SIGSTOPped, --max_restarts=0: one line naming ps 0, exit 137",
          ps_launch(max_restarts=0), stopped_the_chief("ps", 0),
          fault=Fault("SIGSTOP ps 0 at step 400", freeze_task("ps", 0), at_step=400), **MULTI),
    ok("ps_frozen_ps_briefly_waits", f"ps 1 SIGSTOPped 8 s (< the {DEADLINE} s deadline): the chief logs that it "
       "waits for it, then goes on; no restart", ps_launch(max_restarts=0),
       fault=Fault("SIGSTOP ps 1 for 8 s at step 600", freeze_task("ps", 1, seconds=8), at_step=600),
       check=all_of(in_output(r"waiting for ps 1 \(/job:ps/replica:0/task:1 at localhost:\d+\): no answer"),
                    not_in_output(r"restart \d|\] error: |Traceback"),
                    in_output(rf"done: steps 0 -> {PS_BASE['train.steps']}")), **MULTI),
]
