"""Fault cases of issue 29 for elastic local jobs (`mwloop.launch --num_workers=2:3`): a worker killed, given
notice, frozen, the launcher signalled, a batch that does not divide among every count, a user error. Joined to
`fault_cases.CASES`."""

from __future__ import annotations

import signal

from tests.stress.fault_harness import Case, Fault, error, ok, send, send_worker, workers
from tests.stress.fault_steps import (
    LAUNCHED,
    all_of,
    freeze,
    in_output,
    main,
    not_in_output,
    resumed_where_saved,
    train_events_once,
)

# 3 workers share the global batch: 48 and 96 divide among 2 and 3 replicas alike.
ELASTIC = dict(LAUNCHED, **{"train.global_batch_size": 48, "eval.global_batch_size": 96})
MULTI = {"multi": True, "timeout": 400.0, "fresh_stays_empty": False}


def elastic(*extra: str, launcher: tuple[str, ...] = (), bounds: str = "2:3") -> list[str]:
    """`mwloop.launch --num_workers=2:3` (no place back: --rejoin_s=inf) around `mwloop.main` arguments."""
    return ["mwloop.launch", f"--num_workers={bounds}", "--grace_s=10", "--rejoin_s=inf", "--wait_for_min_s=20",
            *launcher, "--", *main("--mode=train", *extra, base=ELASTIC)[1:]]


def freeze_worker(index: int):
    """Worker `index` of the launcher SIGSTOPped for good (the launcher's stop then has to SIGKILL it)."""
    def act(proc) -> None:
        freeze(workers(proc)[index].pid, None)
        proc.facts = {"frozen": f"worker {index}"}
    return act


def finished_with(before: int, after: int, why: str):
    return all_of(in_output(rf"membership: workers {before} -> {after} from step \d+ \({why}"),
                  in_output(rf"done: steps \d+ -> {ELASTIC['train.steps']} of {ELASTIC['train.steps']}"),
                  in_output(rf"all {after} workers finished"), not_in_output(r"Traceback"), train_events_once)


CASES: list[Case] = [
    ok("elastic_sigkill_worker", "3 -> 2 from the newest checkpoint, finishes, each step logged once",
       elastic(), fault=Fault("SIGKILL to worker 2 at step 1500", send_worker(2, signal.SIGKILL), at_step=1500),
       check=finished_with(3, 2, r"worker 2 exited with -9"), **MULTI),
    ok("elastic_sigterm_worker", "all save at one step; 3 -> 2 resumes there (no step lost), finishes",
       elastic(), fault=Fault("SIGTERM to worker 1 at step 1500", send_worker(1, signal.SIGTERM), at_step=1500),
       check=all_of(finished_with(3, 2, r"worker 1 given notice"), resumed_where_saved), **MULTI),
    ok("elastic_sigkill_chief", "3 -> 2, the new worker 0 resumes from the chief's directory, finishes",
       elastic(), fault=Fault("SIGKILL to worker 0 at step 1500", send_worker(0, signal.SIGKILL), at_step=1500),
       check=finished_with(3, 2, r"worker 0 exited with -9"), **MULTI),
    ok("elastic_sigstop_worker", "the frozen worker is named (not the survivor that saw it), 3 -> 2, finishes",
       elastic(), fault=Fault("SIGSTOP to worker 1 at step 1500 (for good)", freeze_worker(1), at_step=1500),
       check=finished_with(3, 2, r"worker 1 stopped answering"), **MULTI),
    ok("elastic_sigterm_launcher", "every worker saves at one step, exit 143; an elastic rerun resumes there",
       elastic(), fault=Fault("SIGTERM to the launcher at step 1500", send(signal.SIGTERM), at_step=1500),
       codes=(143,), rerun=elastic(), check=resumed_where_saved, **MULTI),
    ok("elastic_no_losses_left", "--max_restarts=0: exit 137 with one line; an elastic rerun finishes",
       elastic(launcher=("--max_restarts=0",)),
       fault=Fault("SIGKILL to worker 2 at step 1500", send_worker(2, signal.SIGKILL), at_step=1500),
       codes=(137,), rerun=elastic(),
       check=in_output(r"error: worker 2 exited with -9 \(SIGKILL\); stopped all workers \(0 of --max_restarts=0",
                       0), **MULTI),
    error("elastic_batch_not_divisible", "names the worker counts that fail and batch sizes that work",
          elastic("--config.train.global_batch_size=64"), r"global_batch_size=64 does not divide among the "
          r"replicas of 3 worker\(s\).*--num_workers=2:3.*multiple of 6, e\.g\. 60 or 66",
          check=not_in_output(r"membership|restart \d"), **MULTI),
    error("elastic_user_error_not_restarted", "unknown key, exit 2, no re-form", elastic("--config.train.stepz=3"),
          r"stepz", check=not_in_output(r"membership"), **MULTI),
    error("elastic_bad_bounds", "--num_workers=3:2 rejected before anything starts", elastic(bounds="3:2"),
          r"num_workers.*MIN:MAX", check=not_in_output(r"started worker")),
]
