"""Standby workers: processes started ahead of a restart, TensorFlow already imported, waiting for their task.

Measured here (BENCHMARKS.md, "Restart cost"), a restart of the 2-worker digits job spends more of its time
importing Python, TensorFlow, Keras and mwloop than on anything else: ~4 s for one process on an idle machine,
~10 s for two at once on a busy one, every restart again. None of it depends on the attempt: only TF_CONFIG
(fresh ports) does, and TensorFlow reads it when the strategy is created, after the imports. So while an attempt
trains, the launcher starts one spare per worker (`Spares.fill`): `python -m mwloop.launcher.standby MODULE
ARGS`, which imports what every worker imports and then waits on its stdin. When the attempt ends in a restart and
its processes have all exited (the workdir's lock, an asynchronous checkpoint write and the ports are theirs until
then), the new attempt takes the spares (`Spares.take`): one JSON line on stdin gives each its TF_CONFIG, and it
runs `python -m MODULE ARGS` in the same process, as that command would (`__main__`, sys.argv, stdin at
/dev/null). A spare that died is replaced by a fresh start, as before.

The goodput clock of a spare counts from when it was given its task (`goodput_clock.count_from`): its imports
overlapped the attempt before and cost the job nothing; the wait for them, if it was not ready, is start-up.

What it costs: a spare's memory while it waits (~0.7 GB each with TensorFlow and Keras imported, measured here)
and the CPU of its imports while the attempt before trains, so it is a choice: `--standby` (off by default). A
job with no restarts left (`--max_restarts` used up, or 0) starts none.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
import time

from absl import logging

from mwloop import errors
from mwloop.launcher import children

# What every training worker imports (mwloop.main's modules): a spare imports them before it is needed. Modules
# that are not there (a worker module of the user's without mwloop's training) are skipped.
PRELOAD = ("mwloop.run.train", "ml_collections.config_flags", "absl.app")


class Spares:
    """The spare worker processes of a launcher (one per worker of the next attempt), started by `fill`, given a
    task by `take`, ended by `close`."""

    def __init__(self, module: str, args: list[str], env: dict[str, str]):
        """`env`: the workers' environment without TF_CONFIG (each spare gets its own at `take`)."""
        self.command = [sys.executable, "-m", __name__, module, *args]
        self.env = {k: v for k, v in env.items() if k != "TF_CONFIG"}
        self.waiting: list[subprocess.Popen] = []

    def fill(self, count: int) -> None:
        """Starts spares until `count` are waiting (those that died are dropped)."""
        self.waiting = [p for p in self.waiting if p.poll() is None]
        started = []
        while len(self.waiting) < count:
            # Tied to the launcher like the workers; its output goes where the worker's will (copied once taken).
            self.waiting.append(children.popen_tied(self.command, env=self.env, stdin=subprocess.PIPE,
                                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE))
            started.append(self.waiting[-1].pid)
        # Extra processes in `ps`: say what they are.
        if started:
            logging.info("started %d standby process(es) for the next restart (pid %s): imports done ahead "
                         "(--standby)", len(started), ", ".join(map(str, started)))

    def take(self, tf_config: dict) -> subprocess.Popen | None:
        """A waiting spare, given `tf_config` and told to run; None when none is alive."""
        while self.waiting:
            proc = self.waiting.pop(0)
            if proc.poll() is not None:
                continue
            try:
                proc.stdin.write((json.dumps({"env": {"TF_CONFIG": json.dumps(tf_config)}, "sent": time.time()})
                                  + "\n").encode())
                proc.stdin.close()
            except OSError:  # it died just now
                proc.kill()
                proc.wait()
                continue
            return proc
        return None

    def close(self) -> None:
        """Ends the spares still waiting (they hold nothing but their imports)."""
        for proc in self.waiting:
            proc.kill()
        for proc in self.waiting:
            proc.wait()
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                stream.close()
        self.waiting = []


def preload() -> None:
    """Imports what every training worker imports (PRELOAD), TensorFlow as quietly as mwloop.main does."""
    from mwloop.launcher import console
    console.import_tensorflow_quietly()
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass


def main(argv: list[str]) -> None:
    """A spare: imports, waits for its task on stdin, then runs `python -m MODULE ARGS` as that command would."""
    module, args = argv[1], argv[2:]
    try:
        preload()
        line = sys.stdin.readline()
    # A terminal's Ctrl-C reaches the spares too: nothing to save, no traceback.
    except KeyboardInterrupt:
        sys.exit(errors.INTERRUPTED)
    # No line: the launcher ended (or no longer needs this spare).
    if not line:
        sys.exit(0)
    order = json.loads(line)
    os.environ.update(order["env"])
    # /dev/null as the worker's stdin, as a fresh start has it.
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdin = open(0, closefd=False)
    from mwloop.run import goodput_clock
    # Its work starts now; its imports overlapped the attempt before.
    goodput_clock.count_from(order["sent"])
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv)
