"""Fault cases of issue 31 for the study's database and the sweep's reports: a real PostgreSQL stopped for 20 s
mid-study (the agents wait, say what for, and finish the study with its exact budget, nothing run twice), and a
second sweep runner on a busy sweep directory (one line). Joined to `fault_cases.CASES`."""

from __future__ import annotations

import csv
import os
import threading
import time

from tests.stress.fault_harness import Case, Ctx, Fault, Run, error, ok
from tests.stress.fault_steps import all_of, in_output, not_in_output

OUTAGE_S = 20.0
SWEEP_DIR = "{dir}/sweep"
# Two trials of configs/mlp.py at a time, long enough (one step per loop call) to be running when the server stops.
GRID = """from mwloop.sweep import product
CONFIG = "configs/mlp.py"
def get_sweep():
    common = {"train.steps": [600], "train.steps_per_loop": [1], "train.log_every_steps": [100],
              "train.eval_every_steps": [200], "train.checkpoint_every_steps": [200]}
    return product(common, {"optimizer.learning_rate": [0.1, 0.2, 0.3]})
"""
SWEEP = ["mwloop.sweep", f"--workdir={SWEEP_DIR}", "--sweep={dir}/grid.py"]


def _grid(ctx: Ctx) -> None:
    ctx.write("grid.py", GRID)


def _postgres(ctx: Ctx) -> None:
    """The sweep's own PostgreSQL server (stopped after the case) and its grid file."""
    from tests.services import postgres

    _grid(ctx)
    server = postgres.start()
    ctx.closers.append(server.stop)
    ctx.vars["storage"], ctx.vars["server"] = server.url, server


def _halt_postgres(proc) -> None:
    """The server stopped for OUTAGE_S, then started again on its data (in the background: the harness goes on
    reading the sweep's output meanwhile)."""
    server = _SERVERS[-1]

    def outage() -> None:
        server.halt()
        time.sleep(OUTAGE_S)
        server.resume()
    threading.Thread(target=outage, daemon=True).start()


_SERVERS: list = []  # the running case's server (a fault's action sees the process, not the Ctx)


def _postgres_for_fault(ctx: Ctx) -> None:
    _postgres(ctx)
    _SERVERS.append(ctx.vars["server"])
    ctx.closers.append(_SERVERS.clear)


def _busy(ctx: Ctx) -> None:
    """The sweep directory held by a first runner (this process: the lock is a process's)."""
    from mwloop.artifacts import workdir_lock

    _grid(ctx)
    ctx.closers.append(workdir_lock.acquire(ctx.path("sweep")).close)


def _budget_once(ctx: Ctx, runs: list[Run]) -> str | None:
    """results.csv: the 3 points complete; each trial's log.txt: one attempt (nothing failed as stale, rerun)."""
    with open(ctx.path("sweep", "results.csv")) as f:
        rows = list(csv.DictReader(f))
    if sorted(r["status"] for r in rows) != ["complete"] * 3:
        return f"results.csv: {[(r['name'], r['status']) for r in rows]}"
    for row in rows:
        with open(os.path.join(ctx.path("sweep", row["name"]), "log.txt")) as f:
            attempts = sum(line.startswith("=== ") for line in f)
        if attempts != 1:
            return f"{row['name']} started {attempts} times"
    return None


CASES: list[Case] = [
    ok("sweep_postgres_outage", f"PostgreSQL stopped {OUTAGE_S:.0f} s mid-trial: the agents say what they wait for "
       "and until when, the trials train on, the study completes with its 3 trials, none run twice",
       SWEEP + ["--storage={storage}", "--study=outage", "--parallel=2", "--heartbeat_s=2"],
       setup=_postgres_for_fault, fault=Fault(f"PostgreSQL stopped for {OUTAGE_S:.0f} s", _halt_postgres,
                                              on=r"trial 1 started"),
       check=all_of(in_output(r"storage postgresql\+psycopg2://mwloop@127\.0\.0\.1:\d+/mwloop does not answer .*"
                              r"waiting for it since \d\d:\d\d:\d\d, until \d\d:\d\d:\d\d"),
                    in_output(r"is back after \d+s"), not_in_output(r"Traceback|StorageInternalError"),
                    _budget_once),
       timeout=600),
    error("sweep_workdir_busy", "a second runner on a busy sweep directory: one line naming its holder", SWEEP,
          r"error: workdir .*/sweep is in use by a live run \(pid \d+", setup=_busy, fresh_stays_empty=False),
]
