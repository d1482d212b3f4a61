"""Fault cases of issue 47: every reader of checkpoints meets one that vanished or is half-written, and falls back
cleanly; one failed read never poisons the next. Joined to `fault_cases.CASES`.

The reported case: the side-car under fast rotation skipped a checkpoint deleted under it mid-read, then refused
the next, good one as "does not hold this config's model" (exit 2): TensorFlow's restore into its reused reader
had kept the failed read's deferred `save_counter` (with the rotation on cue below, the next read re-read the
vanished checkpoint instead: ckpt-60 skipped too, nothing evaluated, exit 2). To make "deleted mid-read"
happen on cue, the case directory's `sitecustomize.py` (`MID_READ`, on the commands' PYTHONPATH) wraps
TensorFlow's checkpoint restore: once the reader has opened the checkpoint $FAULT_MID_READ names, its files go
away before the variables are read:

  hide:ckpt-40             moved aside, and back once that restore failed (a checkpoint briefly unreadable)
  rotate:ckpt-40:ckpt-60   renamed to ckpt-60, the `checkpoint` state file naming it (a trainer's rotation: the
                           old one gone, a new one written)
"""

from __future__ import annotations

import os

from tests.stress.fault_harness import Case, Ctx, Run, error, ok, snapshot
from tests.stress.fault_steps import (
    SHORT,
    all_of,
    checkpoints_are,
    files,
    in_output,
    main,
    not_in_output,
    steps,
    trained,
    truncate,
)

MID_READ = '''"""Fault injection for tests/stress/fault_cases_readers.py: a checkpoint goes away while it is read."""
import os

_how = os.environ.get("FAULT_MID_READ", "").split(":")
if _how[0]:
    import tensorflow as tf
    from tensorflow.python.checkpoint import checkpoint as _tf_checkpoint

    _opened = _tf_checkpoint._CheckpointRestoreCoordinator.__init__
    _armed = [True]

    def _move(directory, old, new):
        for name in os.listdir(directory):
            if name.startswith(old + "."):
                os.rename(os.path.join(directory, name), os.path.join(directory, new + name[len(old):]))

    def _coordinator(self, *args, **kwargs):
        _opened(self, *args, **kwargs)
        directory, name = os.path.split(self.save_path_string)
        if _armed[0] and name == _how[1]:
            _armed[0] = False
            if _how[0] == "hide":
                _move(directory, name, "hidden-" + name)
                _hidden.append((directory, name))
            else:
                _move(directory, name, _how[2])
                with open(os.path.join(directory, "checkpoint"), "w") as f:
                    f.write(f'model_checkpoint_path: "{_how[2]}"\\nall_model_checkpoint_paths: "{_how[2]}"\\n')
            print(f"fault: {name} went away while it was read", flush=True)

    _hidden = []
    _restore = tf.train.Checkpoint.restore

    def _restore_then_unhide(self, *args, **kwargs):
        try:
            return _restore(self, *args, **kwargs)
        finally:
            while _hidden:
                directory, name = _hidden.pop()
                _move(directory, "hidden-" + name, name)

    _tf_checkpoint._CheckpointRestoreCoordinator.__init__ = _coordinator
    tf.train.Checkpoint.restore = _restore_then_unhide
'''

FIRED = in_output(r"fault: ckpt-40 went away while it was read")
POISON = not_in_output(r"does not hold this config's model|does not match this model|no readable checkpoint")


def mid_read(how: str) -> dict:
    """The case's commands read with `how` (see the module's docstring)."""
    return {"env": {"FAULT_MID_READ": how}}


def eval_events(n: int):
    def check(ctx: Ctx, runs: list[Run]) -> str | None:
        evals = sum(e.get("split") == "eval" for e in snapshot(ctx.workdir).events) - ctx.vars["evals"]
        return None if evals == n else f"{evals} eval events appended, not {n}"
    return check


def exported(step: int):
    def check(ctx: Ctx, runs: list[Run]) -> str | None:
        folder = ctx.path("run", "export")
        found = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
        return None if str(step) in found else f"export/ holds {found}, not {step}"
    return check


SHIM = files({"sitecustomize.py": MID_READ})
# Another run to warm-start from, its newest checkpoint half-written (the data file cut in half).
SOURCE = SHORT | {"export": False}


def source_run(ctx: Ctx) -> None:
    ctx.vars["workdir"] = ctx.path("source")
    try:
        ctx.must_run(main(base=SOURCE))
    finally:
        ctx.vars["workdir"] = ctx.workdir


CASES: list[Case] = [
    # The reported case: the side-car skips ckpt-40, deleted mid-read as ckpt-60 is written, then evaluates ckpt-60.
    ok("sidecar_rotated_mid_read", "the side-car's ckpt-40 rotated away mid-read (ckpt-60 written): skipped, then "
       "ckpt-60 evaluated (was: ckpt-60 skipped too, its read re-reading the vanished ckpt-40: exit 2)",
       main("--mode=continuous_eval", "--config.train.steps=60", "--config.eval.trainer_gone_s=3",
            "--config.eval.continuous_timeout_s=60", "--config.train.allow_changed=train.steps"),
       setup=steps(trained(), SHIM), **mid_read("rotate:ckpt-40:ckpt-60"),
       check=all_of(FIRED, in_output(r"skipping unreadable checkpoint \S+ckpt-40"), POISON, eval_events(1))),
    # Neighbours: the other readers of a checkpoint that goes away mid-read fall back to the one before it.
    ok("eval_mode_newest_vanishes_mid_read", "--mode=eval: ckpt-40 unreadable mid-read: falls back to ckpt-20 and "
       "evaluates it", main("--mode=eval"), setup=steps(trained(), SHIM), **mid_read("hide:ckpt-40"),
       check=all_of(FIRED, in_output(r"falling back to \S+ckpt-20"), POISON, eval_events(1))),
    ok("export_mode_newest_vanishes_mid_read", "--mode=export: ckpt-40 unreadable mid-read: exports ckpt-20",
       main("--mode=export", "--config.export=True"), setup=steps(trained(), SHIM), **mid_read("hide:ckpt-40"),
       check=all_of(FIRED, in_output(r"falling back to \S+ckpt-20"), POISON, exported(20))),
    ok("warm_start_newest_half_written", "config.init_checkpoint=another run whose ckpt-40 is half-written: warm "
       "starts from its ckpt-20 (was: an IndexError traceback)",
       main("--config.init_checkpoint={dir}/source"),
       setup=steps(source_run, truncate("source/checkpoints/ckpt-40.data-00000-of-00001")),
       check=all_of(in_output(r"falling back to \S+ckpt-20"), in_output(r"warm start: \d+ of \d+ weights from "
                                                                        r"\S+ckpt-20"), checkpoints_are(20, 40))),
    error("warm_start_only_checkpoint_half_written", "config.init_checkpoint names a half-written ckpt-N itself: "
          "one line, nothing trained", main("--config.init_checkpoint={dir}/source/checkpoints/ckpt-40"),
          r"config\.init_checkpoint: no readable checkpoint in \S+ckpt-40",
          setup=steps(source_run, truncate("source/checkpoints/ckpt-40.data-00000-of-00001")),
          fresh_stays_empty=False),
]
