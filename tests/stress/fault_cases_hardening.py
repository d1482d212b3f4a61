"""Fault cases of issue 23 (hardening, round two): changed settings on resume, planted files, disks, remote
workdirs, signals and frozen peers, the side-car, eval data. Joined to `fault_cases.CASES`."""

from __future__ import annotations

import json
import os

from tests.stress.fault_harness import ROOT, Case, Check, Ctx, Run, error, ok, snapshot
from tests.stress.fault_steps import (
    SHORT,
    all_of,
    checkpoints_are,
    in_output,
    main,
    not_in_output,
    same_as_uninterrupted,
    steps,
    trained,
)

# ---------------------------------------------------------------------------- checks

def recorded(key: str, value) -> Check:
    """config.json still records `key` (dotted) = `value`: the refused resume rewrote nothing."""
    def check(ctx: Ctx, runs: list[Run]) -> str | None:
        with open(ctx.path("run", "config.json")) as f:
            tree = json.load(f)
        for part in key.split("."):
            tree = tree[part]
        return None if tree == value else f"config.json now records {key}={tree!r}, not {value!r}"
    return check


def events_unchanged(ctx: Ctx, runs: list[Run]) -> str | None:
    before, after = ctx.snapshots[0].events, snapshot(ctx.workdir).events
    return None if before == after else f"metrics.jsonl went from {len(before)} to {len(after)} events"


def resume_event(**changed) -> Check:
    """metrics.jsonl records the allowed change: {"split": "resume", "changed": {key: {old, new}}}."""
    def check(ctx: Ctx, runs: list[Run]) -> str | None:
        events = [e for e in snapshot(ctx.workdir).events if e.get("split") == "resume"]
        want = {k.replace("__", "."): {"old": o, "new": n} for k, (o, n) in changed.items()}
        return None if events and events[-1]["changed"] == want else f"resume events {events}, expected {want}"
    return check


def no_path(relative: str) -> Check:
    def check(ctx: Ctx, runs: list[Run]) -> str | None:
        return f"{relative} exists" if os.path.lexists(ctx.path(relative)) else None
    return check


def unchanged_file(relative: str, text: str) -> Check:
    """A file outside the workdir (a planted link's target) still holds `text`."""
    def check(ctx: Ctx, runs: list[Run]) -> str | None:
        with open(ctx.path(relative)) as f:
            now = f.read()
        return None if now == text else f"{relative} was written through a link: {now[:60]!r}"
    return check


# ---------------------------------------------------------------------------- setups

def planted(setup_links: dict[str, str], victim_text: str = "precious\n", mkdirs: tuple[str, ...] = ()):
    """`victim` (outside the workdir) holding `victim_text`, the workdir, and links in it: {link: target}, paths
    relative to the case directory."""
    def run(ctx: Ctx) -> None:
        ctx.write("victim", victim_text)
        os.makedirs(ctx.path("private"), exist_ok=True)
        os.makedirs(ctx.workdir, exist_ok=True)
        for folder in mkdirs:
            os.makedirs(ctx.path(folder), exist_ok=True)
        for link, target in setup_links.items():
            os.symlink(ctx.path(target), ctx.path(link))
    return run


def owned_by_nobody(relative: str):
    def run(ctx: Ctx) -> None:
        os.makedirs(ctx.path(relative), exist_ok=True)
        os.chown(ctx.path(relative), 65534, 65534)
    return run


def world_writable(ctx: Ctx) -> None:
    os.makedirs(ctx.workdir, exist_ok=True)
    os.chmod(ctx.workdir, 0o777)


def hard_link(ctx: Ctx) -> None:
    ctx.write("victim", "precious\n")
    os.makedirs(ctx.workdir, exist_ok=True)
    os.link(ctx.path("victim"), ctx.path("run", "metrics.jsonl"))


RESUME_EXACT = {"train.steps": 80, "deterministic": True, "optimizer.schedule": "constant"}
EXTEND = "--config.train.allow_changed=train.steps"
HINT = r"allow_changed="

CASES: list[Case] = [
    # ------------------------------------------------------------------ changed settings on resume
    error("resume_other_batch", "names global_batch_size 64 -> 128 and the flag; config.json and metrics kept",
          main("--config.train.global_batch_size=128"), r"train\.global_batch_size: 64 -> 128.*" + HINT,
          setup=trained(), check=all_of(recorded("train.global_batch_size", 64), events_unchanged,
                                        checkpoints_are(20, 40))),
    error("resume_longer_cosine", "names train.steps 40 -> 80 (the schedule re-stretched) and the flag",
          main("--config.train.steps=80"), r"train\.steps: 40 -> 80.*re-stretches.*" + HINT, setup=trained(),
          check=all_of(recorded("train.steps", 40), events_unchanged)),
    error("resume_past_train_steps", "checkpoint at step 40 past train.steps=20: an error, nothing exported",
          main("--config.train.steps=20", "--config.export=True"), r"step 40, past config\.train\.steps=20",
          setup=trained(), check=all_of(no_path("run/export"), events_unchanged)),
    error("resume_past_train_steps_eval_mode", "train_and_eval past train.steps: an error, not an eval",
          main("--config.train.steps=30"), r"past config\.train\.steps=30", setup=trained(), check=events_unchanged),
    error("resume_other_seed", "names seed 0 -> 7", main("--config.seed=7"), r"seed: 0 -> 7", setup=trained()),
    error("resume_other_learning_rate", "names optimizer.learning_rate", main("--config.optimizer.learning_rate=0.05"),
          r"optimizer\.learning_rate: 0\.1 -> 0\.05", setup=trained()),
    error("resume_other_schedule", "names optimizer.schedule", main("--config.optimizer.schedule=linear"),
          r"optimizer\.schedule: cosine -> linear", setup=trained()),
    error("resume_other_momentum", "names optimizer.momentum", main("--config.optimizer.momentum=0.5"),
          r"optimizer\.momentum", setup=trained()),
    error("resume_other_data_split", "names dataset.eval_fraction", main("--config.dataset.eval_fraction=0.3"),
          r"dataset\.eval_fraction: 0\.2 -> 0\.3", setup=trained()),
    error("resume_other_label_smoothing", "names train.label_smoothing", main("--config.train.label_smoothing=0.1"),
          r"train\.label_smoothing", setup=trained()),
    error("resume_other_warmup", "names optimizer.warmup_steps", main("--config.optimizer.warmup_steps=10"),
          r"optimizer\.warmup_steps", setup=trained()),
    error("resume_two_changes", "names both changes and both keys in the flag",
          main("--config.train.global_batch_size=32", "--config.seed=3"),
          r"allow_changed=(seed,train\.global_batch_size|train\.global_batch_size,seed)", setup=trained()),
    error("resume_partly_allowed", "allowing one of two changes still names the other",
          main("--config.train.global_batch_size=32", "--config.seed=3",
               "--config.train.allow_changed=train.global_batch_size"), r"seed: 0 -> 3", setup=trained()),
    ok("resume_allowed_batch", "continues with the new batch; the change recorded in metrics.jsonl",
       main("--config.train.global_batch_size=128", "--config.train.steps=60",
            "--config.train.allow_changed=train.global_batch_size,train.steps"), setup=trained(),
       check=all_of(in_output(r"resumed from step 40"), resume_event(train__global_batch_size=(64, 128),
                                                                     train__steps=(40, 60)),
                    recorded("train.global_batch_size", 128), checkpoints_are(20, 40, 60))),
    ok("resume_allowed_prefix", "allow_changed=optimizer allows every optimizer key",
       main("--config.optimizer.learning_rate=0.05", "--config.optimizer.momentum=0.8", "--config.train.steps=60",
            "--config.train.allow_changed=optimizer,train.steps"), setup=trained(),
       check=resume_event(optimizer__learning_rate=(0.1, 0.05), optimizer__momentum=(0.9, 0.8),
                          train__steps=(40, 60))),
    ok("resume_extend_allowed", "extends a cosine run on purpose (train.steps 40 -> 80, recorded)",
       main("--config.train.steps=80", EXTEND), setup=trained(),
       check=all_of(in_output(r"resumed from step 40"), resume_event(train__steps=(40, 80)),
                    checkpoints_are(40, 60, 80))),
    ok("resume_extend_constant_schedule", "a constant schedule extends without a flag (every rate as it was)",
       main("--config.train.steps=80", "--config.optimizer.schedule=constant"),
       setup=trained("--config.optimizer.schedule=constant"), check=in_output(r"resumed from step 40")),
    ok("resume_other_steps_per_loop_exact", "steps_per_loop 10 -> 5 passes; bitwise equal to an uninterrupted run",
       main("--config.train.steps_per_loop=5", base=dict(SHORT, **RESUME_EXACT)),
       setup=trained("--config.train.steps=40", "--config.deterministic=True", "--config.optimizer.schedule=constant"),
       check=all_of(in_output(r"resumed from step 40"),
                    same_as_uninterrupted(main(base=dict(SHORT, **RESUME_EXACT)), 80))),
    ok("resume_other_accumulation", "gradient accumulation k=1 -> 4 passes (one update either way)",
       main("--config.optimizer.gradient_accumulation_steps=4", "--config.train.steps=60", EXTEND), setup=trained(),
       check=all_of(in_output(r"resumed from step 40"), resume_event(train__steps=(40, 60)))),
    ok("resume_other_intervals", "log/eval/checkpoint intervals and max_to_keep change freely",
       main("--config.train.log_every_steps=5", "--config.train.eval_every_steps=10", "--config.train.max_to_keep=9",
            "--config.train.checkpoint_every_steps=10", "--config.train.steps=60", EXTEND), setup=trained(),
       check=all_of(in_output(r"resumed from step 40"), checkpoints_are(20, 40, 50, 60))),
    ok("resume_same_settings", "a plain rerun of a finished run: nothing to train, no resume event",
       main(), setup=trained(), check=all_of(in_output(r"nothing to train"), not_in_output(r"changed settings"))),

    # ------------------------------------------------------------------ files in the workdir are not trusted
    error("lock_symlink_to_victim", "refuses the linked .lock; the target is untouched",
          main(), r"\.lock is a symlink", setup=planted({"run/.lock": "victim"}),
          check=unchanged_file("victim", "precious\n")),
    error("metrics_dangling_symlink", "refuses the linked metrics.jsonl; nothing created in the private dir",
          main(), r"metrics\.jsonl is a symlink", setup=planted({"run/metrics.jsonl": "private/planted.jsonl"}),
          check=no_path("private/planted.jsonl")),
    error("config_json_symlink", "refuses the linked config.json; the target is untouched", main(),
          r"config\.json is a symlink", setup=planted({"run/config.json": "victim"}),
          check=unchanged_file("victim", "precious\n")),
    error("config_tmp_symlink", "refuses a planted config.json.tmp link; the target is untouched", main(),
          r"config\.json\.tmp is a symlink", setup=planted({"run/config.json.tmp": "victim"}),
          check=unchanged_file("victim", "precious\n")),
    error("checkpoints_symlink", "refuses a linked checkpoints folder; nothing written there", main(),
          r"checkpoints is a symlink", setup=planted({"run/checkpoints": "private"}),
          check=lambda ctx, runs: f"wrote {os.listdir(ctx.path('private'))}" if os.listdir(ctx.path("private"))
          else None),
    error("summaries_symlink", "refuses a linked summaries folder", main(), r"summaries is a symlink",
          setup=planted({"run/summaries": "private"})),
    error("metrics_hard_link", "refuses a metrics.jsonl hard-linked elsewhere; the other name untouched", main(),
          r"metrics\.jsonl has 2 hard links", setup=hard_link, check=unchanged_file("victim", "precious\n")),
    error("workdir_of_another_user", "refuses a workdir owned by uid 65534", main(), r"belongs to uid 65534",
          setup=owned_by_nobody("run")),
    error("checkpoints_of_another_user", "refuses a checkpoints folder owned by uid 65534", main(),
          r"checkpoints belongs to uid 65534", setup=owned_by_nobody("run/checkpoints")),
    error("workdir_world_writable", "refuses a workdir every user can write", main(), r"writable by every user",
          setup=world_writable),
    error("eval_mode_planted_metrics", "--mode=eval refuses a linked metrics.jsonl too", main("--mode=eval"),
          r"metrics\.jsonl is a symlink",
          setup=steps(trained(), lambda ctx: (os.remove(ctx.path("run/metrics.jsonl")),
                                              os.symlink(ctx.path("victim"), ctx.path("run/metrics.jsonl")),
                                              ctx.write("victim", "precious\n"))),
          check=unchanged_file("victim", "precious\n")),
    error("sidecar_planted_metrics", "the side-car refuses a linked metrics.jsonl",
          main("--mode=continuous_eval", "--config.eval.continuous_timeout_s=5"), r"metrics\.jsonl is a symlink",
          setup=steps(trained(), lambda ctx: (os.remove(ctx.path("run/metrics.jsonl")),
                                              os.symlink(ctx.path("victim"), ctx.path("run/metrics.jsonl")),
                                              ctx.write("victim", "precious\n"))),
          check=unchanged_file("victim", "precious\n")),
    error("name_escapes_runs", "config.name='../x' cannot leave runs/; nothing made outside",
          ["mwloop.main", "--config=configs/mlp.py", "--config.name=../i23-escaped-case"], r"outside runs/",
          check=lambda ctx, runs: "made it" if os.path.exists(os.path.join(ROOT, "i23-escaped-case")) else None),
    error("name_absolute", "config.name='/tmp/...' cannot leave runs/",
          ["mwloop.main", "--config=configs/mlp.py", "--config.name=/tmp/i23-absolute-case"], r"outside runs/",
          check=lambda ctx, runs: "made /tmp/i23-absolute-case" if os.path.exists("/tmp/i23-absolute-case") else None),
]
