"""Building blocks of the fault cases: command lines, setups (files, corruptions, prior runs) and checks."""

from __future__ import annotations

import csv
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import portpicker
import psutil

from tests.stress.fault_harness import Ctx, Run, SetupError, snapshot, workers

Setup = Callable[[Ctx], None]

# A seconds-long MLP run: checkpoints at 20 and 40, a train and an eval event at each.
SHORT = {"train.steps": 40, "train.steps_per_loop": 10, "train.log_every_steps": 20,
         "train.eval_every_steps": 20, "train.checkpoint_every_steps": 20, "export": False}
# Long enough to be signalled mid-run (about 4000 steps/s on one process), exactly resumable.
LONG = {"train.steps": 20000, "train.steps_per_loop": 10, "train.log_every_steps": 500,
        "train.eval_every_steps": 0, "train.checkpoint_every_steps": 5000, "deterministic": True, "export": False}
# The same under the launcher with 2 workers (about 500 steps/s).
LAUNCHED = dict(LONG, **{"train.steps": 6000, "train.log_every_steps": 100, "train.checkpoint_every_steps": 1000})


def _merge(base: dict, extra: Sequence[str]) -> list[str]:
    """`--config.KEY=VALUE` flags of `base`, except the keys `extra` sets itself, then `extra`."""
    given = {arg.split("=", 1)[0] for arg in extra}
    return [f"--config.{k}={v}" for k, v in base.items() if f"--config.{k}" not in given] + list(extra)


def main(*extra: str, config: str = "configs/mlp.py", base: dict = SHORT) -> list[str]:
    """`mwloop.main` arguments: the config, the case's workdir, `base` overrides, then `extra`."""
    workdir = [] if any(a.startswith("--workdir=") for a in extra) else ["--workdir={workdir}"]
    return ["mwloop.main", f"--config={config}", *workdir, *_merge(base, extra)]


def launch(*extra: str, launcher: Sequence[str] = (), base: dict = LAUNCHED) -> list[str]:
    """`mwloop.launch` with 2 workers (flags `launcher`) around `mwloop.main` arguments."""
    return ["mwloop.launch", "--num_workers=2", "--grace_s=10", *launcher, "--", *main("--mode=train", *extra,
                                                                                      base=base)[1:]]


# ---------------------------------------------------------------------------- setups

def steps(*setups: Setup) -> Setup:
    def run(ctx: Ctx) -> None:
        for setup in setups:
            setup(ctx)
    return run


def trained(*extra: str) -> Setup:
    """The case's workdir trained to completion (SHORT: checkpoints 20 and 40); its eval events counted.

    Trained once per suite run for each `extra` and copied into later cases' workdirs (the runs are
    seconds of training behind seconds of TensorFlow start-up; dozens of cases start from one).
    """
    def run(ctx: Ctx) -> None:
        key = ("trained", *extra)
        with ctx.shared.setdefault(("lock", *key), threading.Lock()):  # cases may run side by side (--jobs)
            if key not in ctx.shared:
                cached = os.path.join(ctx.shared["base"], f"trained-{len(ctx.shared)}")
                ctx.vars["workdir"] = cached
                try:
                    ctx.must_run(main(*extra))
                finally:
                    ctx.vars["workdir"] = ctx.workdir
                ctx.shared[key] = cached
        shutil.copytree(ctx.shared[key], ctx.workdir, symlinks=True)
        _retarget_checkpoint_state(ctx.shared[key], ctx.workdir)
        ctx.vars["evals"] = sum(e.get("split") == "eval" for e in snapshot(ctx.workdir).events)
    return run


def _retarget_checkpoint_state(source: str, workdir: str) -> None:
    """The copied `checkpoint` state files name the copy's paths, not the cached run's."""
    for folder in ("checkpoints", "best_checkpoint"):
        path = os.path.join(workdir, folder, "checkpoint")
        if os.path.isfile(path):
            with open(path) as f:
                text = f.read()
            with open(path, "w") as f:
                f.write(text.replace(source, workdir))


def files(contents: dict[str, str | bytes]) -> Setup:
    """Files under the case directory (paths relative to it; the workdir is `run/`)."""
    def run(ctx: Ctx) -> None:
        for path, text in contents.items():
            ctx.write(path, text)
    return run


def truncate(relative: str, keep: float = 0.5) -> Setup:
    def run(ctx: Ctx) -> None:
        path = ctx.path(relative)
        if not os.path.exists(path):
            raise SetupError(f"nothing to truncate at {path}")
        os.truncate(path, int(os.path.getsize(path) * keep))
    return run


def remove(relative: str) -> Setup:
    return lambda ctx: os.remove(ctx.path(relative))


def append(relative: str, text: str) -> Setup:
    def run(ctx: Ctx) -> None:
        with open(ctx.path(relative), "a") as f:
            f.write(text)
    return run


def insert_line(relative: str, at: int, text: str) -> Setup:
    def run(ctx: Ctx) -> None:
        with open(ctx.path(relative)) as f:
            lines = f.readlines()
        lines.insert(at, text + "\n")
        with open(ctx.path(relative), "w") as f:
            f.writelines(lines)
    return run


def read_only_checkpoints(ctx: Ctx) -> None:
    """`run/checkpoints` without write permission. Root ignores modes, so under root it is also made
    immutable (chattr +i: not even root can create files in it), and mutable again after the case."""
    directory = ctx.path("run", "checkpoints")
    os.makedirs(directory)
    os.chmod(directory, 0o555)
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "+i", directory], capture_output=True, check=False).returncode:
            raise SetupError(f"running as root and `chattr +i {directory}` failed: cannot make it read-only")
        ctx.closers.append(lambda: subprocess.run(["chattr", "-i", directory], capture_output=True, check=False))


def tf_config(index: int = 0, *, occupy_own_port: bool = False) -> Setup:
    """TF_CONFIG of worker `index` in a 2-worker localhost cluster on free ports (the other worker never
    starts); `occupy_own_port` keeps this worker's port bound by a listening socket."""
    def run(ctx: Ctx) -> None:
        ports = [portpicker.pick_unused_port() for _ in range(2)]
        ctx.vars.update(port0=ports[0], port1=ports[1])
        ctx.env["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"localhost:{p}" for p in ports]},
                                           "task": {"type": "worker", "index": index}})
        if occupy_own_port:
            holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            holder.bind(("127.0.0.1", ports[index]))
            holder.listen(1)
            ctx.closers.append(holder.close)
    return run


def busy_workdir(ctx: Ctx) -> None:
    """A live long run holding the workdir (SIGTERMed after the case: it saves and exits 42)."""
    ctx.start(main("--mode=train", "--config.train.steps=100000000", "--config.train.log_every_steps=1000",
                   "--config.train.steps_per_loop=100", "--config.train.eval_every_steps=0",
                   "--config.train.checkpoint_every_steps=0"), ready=r"step \d+/")


def image_folders(ctx: Ctx) -> None:
    from tests.image_folders import make_fake_image_folders
    make_fake_image_folders(ctx.path("images"), num_classes=2, per_class=3, size=16)


TASK = '''
import keras
import numpy as np
import tensorflow as tf

import mwloop


class Tiny(mwloop.Task):
    def train_arrays(self):
        x = np.random.default_rng(0).standard_normal((256, 4)).astype(np.float32)
        return {"inputs": x, "label": (x[:, 0] > 0).astype(np.float32)}

    def build_model(self):
        return keras.Sequential([keras.Input((4,), name="inputs"), keras.layers.Dense(1)])

    def loss(self, batch, outputs):
        return keras.losses.binary_crossentropy(batch["label"][:, None], outputs, from_logits=True)
'''


def task_module(name: str, body: str) -> Setup:
    """`faulttasks/<name>.py` on the case's PYTHONPATH: the Tiny task above plus `body`."""
    return files({"faulttasks/__init__.py": "", f"faulttasks/{name}.py": TASK + body})


# ---------------------------------------------------------------------------- checks (None: fine)

def in_output(pattern: str, run: int = -1) -> Callable[[Ctx, list[Run]], str | None]:
    def check(ctx: Ctx, runs: list[Run]) -> str | None:
        return None if re.search(pattern, runs[run].output) else f"no /{pattern}/ in the output"
    return check


def not_in_output(pattern: str) -> Callable[[Ctx, list[Run]], str | None]:
    def check(ctx: Ctx, runs: list[Run]) -> str | None:
        hits = [m[0] for r in runs if (m := re.search(pattern, r.output))]
        return f"printed {hits[0]!r}" if hits else None
    return check


def all_of(*checks):
    def check(ctx: Ctx, runs: list[Run]) -> str | None:
        return next((p for c in checks if (p := c(ctx, runs))), None)
    return check


def no_new_eval(ctx: Ctx, runs: list[Run]) -> str | None:
    evals = sum(e.get("split") == "eval" for e in snapshot(ctx.workdir).events)
    appended = evals - ctx.vars["evals"]
    return f"{appended} eval event(s) appended to metrics.jsonl" if appended else None


def eval_appended(min_accuracy: float):
    def check(ctx: Ctx, runs: list[Run]) -> str | None:
        evals = [e for e in snapshot(ctx.workdir).events if e.get("split") == "eval"]
        if len(evals) != ctx.vars["evals"] + 1:
            return f"{len(evals) - ctx.vars['evals']} eval events appended, not 1"
        return None if evals[-1].get("accuracy", 0) >= min_accuracy else f"eval accuracy {evals[-1].get('accuracy')}"
    return check


def checkpoints_are(*wanted: int):
    def check(ctx: Ctx, runs: list[Run]) -> str | None:
        found = sorted(snapshot(ctx.workdir).checkpoints)
        return None if found == sorted(wanted) else f"checkpoints {found}, expected {sorted(wanted)}"
    return check


def train_events_once(ctx: Ctx, runs: list[Run]) -> str | None:
    """Each train step is logged once, in order: no duplicate or stale events after a resume."""
    train_steps = [e["step"] for e in snapshot(ctx.workdir).events if e.get("split") == "train"]
    bad = [b for a, b in itertools.pairwise(train_steps) if b <= a]
    return f"metrics.jsonl train steps go back or repeat at {bad[:3]}" if bad else None


def resumed_where_saved(ctx: Ctx, runs: list[Run]) -> str | None:
    """The first run saved at the signal's step (every worker at the same one) and the rerun (or the
    restart) resumed from exactly that step."""
    saved = sorted({int(s) for s in re.findall(r"saving a checkpoint at step (\d+)", runs[0].output)})
    if len(saved) != 1:
        return f"saved at steps {saved or 'none'} when signalled (expected one step for every worker)"
    resumed = re.findall(r"resumed from step (\d+)", runs[-1].output)
    return None if str(saved[0]) in resumed else f"saved at step {saved[0]} but resumed from {resumed or 'nothing'}"


def resumed_from_newest_left(ctx: Ctx, runs: list[Run]) -> str | None:
    """After a kill: the rerun (or restart) resumed from the newest checkpoint the killed run left."""
    newest = max((s for s, ok in ctx.snapshots[1].checkpoints.items() if ok), default=None)
    resumed = [int(s) for s in re.findall(r"resumed from step (\d+)", runs[-1].output)]
    return None if newest is not None and newest in resumed else \
        f"resumed from {resumed or 'nothing'}, the newest checkpoint left was {newest}"


def weights(prefix: str) -> dict[str, np.ndarray]:
    import tensorflow as tf
    reader = tf.train.load_checkpoint(prefix)
    return {n: reader.get_tensor(n) for n in reader.get_variable_to_shape_map()
            if n.startswith(("model/", "optimizer/", "step/"))}


def same_as_uninterrupted(args: list[str], final_step: int):
    """The final checkpoint equals bitwise that of the same command run without a fault (run once, cached)."""
    def check(ctx: Ctx, runs: list[Run]) -> str | None:
        key = " ".join(args)
        with ctx.shared.setdefault(("lock", key), threading.Lock()):
            if key not in ctx.shared:
                reference = os.path.join(ctx.shared["base"], f"reference-{len(ctx.shared)}")
                ctx.vars["workdir"] = reference
                try:
                    ctx.must_run(args)
                finally:
                    ctx.vars["workdir"] = ctx.workdir
                ctx.shared[key] = weights(os.path.join(reference, "checkpoints", f"ckpt-{final_step}"))
        want = ctx.shared[key]
        got = weights(os.path.join(ctx.workdir, "checkpoints", f"ckpt-{final_step}"))
        differ = [n for n in want if n not in got or not np.array_equal(want[n], got[n])]
        return f"final weights differ from the uninterrupted run's: {differ[:3]}" if differ else None
    return check


def sweep_recorded_failure(ctx: Ctx, runs: list[Run]) -> str | None:
    """results.csv: two complete trials and the failed one with its error line (mlp_smoke's fail point)."""
    path = ctx.path("sweep", "results.csv")
    if not os.path.exists(path):
        return "no results.csv"
    with open(path) as f:
        rows = list(csv.DictReader(f))
    statuses = sorted(r["status"] for r in rows)
    if statuses != ["complete", "complete", "failed"]:
        return f"trial statuses {statuses}, expected 2 complete and 1 failed"
    error = next(r["error"] for r in rows if r["status"] == "failed")
    if "eval_fraction" not in error:
        return f"the failed trial's recorded error does not name eval_fraction: {error!r}"
    return None if os.path.exists(ctx.path("sweep", "results.md")) else "no results.md"


def freeze(pid: int, seconds: float | None) -> None:
    """SIGSTOPs `pid`; SIGCONT after `seconds` from a thread (None: frozen for good)."""
    os.kill(pid, signal.SIGSTOP)
    if seconds is None:
        return

    def wake() -> None:
        time.sleep(seconds)
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    threading.Thread(target=wake, daemon=True).start()


def no_orphans(ctx: Ctx, runs: list[Run]) -> str | None:
    """Every worker the launcher had is gone within 10 s of the launcher's death."""
    pids = runs[0].facts.get("worker_pids", [])
    if not pids:
        return "the workers were never seen"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return None
        time.sleep(0.2)
    return f"worker pid(s) {alive} outlived the launcher"


def kill_launcher_noting_workers(proc) -> None:
    """SIGKILL to the launcher, remembering its workers' pids for `no_orphans`."""
    proc.facts = {"worker_pids": [p.pid for p in workers(proc)]}
    os.kill(proc.pid, signal.SIGKILL)


def nothing_in(relative: str):
    """A directory the failed command must not have filled (or created)."""
    def check(ctx: Ctx, runs: list[Run]) -> str | None:
        path = ctx.path(relative)
        found = os.listdir(path) if os.path.isdir(path) else []
        return f"left {sorted(found)[:4]} in {relative}/" if found else None
    return check


def background_still_running(ctx: Ctx, runs: list[Run]) -> str | None:
    holder = ctx.background[0]
    return None if holder.poll() is None else f"the run holding the workdir exited {holder.returncode}"
