"""The parameter servers' watch: a process of its own that probes the workers and ps tasks the chief waits on.

    python -I ps_watch_process.py '[TASKS, TIMEOUT_S, EVERY_S, LOG_EVERY_S, CHIEF_PID, WORKDIR, KNOB, METHOD]'

TASKS are [name, device, address]. Per task a thread calls the gRPC METHOD (`WorkerService/GetStatus`, which
every TensorFlow server answers) again and again; the main loop decides. Its stdin is a pipe from the chief,
which closes it at the end of training (or by dying). A task that has not answered (or has been unreachable)
for TIMEOUT_S is named in one `error:` line and the chief is SIGKILLed: its main thread is stuck inside
TensorFlow, holding the GIL, where nothing softer reaches it. Run by path with `-I` (ps_watch.py): no
TensorFlow, nothing of the user's environment; the package it belongs to is put on the path for the
workdir contract alone.
"""

import json
import os
import select
import signal
import sys
import threading
import time

import grpc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from mwloop.artifacts import files  # noqa: E402  (after the path: this file runs by path)


def done(wait: float) -> bool:
    """Whether stdin reached EOF within `wait` seconds: training is over, or the chief is gone."""
    return bool(select.select([sys.stdin], [], [], max(wait, 0.0))[0])


class Probes:
    """Per task, (what, since) while it does not answer: what is "silent" (no answer in time) or
    "unreachable: CODE"; nothing for a task that answers."""

    def __init__(self, tasks: list, timeout: float, every: float, method: str):
        self.state: dict[str, tuple[str, float] | None] = {}
        self.lock = threading.Lock()
        self.timeout, self.every, self.method = timeout, every, method
        for task in tasks:
            threading.Thread(target=self._probe, args=(task,), daemon=True).start()

    def _probe(self, task: list) -> None:
        name, _, address = task
        call = grpc.insecure_channel(address).unary_unary(self.method)
        while True:
            sent = time.monotonic()
            try:
                call(b"", timeout=min(5.0, self.timeout / 2) if self.timeout else 5.0)
                now_state = None
            except grpc.RpcError as e:
                now_state = ("silent" if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else
                             f"unreachable: {e.code().name}")
            with self.lock:
                before = self.state.get(name)
                self.state[name] = None if now_state is None else (
                    before if before and before[0] == now_state else (now_state, sent))
            time.sleep(max(0.0, self.every - (time.monotonic() - sent)))


def describe(task: list) -> str:
    return f"{task[0]} ({task[1]} at {task[2]})"


def main() -> None:
    tasks, timeout, every, log_every, chief, workdir, knob, method = json.loads(sys.argv[1])
    probes = Probes(tasks, timeout, every, method)
    state = probes.state
    logged = time.monotonic()
    while not done(0.5):
        now = time.monotonic()
        with probes.lock:
            late = [(t, state[t[0]]) for t in tasks if state.get(t[0])]
        # A silent task is overdue at the deadline; an unreachable worker only while no worker answers
        # (TensorFlow gives its steps to the others), an unreachable ps always.
        overdue = [(t, (what, since)) for t, (what, since) in late if timeout and now - since >= timeout and (
            what == "silent" or t[0].startswith("ps ") or
            all(state.get(w[0]) and state[w[0]][0] != "silent" for w in tasks if w[0].startswith("worker ")))]
        if overdue:
            names = ", ".join(describe(t) for t, _ in overdue)
            seconds = max(now - since for _, (_, since) in overdue)
            silent = all(what == "silent" for _, (what, _) in overdue)
            verb = "have" if len(overdue) > 1 else "has"
            why = (f"{verb} not answered for {seconds:.0f} s (frozen, or its host or link is down)" if silent else
                   f"{verb} been unreachable for {seconds:.0f} s (not running, or its host or link is down)")
            resume = files.resume_point(workdir, none="the last checkpoint")
            print(f"error: {names} {why}: the chief ends this "
                  f"attempt (SIGKILL: it is stuck inside TensorFlow); a restart of the whole job resumes from "
                  f"{resume} (the launcher restarts with --max_restarts, a TFJob with its restartPolicy); raise "
                  f"{knob} if the task was only slow", file=sys.stderr, flush=True)
            try:
                os.kill(chief, signal.SIGKILL)
            except ProcessLookupError:
                pass
            break
        if late and now - logged >= log_every:
            logged = now
            deadline = (f"the chief ends this attempt at {timeout:g} s ({knob})" if timeout else
                        f"no deadline ({knob}=0)")
            who = "; ".join(f"{describe(t)}: {'no answer' if what == 'silent' else what} for {now - since:.0f} s"
                            for t, (what, since) in late)
            print(f"waiting for {who}; {deadline}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
