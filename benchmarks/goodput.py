"""Goodput of a real 2-worker job, undisturbed and with workers SIGKILLed while the launcher restarts it.

    python -m benchmarks.goodput [--steps=1200] [--kill_every_s=15] [--kills=2] [--jobs=undisturbed,killed,improved]

Up to three local jobs of configs/resnet.py:digits through `python -m mwloop.launch --num_workers=2` (a checkpoint
every 200 steps, an eval every 400):

- `undisturbed`: start to end, `--max_restarts=0`;
- `killed`: `--max_restarts=KILLS`, every task a fresh process (`--nowarm_starts`); `kill_every_s` seconds after
  each attempt's first train log a worker is SIGKILLed (worker 1 first: the chief ends on a lost peer, its
  `finally` runs; then worker 0, the chief itself: no end record), up to `kills` times;
- `improved`: `killed` again, with the launcher's warm starts (its default: every task forked from one process
  that imported TensorFlow once, mwloop.launcher.warm) and asynchronous checkpoints
  (`config.train.async_checkpoint=True`).

For each: the goodput event's figures (metrics.jsonl), the wall time the launcher took (measured here), and
whether productive time plus the causes other than `unaccounted` come within 2 % of the report's wall time.
Then the killed run's report read back from its workdir alone: `python -m mwloop.goodput DIR`.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from mwloop.artifacts import files, goodput

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", GCE_METADATA_IP="127.0.0.1:9")


def _command(workdir: str, steps: int, max_restarts: int, improved: bool) -> list[str]:
    overrides = {"train.steps": steps, "train.checkpoint_every_steps": 200, "train.eval_every_steps": 400,
                 "train.log_every_steps": 50, "train.async_checkpoint": improved}
    return [sys.executable, "-m", "mwloop.launch", "--num_workers=2", f"--max_restarts={max_restarts}",
            *([] if improved else ["--nowarm_starts"]), "--",
            "--config=configs/resnet.py:digits", f"--workdir={workdir}",
            *(f"--config.{k}={v}" for k, v in overrides.items())]


def run_job(workdir: str, steps: int, kills: int, kill_every_s: float,
            improved: bool = False) -> tuple[tuple[float, float], list[str]]:
    """Runs one job to its end; returns when the launcher started and ended (time.time()) and what was killed
    when."""
    started = time.time()
    proc = subprocess.Popen(_command(workdir, steps, kills, improved), cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    killed: list[str] = []
    armed: tuple[int, float] | None = None  # (attempt, when its first train log showed)
    while len(killed) < kills and proc.poll() is None:
        text = "".join(lines)
        starts = list(re.finditer(r"started worker (\d) \(pid (\d+)\)", text))
        attempt = len(starts) // 2  # attempts started so far (two workers each)
        if attempt == len(killed) + 1:  # the current attempt has not been hit yet
            if armed is None or armed[0] != attempt:
                if re.search(r"\[worker 0\] .*step \d+/", text[starts[2 * attempt - 2].start():]):
                    armed = (attempt, time.time())
            elif time.time() - armed[1] >= kill_every_s:
                worker = 1 if len(killed) % 2 == 0 else 0  # a lost peer first, then the chief itself
                os.kill(int(next(m[2] for m in reversed(starts) if m[1] == str(worker))), signal.SIGKILL)
                killed.append(f"worker {worker} at {time.time() - started:.0f} s")
        time.sleep(0.1)
    code = proc.wait(timeout=1800)
    reader.join(timeout=10)
    if code != 0:
        raise SystemExit(f"the job exited with {code}:\n{''.join(lines)[-4000:]}")
    return (started, time.time()), killed


def describe(name: str, workdir: str, launcher: tuple[float, float], killed: list[str]) -> None:
    events = files.read_metrics(workdir)
    figures = [e for e in events if e["split"] == goodput.GOODPUT][-1]
    first_process = min(e["clock"]["process_start"] for e in events if e["split"] == goodput.ATTEMPT)
    launcher_wall = launcher[1] - launcher[0]
    attributed = figures["productive_s"] + sum(figures[f"{c}_s"] for c in goodput.CAUSES if c != "unaccounted")
    hits = "; killed " + ", ".join(killed) if killed else ""
    print(f"\n{name}: goodput {figures['goodput']:.1%}, wall {figures['wall_s']:.1f} s (the launcher ran "
          f"{launcher_wall:.1f} s), {figures['attempts']:.0f} attempt(s){hits}")
    print(f"  productive {figures['productive_s']:.1f} s; " + ", ".join(
        f"{c} {figures[f'{c}_s']:.1f} s" for c in goodput.CAUSES) + f"; lost steps {figures['lost_steps']:.0f}")
    gap = abs(figures["wall_s"] - attributed) / figures["wall_s"]
    print(f"  productive + causes (unaccounted left out) = {attributed:.1f} s: {gap:.2%} off the wall time "
          f"({'within' if gap <= 0.02 else 'NOT within'} 2 %)")
    print(f"  outside the report: {first_process - launcher[0]:.1f} s from the launcher's start to the first chief's "
          f"process, {launcher[1] - figures['time']:.1f} s from the last end record to the launcher's exit (the "
          f"workers' exit)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--kill_every_s", type=float, default=15.0)  # ~1/3 of the undisturbed run's training
    parser.add_argument("--kills", type=int, default=2)
    parser.add_argument("--jobs", default="undisturbed,killed,improved")
    args = parser.parse_args()
    base = tempfile.mkdtemp(prefix="mwloop-goodput-bench-")
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    for job in args.jobs.split(","):
        workdir = os.path.join(base, job)
        kills = 0 if job == "undisturbed" else args.kills
        launcher, killed = run_job(workdir, args.steps, kills, args.kill_every_s, improved=job == "improved")
        describe(job, workdir, launcher, killed)
        if kills:
            print(f"\n$ python -m mwloop.goodput {workdir}")
            sys.stdout.flush()
            subprocess.run([sys.executable, "-m", "mwloop.goodput", workdir], cwd=ROOT, env=ENV, check=True)
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
