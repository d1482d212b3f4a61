"""False lease losses: how often a live agent is dropped from its job for a lease it could not renew in time.

    python -m benchmarks.lease_loss [--ttls=2,5,10] [--agents=3] [--minutes=10]

For each TTL, `--agents` real agents (`mwloop.launch --rdzv`, stand-in workers that sleep: tests/fake_worker.py)
join one job on a throwaway etcd and stay alive for `--minutes`; every TTL's job runs at the same time, on
whatever else loads the machine. Any "left job" line is a false loss (no agent was frozen, killed or cut off).
Prints the losses per TTL and the agent-hours watched.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ttls", default="2,5,10")
    parser.add_argument("--agents", type=int, default=3)
    parser.add_argument("--minutes", type=float, default=10)
    args = parser.parse_args()
    sys.path.insert(0, ROOT)
    from tests.services import etcd
    server = etcd.start()
    directory = tempfile.mkdtemp(prefix="lease-loss-")
    env = dict(os.environ, PYTHONPATH=ROOT)
    procs: dict[tuple[int, int], subprocess.Popen] = {}
    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    try:
        for ttl in map(int, args.ttls.split(",")):
            state = os.path.join(directory, f"state-{ttl}")
            os.makedirs(state)
            for i in range(args.agents):
                command = [sys.executable, "-m", "mwloop.launch", f"--rdzv={server.rendezvous_url(f'ttl{ttl}')}",
                           f"--num_workers={args.agents}", f"--host_id=a{i}", f"--rdzv_ttl_s={ttl}",
                           "--module=tests.fake_worker", "--wait_for_min_s=600", "--max_restarts=100", "--",
                           state, *["sleep"] * args.agents]
                with open(os.path.join(directory, f"{ttl}-{i}.log"), "w") as out:
                    procs[ttl, i] = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out,
                                                     stderr=subprocess.STDOUT)
        loads = []
        deadline = time.monotonic() + args.minutes * 60
        while time.monotonic() < deadline:
            time.sleep(10)
            loads.append(os.getloadavg()[0])
    finally:
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        server.stop()
    print(f"{started}-{time.strftime('%H:%M', time.gmtime())} UTC, {args.agents} agents per TTL for "
          f"{args.minutes:g} min, 1-min load average median {sorted(loads)[len(loads) // 2]:.1f} "
          f"(max {max(loads):.1f}) on {os.cpu_count()} cores")
    for ttl in map(int, args.ttls.split(",")):
        lost = []
        for i in range(args.agents):
            with open(os.path.join(directory, f"{ttl}-{i}.log")) as f:
                lost += [line.strip() for line in f if re.search(r" left job ttl\d+: ", line)]
        print(f"TTL {ttl} s: {len(lost)} false loss(es) in {args.agents * args.minutes / 60:.2f} agent-hours"
              + "".join(f"\n  {line}" for line in lost[:5]))


if __name__ == "__main__":
    main()
