"""A stand-in for `mwloop.main` in sweep tests that are about the agent, not training: it takes the same
--workdir and --config.train.steps flags, "trains" by sleeping, writes an eval to metrics.jsonl every 10 steps,
prints a line per step to its log, and on SIGTERM exits 42 as a saved run does; with FAKE_TRAINER_COST set, a
cost/params of learning_rate * 10000 at the end. Each start appends one line
to started.txt in its workdir (how many times a trial was started)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

STEP_S = 0.1


def main(argv: list[str]) -> int:
    flags = dict(a.lstrip("-").split("=", 1) for a in argv if "=" in a)
    workdir, steps = flags["workdir"], int(flags.get("config.train.steps", 50))
    rate = float(flags.get("config.optimizer.learning_rate", 0.1))
    os.makedirs(workdir, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(42))
    with open(os.path.join(workdir, "started.txt"), "a") as f:
        f.write(f"{os.getpid()}\n")
    for step in range(1, steps + 1):
        time.sleep(STEP_S)
        print(f"step {step}", flush=True)
        if step % 10 == 0 or step == steps:
            with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps({"step": step, "split": "eval", "accuracy": rate * step / steps}) + "\n")
    if os.environ.get("FAKE_TRAINER_COST"):
        # What mwloop.run.cost records: a weight count that grows with the rate (accuracy against cost).
        with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({"step": steps, "split": "cost", "params": rate * 10000}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
