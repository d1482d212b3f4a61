"""Fault cases of issue 23, part two: full and read-only disks, remote workdirs, SIGHUP, frozen workers,
the side-car after the trainer ended, non-finite eval metrics and labels outside the model's classes.

Disk cases mount a file system of their own on the case's workdir (root only: a 16 MB tmpfs, or an ext4
image that the kernel remounts read-only on a forced error, as it does on a failing disk), and unmount
it after the case."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable

from tests.stress.fault_harness import (
    ROOT,
    Case,
    Check,
    Ctx,
    Fault,
    Run,
    SetupError,
    error,
    ok,
    send,
    send_worker,
    snapshot,
)
from tests.stress.fault_steps import (
    LAUNCHED,
    LONG,
    all_of,
    checkpoints_are,
    freeze,
    image_folders,
    in_output,
    launch,
    main,
    not_in_output,
    resumed_where_saved,
    same_as_uninterrupted,
    steps,
    task_module,
    train_events_once,
    trained,
)

MULTI = {"multi": True, "timeout": 240.0}
# Long enough to fill or break the disk mid-run: checkpoints at 5000 and 10000 before the fault at 12000.
# A constant schedule: the rerun may stop earlier (train.steps) without changing the run (resume_check).
DISK_BASE = dict(LONG, **{"train.steps": 200000, "train.log_every_steps": 1000, "train.eval_every_steps": 5000,
                          "optimizer.schedule": "constant"})
DISK_RUN = main("--mode=train", base=DISK_BASE)


# ---------------------------------------------------------------------------- file systems of their own

def _sh(*args: str) -> None:
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SetupError(f"`{' '.join(args)}` failed: {done.stderr.strip()[:200]}")


def _mount(ctx: Ctx, *args: str) -> None:
    if os.geteuid() != 0:
        raise SetupError("mounting a file system for the case needs root")
    os.makedirs(ctx.workdir, exist_ok=True)
    _sh("mount", *args, ctx.workdir)
    ctx.closers.append(lambda: subprocess.run(["umount", "-l", ctx.workdir], capture_output=True, check=False))


def tmpfs(ctx: Ctx) -> None:
    """A 16 MB tmpfs on the workdir."""
    _mount(ctx, "-t", "tmpfs", "-o", "size=16m,mode=0755", "tmpfs")


def ext4(ctx: Ctx) -> None:
    """A 64 MB ext4 image on the workdir, remounted read-only by the kernel on an error (errors=remount-ro)."""
    image = ctx.path("disk.img")
    _sh("truncate", "-s", "64M", image)
    _sh("mkfs.ext4", "-q", "-F", image)
    _mount(ctx, "-o", "loop,errors=remount-ro", image)
    os.chmod(ctx.workdir, 0o755)


def fill(path: str) -> None:
    """Writes into `path` until the file system is full."""
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()
        except OSError:
            pass


def fill_workdir(proc) -> None:
    """The fault: the workdir's file system filled up (the workdir read from the command's --workdir)."""
    fill(os.path.join(_workdir_of(proc), "filler"))


def break_to_read_only(proc) -> None:
    """The fault: ext4 reports an error, the kernel remounts the workdir read-only (as on a failing disk)."""
    source = subprocess.run(["findmnt", "-no", "SOURCE", _workdir_of(proc)], capture_output=True, text=True).stdout
    with open(f"/sys/fs/ext4/{os.path.basename(source.strip())}/trigger_fs_error", "w") as f:
        f.write("1")


def _workdir_of(proc) -> str:
    import psutil
    args = psutil.Process(proc.pid).cmdline()
    return next(a.split("=", 1)[1] for a in args if a.startswith("--workdir="))


def read_only(ctx: Ctx) -> None:
    """The mounted workdir, read-only from the start (after a trained run was written into it)."""
    _sh("mount", "-o", "remount,ro", ctx.workdir)


def trained_into_mount(mount: Callable[[Ctx], None]) -> Callable[[Ctx], None]:
    """A file system of its own on the workdir, with the SHORT run trained in it (checkpoints 20, 40)."""
    def run(ctx: Ctx) -> None:
        mount(ctx)
        ctx.must_run(main())
        ctx.vars["evals"] = sum(e.get("split") == "eval" for e in snapshot(ctx.workdir).events)
    return run


def full(ctx: Ctx) -> None:
    fill(os.path.join(ctx.workdir, "filler"))


def free_and_rerun(args: list[str], resumed: int) -> Check:
    """After the failure: the filler removed (or the file system made writable again), a rerun resumes from
    `resumed` and finishes: nothing written before the failure was lost."""
    def check(ctx: Ctx, runs: list[Run]) -> str | None:
        if os.path.exists(os.path.join(ctx.workdir, "filler")):
            os.remove(os.path.join(ctx.workdir, "filler"))
        rerun = ctx.run(args)
        if rerun.code != 0:
            return f"the rerun after freeing space exited {rerun.code}: {rerun.last_lines(1)}"
        found = re.findall(r"resumed from step (\d+)", rerun.output)
        return None if found and int(found[0]) >= resumed else f"the rerun resumed from {found or 'nothing'}"
    return check


def no_stray(*names: str) -> Check:
    """No local directory named like a URL's scheme (gs:, s3:) made in the working directory."""
    def check(ctx: Ctx, runs: list[Run]) -> str | None:
        made = [n for n in names if os.path.exists(os.path.join(ROOT, n))]
        return f"made {made} in {ROOT}" if made else None
    return check


# ---------------------------------------------------------------------------- eval data

NAN_EVAL_TASK = """
class NanEval(Tiny):
    def eval_arrays(self):
        arrays = super().train_arrays()
        arrays["inputs"] = arrays["inputs"][:64].copy()
        arrays["label"] = arrays["label"][:64]
        arrays["inputs"][3, 0] = np.nan
        return arrays
"""


def strict_json_with_flag(ctx: Ctx, runs: list[Run]) -> str | None:
    """metrics.jsonl parses with a strict reader; the eval events flag their non-finite loss as null."""
    def refuse(constant):
        raise ValueError(f"bare {constant}")
    with open(os.path.join(ctx.workdir, "metrics.jsonl")) as f:
        try:
            events = [json.loads(line, parse_constant=refuse) for line in f if line.strip()]
        except ValueError as e:
            return f"metrics.jsonl is not strict JSON: {e}"
    evals = [e for e in events if e["split"] == "eval"]
    if not evals or not all(e["loss"] is None and e.get("nonfinite") == ["loss"] for e in evals):
        return f"eval events {evals[:1]} do not flag the non-finite loss"
    warned = len(re.findall(r"eval at step \d+: loss not finite", runs[-1].output))
    return None if warned == 1 else f"warned {warned} times, not once"


def tfrecords(ctx: Ctx) -> None:
    """Two-class JPEG TFRecords in {dir}/data."""
    image_folders(ctx)
    ctx.must_run(["mwloop.data.make_tfrecords", "--input={dir}/images", "--output={dir}/data", "--shards=1",
                  "--validation_fraction=0.5"])


TINY_IMAGENET = ["--config.dataset.data_dir={dir}/data", "--config.dataset.image_size=32",
                 "--config.dataset.shuffle_buffer=4", "--config.model.blocks=(1,1)", "--config.model.width=8",
                 "--config.train.global_batch_size=2", "--config.eval.global_batch_size=2", "--config.train.steps=4",
                 "--config.train.steps_per_loop=2", "--config.train.log_every_steps=2",
                 "--config.train.eval_every_steps=0", "--config.train.checkpoint_every_steps=2",
                 "--config.optimizer.warmup_steps=0", "--config.export=False"]


def imagenet(*extra: str) -> list[str]:
    return main(*TINY_IMAGENET, *extra, config="configs/resnet.py:imagenet", base={})


# ---------------------------------------------------------------------------- frozen workers

def freeze_worker(index: int, seconds: float):
    """Worker `index` of a launcher SIGSTOPped for `seconds` (then SIGCONT), from a thread."""
    def act(proc) -> None:
        from tests.stress.fault_harness import workers
        freeze(workers(proc)[index].pid, seconds)
    return act


def cut_link(seconds: float):
    """The job's network (its namespace's loopback, which carries every worker-to-worker link) down for
    `seconds`, then up again (root: nsenter into the workers' namespace)."""
    def act(proc) -> None:
        pid = str(proc.pid)  # the launcher: it made the namespace and outlives the workers it restarts
        _sh("nsenter", "-t", pid, "-n", "ip", "link", "set", "lo", "down")

        def restore() -> None:
            time.sleep(seconds)
            subprocess.run(["nsenter", "-t", pid, "-n", "ip", "link", "set", "lo", "up"], capture_output=True,
                           check=False)
        import threading
        threading.Thread(target=restore, daemon=True).start()
    return act


RESTARTED = launch()  # the launcher's default: 3 restarts
FAIL_FAST = launch(launcher=["--max_restarts=0"])
SIDE_CAR = main("--mode=continuous_eval", "--config.train.steps=2000", "--config.eval.trainer_gone_s=5",
                "--config.eval.continuous_timeout_s=600")

CASES: list[Case] = [
    # ------------------------------------------------------------------ full and read-only disks
    error("disk_full_mid_run", "one line naming the path and 'No space left'; a rerun with space resumes",
          DISK_RUN, r"No space left on device", setup=tmpfs, fresh_stays_empty=False,
          fault=Fault("the 16 MB workdir filled at step 12000", fill_workdir, at_step=12000),
          check=free_and_rerun(main("--mode=train", "--config.train.steps=12000", base=DISK_BASE), 10000)),
    error("disk_full_before_start", "full before the first write: one line, nothing half-written", main(),
          r"No space left|cannot write checkpoints", setup=steps(tmpfs, full), fresh_stays_empty=False),
    error("disk_full_resume", "resuming on a full disk: one line; the checkpoints stay readable",
          main("--config.train.steps=80", "--config.train.allow_changed=train.steps"), r"No space left",
          setup=steps(trained_into_mount(tmpfs), full), check=checkpoints_are(20, 40)),
    error("disk_full_mode_eval", "--mode=eval on a full disk: one line; metrics.jsonl whole", main("--mode=eval"),
          r"No space left", setup=steps(trained_into_mount(tmpfs), full), check=train_events_once),
    error("disk_full_mode_export", "--mode=export on a full disk: one line naming the cause",
          main("--mode=export", "--config.export=True"), r"No space left",
          setup=steps(trained_into_mount(tmpfs), full)),
    error("disk_full_sidecar", "the side-car on a full disk: one line", SIDE_CAR, r"No space left",
          setup=steps(trained_into_mount(tmpfs), full)),
    error("read_only_mid_run", "remounted read-only at step 12000: one line naming the path; checkpoints kept",
          DISK_RUN, r"Read-only file system", setup=ext4, fresh_stays_empty=False,
          fault=Fault("ext4 error -> remounted read-only at step 12000", break_to_read_only, at_step=12000),
          check=lambda ctx, runs: None if 10000 in snapshot(ctx.workdir).checkpoints else "ckpt-10000 is gone"),
    error("read_only_train", "training into a read-only workdir: one line", main("--config.train.steps=80"),
          r"Read-only file system", setup=steps(trained_into_mount(tmpfs), read_only), check=checkpoints_are(20, 40)),
    error("read_only_mode_eval", "--mode=eval on a read-only workdir: one line naming the path",
          main("--mode=eval"), r"Read-only file system", setup=steps(trained_into_mount(tmpfs), read_only)),
    error("read_only_mode_export", "--mode=export on a read-only workdir: one line",
          main("--mode=export", "--config.export=True"), r"Read-only file system",
          setup=steps(trained_into_mount(tmpfs), read_only)),
    error("read_only_sidecar", "the side-car on a read-only workdir: one line", SIDE_CAR,
          r"Read-only file system", setup=steps(trained_into_mount(tmpfs), read_only)),
    error("gcs_unreachable", "gs:// with no network: one line naming it; no local gs: directory",
          main("--workdir=gs://mwloop-no-such-bucket/run"), r"gs://mwloop-no-such-bucket/run.*reached",
          check=no_stray("gs:"), timeout=240.0),
    error("s3_unsupported", "s3:// (no such file system): one line; no local s3: directory",
          main("--workdir=s3://bucket/run"), r"no file system for s3://", check=no_stray("s3:")),
    error("hdfs_unsupported", "hdfs://: one line; no local hdfs: directory", main("--workdir=hdfs://nn/run"),
          r"no file system for hdfs://", check=no_stray("hdfs:")),
    error("s3_mode_eval", "--mode=eval on s3://: one line", main("--mode=eval", "--workdir=s3://bucket/run"),
          r"no file system for s3://", check=no_stray("s3:")),
    error("s3_sidecar", "the side-car on s3://: one line", SIDE_CAR[:2] + ["--workdir=s3://bucket/run"]
          + SIDE_CAR[3:], r"no file system for s3://", check=no_stray("s3:")),

    # ------------------------------------------------------------------ SIGHUP and frozen workers
    ok("sighup_saves_exits_42", "SIGHUP (terminal closed) saves at the step, exits 42; rerun resumes, bitwise equal",
       main("--mode=train", base=LONG), fault=Fault("SIGHUP at step 2000", send(signal.SIGHUP), at_step=2000),
       codes=(42,), rerun=main("--mode=train", base=LONG),
       check=all_of(resumed_where_saved, train_events_once, same_as_uninterrupted(main("--mode=train", base=LONG),
                                                                                 20000))),
    ok("launch_sighup_launcher", "workers save at one step (exit 42), launcher exits 129; rerun resumes there",
       FAIL_FAST, fault=Fault("SIGHUP to the launcher at step 1500", send(signal.SIGHUP), at_step=1500),
       codes=(129,), rerun=FAIL_FAST, check=all_of(resumed_where_saved, in_output(r"SIGHUP: the workers saved", 0)),
       **MULTI),
    ok("launch_nohup_sighup_launcher", "under nohup a SIGHUP to the launcher changes nothing: it trains to its end, "
       "exit 0", ["tests.stress.nohup", *FAIL_FAST],
       fault=Fault("SIGHUP to the nohup'd launcher at step 1500", send(signal.SIGHUP), at_step=1500),
       check=all_of(not_in_output(r"SIGHUP"), in_output(r"all 2 workers finished")), **MULTI),
    ok("launch_sighup_worker", "a worker's SIGHUP: every worker saves at one step, exit 42; rerun resumes",
       FAIL_FAST, fault=Fault("SIGHUP to worker 1 at step 1500", send_worker(1, signal.SIGHUP), at_step=1500),
       codes=(42,), rerun=FAIL_FAST, check=resumed_where_saved, **MULTI),
    ok("launch_frozen_worker_restarts", "worker 1 SIGSTOPped 20 s: one line naming it, restart from the last "
       "checkpoint, finishes bitwise equal to an uninterrupted run", RESTARTED,
       fault=Fault("SIGSTOP worker 1 for 20 s at step 1500", freeze_worker(1, 20), at_step=1500),
       check=all_of(in_output(r"restart 1/3: .*worker 1 stopped answering"), not_in_output(r"Traceback"),
                    in_output(r"resumed from step \d+000"),
                    same_as_uninterrupted(launch(launcher=["--max_restarts=0"]), LAUNCHED["train.steps"])), **MULTI),
    ok("launch_link_cut_restarts", "the workers' link down 60 s: one line naming the lost task, restarts from "
       "the last checkpoint, finishes bitwise equal to an uninterrupted run", RESTARTED,
       fault=Fault("the job's loopback down for 60 s at step 1500", cut_link(60), at_step=1500),
       check=all_of(in_output(r"restart \d/3: .*stopped answering"), not_in_output(r"Traceback"),
                    in_output(r"resumed from step \d+000"),
                    same_as_uninterrupted(launch(launcher=["--max_restarts=0"]), LAUNCHED["train.steps"])),
       **dict(MULTI, timeout=420.0)),
    error("launch_frozen_worker_fail_fast", "--max_restarts=0: one line naming worker 1, exit non-zero",
          FAIL_FAST, r"worker 1 stopped answering",
          fault=Fault("SIGSTOP worker 1 for 20 s at step 1500", freeze_worker(1, 20), at_step=1500),
          fresh_stays_empty=False, **MULTI),
    ok("launch_crash_default_restarts", "a SIGKILLed worker is restarted by default and the run finishes",
       RESTARTED, fault=Fault("SIGKILL to worker 1 at step 1500", send_worker(1, signal.SIGKILL), at_step=1500),
       check=all_of(in_output(r"restart 1/3"), in_output(r"resumed from step \d+000"), train_events_once), **MULTI),

    # ------------------------------------------------------------------ the side-car after the trainer ended
    ok("sidecar_after_early_end", "the trainer ended at step 40 of 2000: the side-car evaluates ckpt-40 and stops",
       SIDE_CAR, setup=trained(), check=all_of(in_output(r"the trainer is gone"),
                                               in_output(r"eval of ckpt-40 at step 40"))),
    ok("sidecar_after_trainer_failed", "the trainer failed (NaN at step 30): the side-car stops after ckpt-20",
       SIDE_CAR, setup=lambda ctx: ctx.must_run(main("--config.nan_at_steps=(30,)"), codes=(2,)),
       check=all_of(in_output(r"the trainer is gone"), in_output(r"eval of ckpt-20 at step 20"))),
    ok("sidecar_stops_at_train_steps", "a finished run's side-car stops at train.steps at once",
       main("--mode=continuous_eval", "--config.eval.continuous_timeout_s=600"), setup=trained(),
       check=all_of(in_output(r"eval of ckpt-40 at step 40"), not_in_output(r"trainer is gone"))),

    # ------------------------------------------------------------------ eval data
    ok("eval_nan_input", "NaN eval loss: strict JSON (null + nonfinite), warned once with split and step, exit 0",
       main("--config.task=faulttasks.naneval:NanEval", "--config.train.eval_every_steps=10"),
       setup=task_module("naneval", NAN_EVAL_TASK), check=strict_json_with_flag),
    ok("eval_nan_never_best", "with best_checkpoint on eval/loss a NaN eval is never the best: none saved",
       main("--config.task=faulttasks.naneval:NanEval", "--config.best_checkpoint.metric=eval/loss",
            "--config.best_checkpoint.mode=min"), setup=task_module("naneval", NAN_EVAL_TASK),
       check=lambda ctx, runs: "a best checkpoint was saved" if os.path.isdir(
           os.path.join(ctx.workdir, "best_checkpoint")) and os.listdir(os.path.join(ctx.workdir, "best_checkpoint"))
       else None),
    error("label_out_of_range", "label 1 with 1 class: one line naming the value and the range",
          imagenet("--config.dataset.num_classes=1"), r"label 1 is outside the model's 1 classes \(0\.\.0\)",
          setup=tfrecords, fresh_stays_empty=False, timeout=240.0),
    error("label_out_of_range_no_smoothing", "the same without label smoothing (sparse loss)",
          imagenet("--config.dataset.num_classes=1", "--config.train.label_smoothing=0.0"),
          r"label 1 is outside the model's 1 classes", setup=tfrecords, fresh_stays_empty=False, timeout=240.0),
    error("label_out_of_range_train_mode", "--mode=train too (the check is in the loss): one line",
          imagenet("--config.dataset.num_classes=1", "--mode=train"), r"label 1 is outside the model's 1 classes",
          setup=tfrecords, fresh_stays_empty=False, timeout=240.0),
]
