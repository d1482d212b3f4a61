"""What an elastic re-form costs, by phase: seconds from a worker's SIGKILL to the next training step.

    python -m benchmarks.reform [--kills=5] [--parts=local,agents] [--modes=warm,cold] [--ttl_s=10]

For each part and each mode (`warm`: the default warm starts; `cold`: `--nowarm_starts`, every task a fresh
`python`), taken in turn so that the machine's load falls on all alike, one real job of configs/mlp.py
(a checkpoint every 40 steps, a log line every 10) whose worker is SIGKILLed `--kills` times:

- `local`: `mwloop.launch --num_workers=1:2 --rejoin_s=2`: worker 1 is killed while 2 train; the job re-forms
  with 1, its place comes back 2 s later at the next checkpoint (a coordinated save), and the next kill follows;
- `agents`: 3 agents (`--rdzv`, one worker each, `--num_workers=2:3`) on a throwaway etcd; the worker of the
  last member is killed: its agent posts the failure, the leader re-forms the same 3 (a restart, counted
  against --max_restarts);
- `hosts`: the same 3 agents, but the last member's machine is lost (SIGKILL to its agent's process group: the
  agent and its workers); its lease runs out after `--ttl_s` and the other two re-form; a new agent then
  joins and is admitted at a checkpoint before the next kill.

The phases come from the lines the launcher, the agents and the new round's worker 0 print anyway, each stamped
when it arrived here:

    detect       the kill -> the loss seen (local: "lost N worker(s)"; agents: "lost a member" on any agent;
                 hosts: that, or the survivors' workers' exits when they find their peer gone first)
    stop         -> the old round's workers stopped ("worker exits", the last agent's)
    start        -> worker 0 of the new round runs mwloop's training ("train ... with": the process, imports)
    restore      -> "resumed from step N" (the cluster joined, the model built, the checkpoint restored)
    first trace  -> its first train log line (the first loop call: tracing and 10 steps)

Median (min-max) per phase and in all, over every kill of every job of that part and mode.
"""

from __future__ import annotations

import argparse
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ("detect", "stop", "start", "restore", "first trace")
CONFIG = {"train.steps": 10**7, "train.global_batch_size": 48, "eval.global_batch_size": 96,
          "train.checkpoint_every_steps": 40, "train.steps_per_loop": 10, "train.log_every_steps": 10,
          "train.eval_every_steps": 10**7, "train.max_to_keep": 3}


class Lines:
    """A process's output lines, each with the time.time() it arrived; read by a thread."""

    def __init__(self, command: list[str], name: str, **popen):
        self.name, self.lines, self._lock = name, [], threading.Lock()
        env = dict(os.environ, PYTHONPATH=ROOT, GCE_METADATA_IP="127.0.0.1:9", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, errors="replace", start_new_session=True, **popen)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._lock:
                self.lines.append((time.time(), line.rstrip("\n")))

    def after(self, since: float) -> list[tuple[float, str]]:
        with self._lock:
            return [(t, line) for t, line in self.lines if t >= since]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _first(streams: list[Lines], since: float, pattern: str, timeout_s: float = 180) -> tuple[float, re.Match]:
    """(arrival, match) of the first line matching `pattern` in any stream that arrived at or after `since`."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        found = [(t, m) for s in streams for t, line in s.after(since) if (m := re.search(pattern, line))]
        if found:
            return min(found, key=lambda f: f[0])
        if any(s.proc.poll() is not None for s in streams):
            raise RuntimeError(f"a process ended while waiting for {pattern!r}: "
                               + "\n".join(line for s in streams for _, line in s.lines[-30:]))
        time.sleep(0.05)
    raise RuntimeError(f"no {pattern!r} within {timeout_s} s:\n"
                       + "\n".join(line for s in streams for _, line in s.lines[-30:]))


def _last_before(streams: list[Lines], since: float, until: float, pattern: str) -> float:
    found = [t for s in streams for t, line in s.after(since) if t <= until and re.search(pattern, line)]
    return max(found) if found else since


def _phases(streams: list[Lines], killed_at: float, detect: str) -> dict[str, float]:
    """The seconds of each phase of the re-form after the kill at `killed_at` (see the module docstring)."""
    seen, _ = _first(streams, killed_at, detect)
    resumed, _ = _first(streams, seen, r"\[worker 0\] .*resumed from step \d+")
    started, _ = _first(streams, seen, r"\[worker 0\] .*train(_and_eval)? with")
    stopped = _last_before(streams, seen, started, r"worker exits: ")
    stepped, _ = _first(streams, resumed, r"\[worker 0\] .*\bstep \d+/")
    marks = [killed_at, seen, stopped, started, resumed, stepped]
    phases = {name: marks[i + 1] - marks[i] for i, name in enumerate(PHASES)}
    phases["total"] = stepped - killed_at
    return phases


def _worker_args(workdir: str) -> list[str]:
    return ["--config=configs/mlp.py", f"--workdir={workdir}", *(f"--config.{k}={v}" for k, v in CONFIG.items())]


def _kill_worker(streams: list[Lines], index: int, since: float) -> float:
    """SIGKILLs the newest worker `index` once the job trains with it past a checkpoint; when."""
    _first(streams, since, r"\[worker 0\] .*\bstep ([6-9]\d|\d{3,})/")
    pids = [int(m[1]) for s in streams for _, line in s.after(0)
            if (m := re.search(rf"started worker {index} \(pid (\d+)\)", line))]
    killed_at = time.time()
    os.kill(pids[-1], signal.SIGKILL)
    return killed_at


def run_local(mode: str, kills: int, directory: str) -> list[dict[str, float]]:
    flags = ["--num_workers=1:2", "--rejoin_s=2", "--grace_s=10", "--max_restarts=100", "--wait_for_min_s=60",
             "--network=host", *(["--nowarm_starts"] if mode == "cold" else [])]
    job = Lines([sys.executable, "-m", "mwloop.launch", *flags, "--", *_worker_args(directory)], "local")
    results = []
    try:
        since = 0.0
        for _ in range(kills):
            # A round of 2 that trains (the first, or the grow after the last kill).
            if results:
                since, _ = _first([job], since, r"membership: workers 1 -> 2")
            killed_at = _kill_worker([job], 1, since)
            results.append(_phases([job], killed_at, r"round of 2 lost 1 worker"))
            since = killed_at
            print(f"  local {mode}: " + ", ".join(f"{k} {v:.1f}" for k, v in results[-1].items()), flush=True)
    finally:
        job.stop()
    return results


def run_agents(mode: str, kills: int, directory: str, ttl_s: int, hosts: bool = False) -> list[dict[str, float]]:
    sys.path.insert(0, ROOT)
    from tests.services import etcd
    server = etcd.start()
    url = server.rendezvous_url(f"reform-{mode}")
    flags = ["--num_workers=2:3", f"--rdzv={url}", f"--rdzv_ttl_s={ttl_s}", "--grace_s=10", "--max_restarts=100",
             "--wait_for_min_s=120", *(["--nowarm_starts"] if mode == "cold" else [])]
    def agent(i: int) -> Lines:
        return Lines([sys.executable, "-m", "mwloop.launch", *flags, f"--host_id=m{i}", "--",
                      *_worker_args(directory)], f"m{i}")

    agents = [agent(i) for i in range(3)]
    results = []
    try:
        since = 0.0
        for kill in range(kills):
            since, found = _first(agents, since, r"round \d+: 3 workers on (\w+), (\w+), (\w+)")
            if hosts:
                _first(agents, since, r"\[worker 0\] .*\bstep ([6-9]\d|\d{3,})/")
                victim = next(a for a in agents if a.name == found[3])
                killed_at = time.time()
                os.killpg(victim.proc.pid, signal.SIGKILL)
                agents.remove(victim)
            else:
                killed_at = _kill_worker(agents, 2, since)
            # A lost machine: its lease runs out ("lost a member"), or first the others' workers find their peer
            # gone and exit (their agents then restart the round, whose gather leaves the lost one out).
            results.append(_phases(agents, killed_at, r"round \d+ lost a member|worker exits: " if hosts
                                   else r"round \d+ lost a member"))
            since = killed_at
            if hosts:
                agents.append(agent(3 + kill))
            print(f"  {'hosts' if hosts else 'agents'} {mode}: " + ", ".join(f"{k} {v:.1f}" for k, v in
                                                                          results[-1].items()), flush=True)
    finally:
        for agent in agents:
            agent.stop()
        server.stop()
    return results


def _table(rows: dict[str, list[dict[str, float]]]) -> str:
    names = [*PHASES, "total"]
    out = ["| job | kills | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for label, results in rows.items():
        cells = []
        for name in names:
            values = [r[name] for r in results]
            cells.append(f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})" if values else "-")
        out.append(f"| {label} | {len(results)} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--parts", default="local,agents")
    parser.add_argument("--modes", default="warm,cold")
    parser.add_argument("--ttl_s", type=int, default=10)
    args = parser.parse_args()
    rows: dict[str, list[dict[str, float]]] = {}
    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    for part in args.parts.split(","):
        for mode in args.modes.split(","):
            directory = tempfile.mkdtemp(prefix=f"reform-{part}-{mode}-")
            try:
                results = (run_local(mode, args.kills, directory) if part == "local"
                           else run_agents(mode, args.kills, directory, args.ttl_s, hosts=part == "hosts"))
            finally:
                shutil.rmtree(directory, ignore_errors=True)
            rows[f"{part}, {mode}"] = results
    print(f"\n{started}-{time.strftime('%H:%M', time.gmtime())} UTC, load average {os.getloadavg()[0]:.1f} at the end; "
          "seconds, median (min-max):\n")
    print(_table(rows))


if __name__ == "__main__":
    main()
