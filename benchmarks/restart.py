"""What a restart costs: seconds from a worker's SIGKILL to the first train step after the launcher's restart.

    python -m benchmarks.restart [--code=DIR[,DIR...]] [--launcher_args="--nostandby;--standby"] [--jobs=2]
                                 [--kills=3] [--single=3]

For each checkout of mwloop in `--code` (default: this one; give a checkout of main and a branch to compare
them) and each set of launcher flags in `--launcher_args` (default: without and with `--standby`), taken in
turn `--jobs` times so that the machine's load falls on all alike:

- a 2-worker job of configs/resnet.py:digits through `python -m mwloop.launch --num_workers=2
  --max_restarts=KILLS`; in each attempt, once worker 0 has logged a step 300 past the attempt's start (a
  checkpoint every 200 steps: the restore has one) and `--kill_after_s` after its first train log line (a
  worker killed about every 40 s), a worker is SIGKILLed (worker 0, the chief, then worker 1, alternately),
  `--kills` times; after the last restart the launcher is stopped (SIGTERM);
- one process (`python -m mwloop.main`) trained past a checkpoint and SIGKILLed, then rerun `--single` times
  with the same command (each rerun resumes, trains 300 steps and is SIGKILLed too).

The workers run through benchmarks/restart_worker.py (`--module`), which prints when the imports were done;
everything else comes from the logs (absl timestamps) the launcher and the workers print anyway:

    stop old     the kill -> the launcher's "restart k/N" line (noticing the death, stopping the others)
    spawn        -> the launcher's "started worker 0" line of the new attempt
    python       -> the interpreter is up (restart_worker's first line of Python)
    imports      -> TensorFlow, Keras and mwloop imported
    cluster      -> "train_and_eval with ..." (flags, the config, the strategy: joining the cluster)
    build+restore-> "resumed from step N" (the settings agreement, model, optimizer, restore)
    loop set-up  -> the attempt record (metrics.jsonl: the input pipeline built, the workdir prepared)
    compile      the first loop call less its steps at the steady speed (tracing, graph optimisation)
    first step   one step at the steady speed (median of the attempt's later loop calls)

Single-process rows start at the Popen (no "stop old" or "spawn"). Median, min and max over all restarts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH_DIR)
STEPS_PER_LOOP = 50  # configs/resnet.py:digits
PHASES = ("stop old", "spawn", "python", "imports", "cluster", "build+restore", "loop set-up", "compile",
          "first step")
_ABSL = re.compile(r"^(?:\[worker (\d)\] )?[IWE](\d{4}) (\d\d):(\d\d):(\d\d\.\d+) ")


def _env(code: str) -> dict[str, str]:
    # restart_worker as a top-level module: the checkout's own `benchmarks` package must not hide it.
    return dict(os.environ, PYTHONPATH=f"{code}{os.pathsep}{BENCH_DIR}", GCE_METADATA_IP="127.0.0.1:9")


def _absl_time(line: str) -> float | None:
    """The epoch seconds of an absl log line (local time, this year), or None."""
    m = _ABSL.match(line)
    if not m:
        return None
    now = datetime.datetime.now()
    month, day = int(m[2][:2]), int(m[2][2:])
    second = float(m[5])
    when = datetime.datetime(now.year, month, day, int(m[3]), int(m[4]), int(second), round(second % 1 * 1e6))
    return when.timestamp()


class Job:
    """A process whose output lines are collected as they come."""

    def __init__(self, command: list[str], code: str):
        self.proc = subprocess.Popen(command, cwd=code, env=_env(code), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    def end(self, timeout_s: float = 120) -> None:
        """SIGTERM (the workers save and stop), SIGKILL after `timeout_s`; the output read to its end."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=10)


def _worker0_timeline(lines: list[str], prefix: str) -> dict:
    """From one attempt's lines of worker 0 (prefixed `prefix`): when each start-up mark was logged and the
    times and steps of its train log lines."""
    marks: dict = {"steps": []}
    for line in lines:
        if not line.startswith(prefix):
            continue
        text = line[len(prefix):]
        if text.startswith("restart-probe:"):
            parts = text.split()
            marks["python"], marks["imports"] = float(parts[2]), float(parts[4])
            continue
        when = _absl_time(text)
        if when is None:
            continue
        if "train_and_eval with" in text or "train with" in text:
            marks.setdefault("cluster", when)
        elif (m := re.search(r"resumed from step (\d+)", text)):
            marks.setdefault("build+restore", when)
            marks["start_step"] = int(m[1])
        elif (m := re.search(r"\] step (\d+)/", text)):
            marks["steps"].append((when, int(m[1])))
    return marks


def _phases(marks: dict, train_start: float | None, before: dict[str, float]) -> dict[str, float] | None:
    """Seconds per phase of one restart, from `before` (kill, restart line, spawn: whatever is known) and
    worker 0's marks; None if the attempt never logged enough."""
    steps = marks["steps"]
    if len(steps) < 3 or "build+restore" not in marks or train_start is None:
        return None
    intervals = [(t2 - t1) / (s2 - s1) for (t1, s1), (t2, s2) in zip(steps[1:], steps[2:]) if s2 > s1]
    step_s = statistics.median(intervals)
    first_call = steps[0][0] - train_start
    points = [*before.items(), ("python", marks["python"]), ("imports", marks["imports"]),
              ("cluster", marks["cluster"]), ("build+restore", marks["build+restore"]), ("loop set-up", train_start)]
    phases = {name: t - points[i - 1][1] for i, (name, t) in enumerate(points) if i > 0}
    phases["compile"] = first_call - STEPS_PER_LOOP * step_s
    phases["first step"] = step_s
    return phases


def _attempt_records(workdir: str) -> dict[int, float]:
    """pid -> the time of its attempt record (training starts), from metrics.jsonl."""
    found = {}
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("split") == "attempt":
                found[event["clock"]["pid"]] = event["time"]
    return found


def multi_worker_job(code: str, workdir: str, kills: int, launcher_args: list[str],
                     kill_after_s: float) -> list[dict[str, float]]:
    """One launcher job with `kills` SIGKILLs; the phases of each restart."""
    job = Job([sys.executable, "-m", "mwloop.launch", "--num_workers=2", f"--max_restarts={kills}", *launcher_args,
               "--module=restart_worker", "--", "--config=configs/resnet.py:digits", f"--workdir={workdir}",
               "--config.train.steps=1000000", f"--config.train.log_every_steps={STEPS_PER_LOOP}"], code)
    killed: list[tuple[float, int]] = []  # (when, index of the first line after it)
    try:
        deadline = time.time() + 300 * (kills + 1)
        while time.time() < deadline and job.proc.poll() is None:
            time.sleep(0.05)
            lines = list(job.lines)
            starts = [i for i, line in enumerate(lines) if re.search(r"started worker 0 \(pid (\d+)\)", line)]
            if len(starts) <= len(killed):
                continue  # the restart after the last kill has not started yet
            marks = _worker0_timeline(lines[starts[-1]:], "[worker 0] ")
            begin = marks.get("start_step", 0)
            steps = marks["steps"]
            if len(steps) >= 4 and steps[-1][1] >= begin + 300 and time.time() - steps[0][0] >= kill_after_s:
                if len(killed) == kills:
                    break  # the last restart has trained a while: enough to measure it
                worker = len(killed) % 2  # the chief first, then a lost peer
                pid = int(re.findall(rf"started worker {worker} \(pid (\d+)\)", "".join(lines[starts[-1]:]))[0])
                killed.append((time.time(), len(lines)))
                os.kill(pid, signal.SIGKILL)
    finally:
        job.end()
        if os.environ.get("RESTART_BENCH_LOG"):  # a job's whole output, for a look at what happened
            with open(f"{os.environ['RESTART_BENCH_LOG']}/{os.path.basename(workdir)}.log", "w") as f:
                f.writelines(job.lines)
    if len(killed) < kills:
        raise SystemExit(f"only {len(killed)} of {kills} kills happened:\n{''.join(job.lines)[-4000:]}")
    records = _attempt_records(workdir)
    results = []
    for n, (when, index) in enumerate(killed):
        after = job.lines[index:]
        restart = next(_absl_time(line) for line in after if re.search(r"restart \d+/\d+:", line))
        spawn_line = next(line for line in after if "started worker 0 (pid" in line)
        pid = int(re.search(r"pid (\d+)", spawn_line)[1])
        start = after.index(spawn_line)
        # This attempt's lines only: up to the next attempt's start.
        end = next((i for i in range(start + 1, len(after)) if "started worker 0 (pid" in after[i]), len(after))
        marks = _worker0_timeline(after[start:end], "[worker 0] ")
        phases = _phases(marks, records.get(pid), {"kill": when, "stop old": restart,
                                                   "spawn": _absl_time(spawn_line)})
        if phases:
            phases["killed worker"] = float(n % 2)  # kept in --json, not in the table
            results.append(phases)
    return results


def single_process_restarts(code: str, workdir: str, count: int) -> list[dict[str, float]]:
    """One process trained past its first checkpoint and SIGKILLed, then `count` times started again in the same
    workdir (the same command: a crash's rerun) and SIGKILLed once it trained a while; the phases of each rerun."""
    command = [sys.executable, "-m", "restart_worker", "--config=configs/resnet.py:digits", f"--workdir={workdir}",
               "--config.train.steps=1000000", f"--config.train.log_every_steps={STEPS_PER_LOOP}"]
    results = []
    for i in range(count + 1):
        started = time.time()
        job = Job(command, code)
        deadline = started + 600
        while time.time() < deadline and job.proc.poll() is None:
            time.sleep(0.05)
            marks = _worker0_timeline(list(job.lines), "")
            if len(marks["steps"]) >= 4 and marks["steps"][-1][1] >= marks.get("start_step", 0) + 300:
                break
        job.proc.kill()
        job.end()
        if "build+restore" not in marks and i:
            raise SystemExit(f"a single-process rerun did not resume:\n{''.join(job.lines)[-4000:]}")
        if i:  # the first run only makes the checkpoint
            phases = _phases(marks, _attempt_records(workdir).get(job.proc.pid), {"popen": started})
            if phases:
                results.append(phases)
    return results


def table(title: str, runs: list[dict[str, float]]) -> str:
    """Median, min and max per phase and of the total, as a Markdown table."""
    rows = [f"{title} ({len(runs)} restarts)", "", "| phase | median s | min s | max s |", "|---|---:|---:|---:|"]
    for phase in (*PHASES, "total"):
        values = [sum(r.get(p, 0.0) for p in PHASES) if phase == "total" else r[phase] for r in runs
                  if phase == "total" or phase in r]
        if values:
            rows.append(f"| {phase} | {statistics.median(values):.2f} | {min(values):.2f} | {max(values):.2f} |")
    # The steady step also says what the spares' imports cost the attempt they overlap (they run while it trains).
    steps_ms = sorted(r["first step"] * 1000 for r in runs)
    if steps_ms:
        rows.append(f"\nsteady step of the restarted attempts (its first {STEPS_PER_LOOP * 4}+ steps): median "
                    f"{statistics.median(steps_ms):.1f} ms, min {steps_ms[0]:.1f}, max {steps_ms[-1]:.1f}")
    return "\n".join(rows)


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--code", default=ROOT, help="checkouts of mwloop to measure, comma-separated")
    parser.add_argument("--jobs", type=int, default=2, help="multi-worker jobs per checkout (taken in turn)")
    parser.add_argument("--kills", type=int, default=3, help="SIGKILLs per multi-worker job")
    parser.add_argument("--single", type=int, default=3, help="single-process resumes per checkout and round")
    parser.add_argument("--kill_after_s", type=float, default=20.0,
                        help="an attempt trains at least this long (from its first train log line) before a kill")
    parser.add_argument("--launcher_args", default="--nostandby;--standby",
                        help="sets of flags for mwloop.launch to compare, ';'-separated")
    parser.add_argument("--json", help="also write every restart's phases to this file")
    args = parser.parse_args()
    codes = [os.path.abspath(c) for c in args.code.split(",")]
    variants = args.launcher_args.split(";")
    peers = [(code, flags) for code in codes for flags in variants]  # the single process takes no launcher flags
    base = tempfile.mkdtemp(prefix="mwloop-restart-bench-")
    multi: dict[str, list] = {f"{c} {f}".strip(): [] for c, f in peers}
    single: dict[str, list] = {c: [] for c in codes}
    print(f"uptime: {_uptime()}", flush=True)
    try:
        for round_ in range(args.jobs):
            for n, (code, flags) in enumerate(peers):
                workdir, peer = os.path.join(base, f"multi-{round_}-{n}"), f"{code} {flags}".strip()
                multi[peer] += multi_worker_job(code, workdir, args.kills, flags.split(), args.kill_after_s)
                print(f"round {round_} {peer}: {len(multi[peer])} multi-worker restarts; uptime: {_uptime()}",
                      flush=True)
                if args.single and flags == variants[0]:
                    workdir = os.path.join(base, f"single-{round_}-{n}")
                    single[code] += single_process_restarts(code, workdir, args.single)
                    print(f"round {round_} {code}: {len(single[code])} single-process resumes", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    for peer, runs in multi.items():
        print(f"\n{table(f'2 workers, kill -> first step: {peer}', runs)}")
    for code in codes:
        if single[code]:
            print(f"\n{table(f'1 process, start -> first step of a resume: {code}', single[code])}")
    print(f"\nuptime: {_uptime()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"multi": multi, "single": single}, f, indent=1)


if __name__ == "__main__":
    main()
