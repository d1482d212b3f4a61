"""The startup watchdog: a process of its own (stdlib only) that probes a joining task's peers.

    python -I startup_watchdog.py '[TASKS, TIMEOUT_S, EVERY_S, KNOB]'

TASKS are [name, host, port] of the other tasks. Its stdin is a pipe from the training process, which closes
it when the cluster is up (or by dying). Every EVERY_S seconds it logs the tasks whose address does not accept
a TCP connection yet; after TIMEOUT_S (0: never) it prints one `error:` line and ends its parent (SIGINT, which
the parent made `_exit(2)`, then SIGKILL). Run by path with `-I` (startup.py), so it imports nothing of mwloop
and nothing of the user's environment.
"""

import json
import os
import select
import signal
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor


def done(wait: float) -> bool:
    """Whether stdin reached EOF within `wait` seconds: the cluster is up, or the parent is gone."""
    return bool(select.select([sys.stdin], [], [], max(wait, 0.0))[0])


def unreachable(task: list) -> str | None:
    name, host, port = task
    try:
        socket.create_connection((host, port), timeout=2).close()
        return None
    except OSError:
        return f"{name} ({host}:{port})"


def main() -> None:
    tasks, timeout, every, knob = json.loads(sys.argv[1])
    start, parent = time.monotonic(), os.getppid()
    # In parallel: a dead host costs its connect timeout.
    with ThreadPoolExecutor(len(tasks)) as pool:
        while not done(every if not timeout else min(every, start + timeout - time.monotonic())):
            missing = [m for m in pool.map(unreachable, tasks) if m]
            elapsed = time.monotonic() - start
            if done(0):
                break
            if timeout and elapsed >= timeout:
                what = (f"{', '.join(missing)} never became reachable; start {'it' if len(missing) == 1 else 'them'}, "
                        f"fix TF_CONFIG, or raise {knob}" if missing else
                        "every task's address accepts connections, but not every task joined (another program on "
                        "one of those ports, or a task stuck starting); check TF_CONFIG and the tasks' logs, or "
                        f"raise {knob}")
                print(f"error: the cluster did not come up in {timeout:g} s: {what}", file=sys.stderr, flush=True)
                # The parent made SIGINT _exit(2) while it waits.
                os.kill(parent, signal.SIGINT)
                for _ in range(20):
                    time.sleep(0.1)
                    if os.getppid() != parent:
                        break
                else:
                    # Still there (it could not make SIGINT exit): end it anyway.
                    os.kill(parent, signal.SIGKILL)
                break
            if missing:
                of = f" of {timeout:g} s" if timeout else ", no deadline"
                print(f"waiting for the cluster: {', '.join(missing)} not reachable yet ({elapsed:.0f} s{of})",
                      file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
