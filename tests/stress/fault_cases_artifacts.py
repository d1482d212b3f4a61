"""Fault cases of issue 31 (items 2, 4, 8): exports that never lose the export just made, the run's directory as
its truth, nothing of a run left in TMPDIR. Joined to `fault_cases.CASES`."""

from __future__ import annotations

import os
import shutil

from tests.stress.fault_harness import Case, Check, Ctx, Run, ok
from tests.stress.fault_steps import all_of, in_output, main, not_in_output, steps, trained

EXPORT = ("--config.export=True",)


# ---------------------------------------------------------------------------- checks

def serves(step: int, base: str = "export") -> Check:
    """`<base>/<step>` is there and loads, and `<base>/latest` points at it."""
    def check(ctx: Ctx, runs: list[Run]) -> str | None:
        import tensorflow as tf
        directory = ctx.path("run", base)
        link = os.path.join(directory, "latest")
        if not os.path.islink(link) or os.readlink(link) != str(step):
            return f"{base}/latest -> {os.readlink(link) if os.path.islink(link) else None}, not {step}"
        try:
            tf.saved_model.load(os.path.join(directory, str(step)))
        except Exception as e:  # what a server would meet
            return f"{base}/{step} does not load: {str(e).splitlines()[0][:160]}"
        return None
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
]
