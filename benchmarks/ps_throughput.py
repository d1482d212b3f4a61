"""Parameter-server throughput: the recommendation example with 1 and 2 workers (and 2 ps), side by side.

    python -m benchmarks.ps_throughput [--rounds=2] [--steps=1200] [--window=200] [--config_arg=] [--json=FILE]

Each round runs, in turn: the default strategy in one process (no cluster: the reference), then
`python -m mwloop.launch --num_workers=W --num_ps=2` for W = 1 and 2, all through `mwloop.main` on
configs/recommend.py with the same per-step batch. Per run: examples/s = the median over the chief's
log windows (metrics.jsonl `examples_per_sec`), the first window (tracing, warm-up) left out. Ratios
are taken within a round (a load burst from other users hits its runs alike), then the median over
rounds is reported. Under parameter servers one step is one worker's batch, so examples/s counts every
worker's updates.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "recommend.py")


def run(workers: int, args: argparse.Namespace, workdir: str) -> float:
    """Median examples/s of one run: `workers` = 0 for the default strategy in one process."""
    config = f"{CONFIG}:{args.config_arg}" if args.config_arg else CONFIG
    flags = [f"--config={config}", f"--workdir={workdir}", f"--config.train.steps={args.steps}",
             f"--config.train.log_every_steps={args.window}", "--config.train.eval_every_steps=0",
             "--config.train.checkpoint_every_steps=0", "--config.export=False", "--mode=train"]
    if workers:
        command = [sys.executable, "-m", "mwloop.launch", f"--num_workers={workers}", "--num_ps=2", "--", *flags]
    else:
        command = [sys.executable, "-m", "mwloop.main", *flags, "--config.distribution.strategy=default"]
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    with open(workdir + ".log", "wb") as log:
        code = subprocess.run(command, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                              timeout=args.timeout_s).returncode
    if code:
        raise RuntimeError(f"{' '.join(command)} exited with {code}; see {workdir}.log")
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        speeds = [e["examples_per_sec"] for e in map(json.loads, f) if e.get("split") == "train"]
    return statistics.median(speeds[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--window", type=int, default=200)
    parser.add_argument("--config_arg", default="", help="configs/recommend.py's argument, e.g. large")
    parser.add_argument("--timeout_s", type=float, default=600)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    names = {0: "default (1 process)", 1: "ps: 1 worker, 2 ps", 2: "ps: 2 workers, 2 ps"}
    results: dict[int, list[float]] = {w: [] for w in names}
    with tempfile.TemporaryDirectory(prefix="ps-throughput-") as out:
        for r in range(args.rounds):
            for workers in names:
                speed = run(workers, args, os.path.join(out, f"r{r}-w{workers}"))
                results[workers].append(speed)
                print(f"round {r}: {names[workers]}: {speed:,.0f} examples/s", flush=True)
    two_vs_one = statistics.median(b / a for a, b in zip(results[1], results[2]))
    one_vs_default = statistics.median(a / d for d, a in zip(results[0], results[1]))
    print("\n| run | examples/s (median of rounds) |\n|---|---:|")
    for workers, name in names.items():
        print(f"| {name} | {statistics.median(results[workers]):,.0f} |")
    print(f"\n2 workers / 1 worker: {two_vs_one:.2f}; 1 worker (PS) / default: {one_vs_default:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"examples_per_sec": {names[w]: v for w, v in results.items()},
                       "two_vs_one_worker": two_vs_one, "ps_one_worker_vs_default": one_vs_default}, f, indent=2)


if __name__ == "__main__":
    main()
