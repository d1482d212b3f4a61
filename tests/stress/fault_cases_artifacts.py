"""Fault cases of issue 31 (items 2, 4, 8): exports that never lose the export just made, the run's directory as
its truth, nothing of a run left in TMPDIR. Joined to `fault_cases.CASES`."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import time

from tests.stress.fault_harness import (
    ROOT,
    Case,
    Check,
    Ctx,
    Fault,
    Run,
    error,
    export_load_error,
    ok,
    send_worker,
    workers,
)
from tests.stress.fault_steps import (
    LONG,
    SHORT,
    all_of,
    in_output,
    launch,
    main,
    not_in_output,
    remove,
    steps,
    trained,
)

EXPORT = ("--config.export=True",)
LONG_RUN = main("--mode=train", base=LONG)
MULTI = {"multi": True, "timeout": 240.0}
LOST = r"stopping without saving the checkpoint of step \d+"


# ---------------------------------------------------------------------------- checks

def serves(step: int, base: str = "export") -> Check:
    """`<base>/<step>` is there and loads, and `<base>/latest` points at it."""
    def check(ctx: Ctx, runs: list[Run]) -> str | None:
        directory = ctx.path("run", base)
        link = os.path.join(directory, "latest")
        if not os.path.islink(link) or os.readlink(link) != str(step):
            return f"{base}/latest -> {os.readlink(link) if os.path.islink(link) else None}, not {step}"
        return export_load_error(os.path.join(directory, str(step)), f"{base}/{step}")
    return check


def exports_are(*names: str) -> Check:
    """export/ holds exactly `names` (besides its hidden bookkeeping)."""
    def check(ctx: Ctx, runs: list[Run]) -> str | None:
        found = sorted(n for n in os.listdir(ctx.path("run", "export")) if not n.startswith("."))
        return None if found == sorted(names) else f"export/ holds {found}, expected {sorted(names)}"
    return check


def unchanged_tree(relative: str, files: dict[str, str]) -> Check:
    """The files under `relative` (outside mwloop's reach) still hold what they held."""
    def check(ctx: Ctx, runs: list[Run]) -> str | None:
        for name, text in files.items():
            path = ctx.path(relative, name)
            if not os.path.exists(path):
                return f"{relative}/{name} was deleted"
            with open(path) as f:
                if f.read() != text:
                    return f"{relative}/{name} was changed"
        return None
    return check


def one_warning_line(pattern_count: int = 1) -> Check:
    """The oddities of export/ are one log line, not one per entry."""
    def check(ctx: Ctx, runs: list[Run]) -> str | None:
        lines = [line for line in runs[-1].output.splitlines() if "not written by this mwloop" in line]
        return None if len(lines) == pattern_count else f"{len(lines)} lines name the odd entries of export/"
    return check


def no_workdir(ctx: Ctx, runs: list[Run]) -> str | None:
    """The removed workdir was not made again: nothing saved where the run no longer owns."""
    return f"run/ was made again: {sorted(os.listdir(ctx.workdir))}" if os.path.exists(ctx.workdir) else None


def second_run_intact(ctx: Ctx, runs: list[Run]) -> str | None:
    """The second run's workdir holds its own checkpoints (20, 40) and only its own events (steps <= 40)."""
    found = sorted(int(n[5:-6]) for n in os.listdir(ctx.path("run", "checkpoints")) if n.endswith(".index"))
    if found != [20, 40]:
        return f"the second run's checkpoints are {found}, not [20, 40]"
    with open(ctx.path("run", "metrics.jsonl")) as f:
        late = [line for line in f if '"step": ' in line and int(line.split('"step": ')[1].split(",")[0]) > 40]
    if late:
        return f"the first run wrote {len(late)} events into the second run's metrics.jsonl"
    # TensorFlow's event writer opens a new file when its own disappeared: one per split is the second run's.
    events = glob.glob(ctx.path("run", "summaries", "train", "events.out.tfevents.*"))
    return f"summaries/train holds {len(events)} event files, not the second run's one" if len(events) != 1 else None


def tmpdir_empty(ctx: Ctx, runs: list[Run]) -> str | None:
    """Nothing of a run is left in the case's TMPDIR."""
    left = sorted(os.path.basename(p) for p in glob.glob(ctx.path("tmp", "mwloop-*")))
    return f"left in TMPDIR: {left}" if left else None


def victims_intact(ctx: Ctx, runs: list[Run]) -> str | None:
    left = sorted(os.listdir(ctx.path("outside")))
    return None if left == ["model.data-00000-of-00001", "model.index"] else f"outside/ now holds {left}"


# ---------------------------------------------------------------------------- faults

class WorkdirFault:
    """A fault that needs the case's workdir: the setup notes it, the action (at a step) uses it."""

    def __init__(self, second_run: bool = False):
        self.workdir = ""
        self.second_run = second_run

    def setup(self, ctx: Ctx) -> None:
        self.workdir, self.env = ctx.workdir, ctx.env

    def act(self, proc: subprocess.Popen) -> None:
        running = workers(proc) or [proc]  # the launcher's workers, or the run itself
        if self.second_run:  # frozen while the second run takes the directory, so it meets it afterwards
            for p in running:
                os.kill(p.pid, signal.SIGSTOP)
        subprocess.run(["rm", "-rf", self.workdir], check=True)
        if self.second_run:
            try:
                subprocess.run([sys.executable, "-m", *[a.format(workdir=self.workdir) for a in main(base=SHORT)]],
                               cwd=ROOT, env=self.env, timeout=180, capture_output=True, check=True)
            finally:
                for p in running:
                    os.kill(p.pid, signal.SIGCONT)


def rm_rf_case(name: str, expected: str, args: list[str], at_step: int, check: Check, second_run: bool = False,
               **kw) -> Case:
    """A case whose workdir is removed (rm -rf) once the run logged `at_step` (then, with `second_run`, a
    second run trains in the same directory while the first is frozen); the first run must exit 2."""
    fault = WorkdirFault(second_run)
    what = "rm -rf of the workdir" + (", then a second run in it" if second_run else "")
    return ok(name, expected, args, codes=(2,), setup=fault.setup, fault=Fault(what, fault.act, at_step=at_step),
              check=check, **kw)


def with_tmpdir(ctx: Ctx) -> None:
    """The case's own TMPDIR, so what a run leaves there can be seen."""
    os.makedirs(ctx.path("tmp"), exist_ok=True)
    ctx.env["TMPDIR"] = ctx.path("tmp")


def stale_scratch(ctx: Ctx) -> None:
    """What a killed worker of an earlier run left in TMPDIR: a save directory (unlocked) and an older
    mwloop's preemption-handler directory."""
    old = time.time() - 3600
    for name in ("mwloop-worker1-abandoned", "mwloop-preemption-handler-old"):
        os.makedirs(ctx.path("tmp", name))
        ctx.write(f"tmp/{name}/.owner", "pid 1\n")
        os.utime(ctx.path("tmp", name, ".owner"), (old, old))
        os.utime(ctx.path("tmp", name), (old, old))


def planted_state(ctx: Ctx) -> None:
    """checkpoints/checkpoint naming a checkpoint outside the run, with timestamps that make TensorFlow's
    manager delete it at its next rotation."""
    for name in ("model.index", "model.data-00000-of-00001"):
        ctx.write(f"outside/{name}", "precious\n")
    prefix, now = ctx.path("outside", "model"), time.time()
    ctx.write("run/checkpoints/checkpoint", f'model_checkpoint_path: "{prefix}"\nall_model_checkpoint_paths: '
              f'"{prefix}"\nall_model_checkpoint_timestamps: {now - 10}\nlast_preserved_timestamp: {now - 99}\n')


# ---------------------------------------------------------------------------- setups

def retrained_from_scratch(ctx: Ctx) -> None:
    """A workdir of a run trained to 200 and exported (export/200), its checkpoints removed to train anew."""
    shutil.rmtree(ctx.path("run", "checkpoints"))


def foreign_exports(ctx: Ctx) -> None:
    """export/ holding what mwloop did not make: a version copied in by hand, a link to a folder outside,
    a file; the folder outside holds a precious file."""
    ctx.write("outside/saved_model.pb", "precious\n")
    ctx.write("run/export/300/saved_model.pb", "copied in by hand\n")
    ctx.write("run/export/notes.txt", "mine\n")
    os.symlink(ctx.path("outside"), ctx.path("run", "export", "10"))


CASES: list[Case] = [
    # ------------------------------------------------------------------ item 2: exports
    ok("export_retrained_from_scratch", "a retrain beside an old export/200 keeps export/40 and latest -> 40",
       main(*EXPORT, "--config.export_keep=1"),
       setup=steps(trained("--config.train.steps=200", *EXPORT), retrained_from_scratch),
       check=all_of(serves(40), exports_are("40", "latest"))),
    ok("export_retrained_keeps_both", "keep 3: export/40 (latest) beside export/200; one line says Serving serves 200",
       main(*EXPORT),
       setup=steps(trained("--config.train.steps=200", *EXPORT), retrained_from_scratch),
       check=all_of(serves(40), exports_are("200", "40", "latest"),
                    in_output(r"TF Serving serves the highest version, 200, not 40"))),
    ok("export_beside_foreign_entries", "keep 1: a hand-copied version, a link out and a file stay, named in one line",
       main(*EXPORT, "--config.export_keep=1"), setup=foreign_exports,
       check=all_of(serves(40), exports_are("10", "300", "40", "latest", "notes.txt"), one_warning_line(),
                    unchanged_tree("outside", {"saved_model.pb": "precious\n"}),
                    unchanged_tree("run/export/300", {"saved_model.pb": "copied in by hand\n"}))),
    ok("export_rerun_replaces_own", "a rerun re-exports step 40 over its own export: no warning, latest -> 40",
       main(*EXPORT), setup=trained(*EXPORT),
       check=all_of(serves(40), exports_are("40", "latest"), not_in_output(r"not written by this mwloop"))),

    # ------------------------------------------------------------------ item 4: the workdir is the run's truth
    rm_rf_case("workdir_removed_mid_run", "rm -rf mid-run: the run stops in one line at its next save; "
               "nothing made again", LONG_RUN, 2000,
               all_of(in_output(r"was removed while this run trained; " + LOST), no_workdir)),
    rm_rf_case("workdir_second_run_after_rm", "rm -rf, a second run in the same directory: the first stops in one "
               "line, the second's files intact", LONG_RUN, 2000,
               all_of(in_output(r"changed hands while this run trained .*; " + LOST), second_run_intact),
               second_run=True),
    error("resume_without_config_json", "config.json deleted, resumed with another batch: refused all the same",
          main("--config.train.global_batch_size=128"), r"train\.global_batch_size: 64 -> 128",
          setup=steps(trained(), remove("run/config.json"))),
    rm_rf_case("workdir_removed_two_workers", "2 workers, rm -rf mid-run: both stop together at the next save, no "
               "restart, nothing made again", launch(launcher=["--max_restarts=0"]), 1500,
               all_of(in_output(r"was removed while this run trained; " + LOST),
                      in_output(r"the chief found its workdir removed, or locked by another run, while this run "
                                r"trained; " + LOST), no_workdir),
               **MULTI),
    # ------------------------------------------------------------------ item 8: leftovers
    ok("tmpdir_clean_after_sigkill", "2 workers, worker 1 SIGKILLed; a clean rerun leaves nothing in TMPDIR",
       launch(launcher=["--max_restarts=0"]), codes=(1, 2, 42, 137, -9), rerun=launch(),
       setup=steps(with_tmpdir, stale_scratch),
       fault=Fault("SIGKILL to worker 1 at step 1500", send_worker(1, signal.SIGKILL), at_step=1500),
       check=tmpdir_empty, **MULTI),
    ok("checkpoint_state_planted", "a planted checkpoint state file naming files outside: the rotation "
       "deletes nothing outside", main("--config.train.steps=80", "--config.train.max_to_keep=1",
                                       "--config.train.allow_changed=train.steps"),
       setup=steps(trained(), planted_state), check=victims_intact),
]
