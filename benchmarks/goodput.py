"""Goodput of a real 2-worker job, undisturbed and with workers SIGKILLed while the launcher restarts it.

    python -m benchmarks.goodput [--steps=1200] [--kill_every_s=15] [--kills=2]
        [--jobs=undisturbed,killed,improved,elastic] [--checkpoint_every=200] [--eval_every=400]

Up to four local jobs of configs/resnet.py:digits through `python -m mwloop.launch` (a checkpoint every 200 steps,
an eval every 400, unless told), `--num_workers=2` but for `elastic`:

- `undisturbed`: start to end, `--max_restarts=0`;
- `killed`: `--max_restarts=KILLS`, every task a fresh process (`--nowarm_starts`), a worker SIGKILLed `kills`
  times (below; worker 1 first: the chief ends on a lost peer, its `finally` runs; then worker 0, the chief
  itself: no end record);
- `improved`: `killed` again, with the launcher's warm starts (its default: every task forked from one process
  that imported TensorFlow once, mwloop.launcher.warm) and asynchronous checkpoints
  (`config.train.async_checkpoint=True`);
- `elastic`: `improved` as an elastic job, `--num_workers=2:3` (3 workers while all are there; global batches
  126 and 252, the nearest to 128 and 256 that divide among 2 and 3 workers), `--rejoin_s=10`: a kill shrinks
  the job to 2 (from the newest checkpoint), the killed place comes back 10 s after that and is admitted at the
  next checkpoint (a coordinated save, then a re-form to 3), well inside the kill interval.

The kills of `killed`, `improved` and `elastic`: `kill_every_s` seconds after training is (again) under way after
the previous kill (the first train log of worker 0 of the first round, or attempt, started since), a worker of the
round training then is SIGKILLed, worker 1 and worker 0 in turn, `kills` times; in `elastic` that round may be the
re-formed 3 or still the shrunk 2.

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


# The elastic job's killed place comes back this long after the job went on without it (after its round stopped),
# then at the next checkpoint (every 200 steps, a few seconds): back to 3 well inside a 60-s kill interval, so
# every kill meets the full job. The launcher's default, 60 s, would keep it at 2 until the next kill.
ELASTIC_REJOIN_S = 10.0
# The elastic job's global batches: 128 and 256 do not divide among 3 workers (mwloop.config.check).
ELASTIC_BATCHES = {"train.global_batch_size": 126, "eval.global_batch_size": 252}


def overrides(steps: int, job: str, checkpoint_every: int = 200, eval_every: int = 400) -> dict:
    """The config overrides of `job`."""
    return {"train.steps": steps, "train.checkpoint_every_steps": checkpoint_every,
            "train.eval_every_steps": eval_every,
            "train.log_every_steps": 50, "train.async_checkpoint": job in ("improved", "elastic"),
            **(ELASTIC_BATCHES if job == "elastic" else {})}


def _command(workdir: str, steps: int, max_restarts: int, job: str, intervals: dict | None = None) -> list[str]:
    warm_async = job in ("improved", "elastic")
    workers = ["--num_workers=2:3", f"--rejoin_s={ELASTIC_REJOIN_S:g}"] if job == "elastic" else ["--num_workers=2"]
    return [sys.executable, "-m", "mwloop.launch", *workers, f"--max_restarts={max_restarts}",
            *([] if warm_async else ["--nowarm_starts"]), "--",
            "--config=configs/resnet.py:digits", f"--workdir={workdir}",
            *(f"--config.{k}={v}" for k, v in overrides(steps, job, **(intervals or {})).items())]


# Each round (a fixed job's attempt, an elastic job's round) starts its workers in order: worker 0 opens it.
STARTED = re.compile(r"started worker (\d+) \(pid (\d+)\)")
TRAINING = re.compile(r"\[worker 0\] .*step \d+/")
# The launcher stops a round (an elastic job's coordinated save before it grows).
STOPPING = re.compile(r"waiting up to \d+s for \d+ task\(s\) to exit")


def _rounds(text: str) -> list[tuple[int, dict[str, int]]]:
    """The rounds the launcher's output `text` started so far: (where the round starts in it, worker -> pid)."""
    rounds: list[tuple[int, dict[str, int]]] = []
    for m in STARTED.finditer(text):
        if m[1] == "0":
            rounds.append((m.start(), {}))
        if rounds:
            rounds[-1][1][m[1]] = int(m[2])
    return rounds


def run_job(workdir: str, steps: int, kills: int, kill_every_s: float, job: str = "undisturbed",
            intervals: dict | None = None) -> tuple[tuple[float, float], list[str]]:
    """Runs one job to its end; returns when the launcher started and ended (time.time()) and what was killed
    when. `intervals`: `checkpoint_every` and `eval_every` (steps), if not the defaults of `overrides`."""
    started = time.time()
    proc = subprocess.Popen(_command(workdir, steps, kills, job, intervals), cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    killed: list[str] = []
    # The first round started since the last kill (0: the job's first), and when it first showed training.
    since, armed = 0, None
    while len(killed) < kills and proc.poll() is None:
        text = "".join(lines)
        rounds = _rounds(text)
        if armed is None:
            if len(rounds) > since and TRAINING.search(text, rounds[since][0]):
                armed = time.time()
        # Kill in a round that trains: not one being stopped or started by a re-form.
        elif time.time() - armed >= kill_every_s and TRAINING.search(text, rounds[-1][0]) and not STOPPING.search(
                text, rounds[-1][0]):
            worker = "1" if len(killed) % 2 == 0 else "0"  # a lost peer first, then the chief itself
            os.kill(rounds[-1][1][worker], signal.SIGKILL)
            killed.append(f"worker {worker} of {len(rounds[-1][1])} at {time.time() - started:.0f} s")
            since, armed = len(rounds), None
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
    for change in (e for e in events if e["split"] == "membership"):
        seconds = change["seconds_lost"]
        lost = "never trained" if seconds is None else f"{seconds:.1f} s to training again"
        print(f"  membership {change['workers_before']} -> {change['workers_after']} from step {change['step']}: "
              f"{lost}, {change['steps_redone']} step(s) redone ({change['why']})")
    if killed:
        _undisturbed(events, figures, len(killed))
    gap = abs(figures["wall_s"] - attributed) / figures["wall_s"]
    print(f"  productive + causes (unaccounted left out) = {attributed:.1f} s: {gap:.2%} off the wall time "
          f"({'within' if gap <= 0.02 else 'NOT within'} 2 %)")
    print(f"  outside the report: {first_process - launcher[0]:.1f} s from the launcher's start to the first chief's "
          f"process, {launcher[1] - figures['time']:.1f} s from the last end record to the launcher's exit (the "
          f"workers' exit)")


def _undisturbed(events: list[dict], figures: dict, kills: int) -> None:
    """Prints what an undisturbed run of the same steps would pay, from the measured causes: the first attempt's
    start-up and traces, every eval, save and the loop's Python (an upper bound of its wall time: the kills'
    coordinated saves and extra processes add to those too); the rest is what the kills cost, by cause."""
    found = goodput.attempts(events)
    first = found[0]
    startup_1 = first.clock.get("startup", first.start_time - first.process_start)
    compile_1 = goodput._loop_split(first.clock, goodput.steady_step_s(found))[1]
    pays = figures["productive_s"] + startup_1 + compile_1 + sum(figures[f"{c}_s"] for c in ("checkpoint", "eval",
                                                                                           "other"))
    costs = {"startup": figures["startup_s"] - startup_1, "compile": figures["compile_s"] - compile_1,
             **{c: figures[f"{c}_s"] for c in ("restart", "lost", "unaccounted")}}
    print(f"  undisturbed, the same steps: ~{pays:.1f} s, goodput ~{figures['productive_s'] / pays:.1%} (first "
          f"start-up {startup_1:.1f} s, first traces {compile_1:.1f} s); each of the {kills} kill(s) cost "
          f"{sum(costs.values()) / kills:.1f} s: " + ", ".join(f"{c} {v / kills:.1f} s" for c, v in costs.items()))
    print("  start-up per attempt: " + " + ".join(
        f"{a.clock.get('startup', a.start_time - a.process_start):.1f}{' (re-form)' if a.reform else ''}"
        for a in found))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--kill_every_s", type=float, default=15.0)  # ~1/3 of the undisturbed run's training
    parser.add_argument("--kills", type=int, default=2)
    parser.add_argument("--checkpoint_every", type=int, default=200, help="steps")
    parser.add_argument("--eval_every", type=int, default=400, help="steps")
    parser.add_argument("--jobs", default="undisturbed,killed,improved",
                        help="of undisturbed,killed,improved,elastic")
    args = parser.parse_args()
    base = tempfile.mkdtemp(prefix="mwloop-goodput-bench-")
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    for job in args.jobs.split(","):
        workdir = os.path.join(base, job)
        kills = 0 if job == "undisturbed" else args.kills
        launcher, killed = run_job(workdir, args.steps, kills, args.kill_every_s, job,
                                  {"checkpoint_every": args.checkpoint_every, "eval_every": args.eval_every})
        describe(job, workdir, launcher, killed)
        if kills:
            print(f"\n$ python -m mwloop.goodput {workdir}")
            sys.stdout.flush()
            subprocess.run([sys.executable, "-m", "mwloop.goodput", workdir], cwd=ROOT, env=ENV, check=True)
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
