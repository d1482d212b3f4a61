"""The fault cases of `python -m tests.stress.faults`: one small definition each.

`error(...)` expects a CLEAR ERROR whose line matches `message`; `ok(...)`
expects the first command to exit with one of `codes` (0 by default), an
optional `rerun` to exit 0, and `check` to find nothing wrong. Arguments are
formatted with the case's values: {workdir} (its `run/` directory), {dir}
(the case directory, also on PYTHONPATH), {port0}, {port1}.
"""

from __future__ import annotations

import json
import signal

from tests.stress import (
    fault_cases_agree,
    fault_cases_artifacts,
    fault_cases_elastic,
    fault_cases_hardening,
    fault_cases_io,
    fault_cases_ps,
    fault_cases_readers,
    fault_cases_sweepdb,
    fault_cases_sweepvalues,
    fault_cases_usercode,
    reliability,
)
from tests.stress.fault_harness import Case, Fault, error, ok, send, send_worker
from tests.stress.fault_steps import (
    LONG,
    all_of,
    append,
    background_still_running,
    busy_workdir,
    checkpoints_are,
    eval_appended,
    files,
    image_folders,
    in_output,
    insert_line,
    kill_launcher_noting_workers,
    launch,
    main,
    no_new_eval,
    no_orphans,
    not_in_output,
    nothing_in,
    read_only_checkpoints,
    remove,
    resumed_from_newest_left,
    resumed_where_saved,
    same_as_uninterrupted,
    steps,
    sweep_recorded_failure,
    task_module,
    tf_config,
    train_events_once,
    trained,
    truncate,
)

CKPT = "run/checkpoints"
EXTEND = "--config.train.allow_changed=train.steps"  # a longer cosine run on purpose (resume_check)
LONG_RUN = main("--mode=train", base=LONG)
LAUNCHED_RUN = launch()
FAIL_FAST = launch(launcher=["--max_restarts=0"])  # the launcher's default restarts 3 times
MULTI = {"multi": True, "timeout": 180.0}


def export_still_serves(step: int):
    """export/<step> is still `latest`, loads, and no half-written export is left beside it."""
    def check(ctx, runs) -> str | None:
        import glob
        import os

        from tests.stress.fault_harness import export_load_error
        base = os.path.join(ctx.workdir, "export")
        if os.path.realpath(os.path.join(base, "latest")) != os.path.join(os.path.realpath(base), str(step)):
            return f"export/latest is {os.path.realpath(os.path.join(base, 'latest'))}, not export/{step}"
        if glob.glob(os.path.join(base, ".tmp-*")):
            return "a half-written export is left in export/"
        return export_load_error(os.path.join(base, str(step)), f"export/{step}")
    return check


def cluster(index: int) -> str:
    """A 2-worker TF_CONFIG for worker `index` (never started: the cases fail before connecting)."""
    return json.dumps({"cluster": {"worker": ["localhost:1", "localhost:2"]},
                       "task": {"type": "worker", "index": index}})


SWEEP = ["mwloop.sweep", "--workdir={dir}/sweep"]
# A task whose data loading never returns when config.stuck is set (issue 23: a sweep point that hangs).
STUCK_CONFIG = """import time
import mwloop
from examples.quickstart import Tumours
class Stuck(Tumours):
    def train_arrays(self):
        while self.config.stuck:
            time.sleep(1)
        return super().train_arrays()
def get_config(arg=None):
    config = mwloop.base_config(task=Stuck)
    config.name, config.hidden, config.stuck = "stuck", 8, False
    config.train.update(global_batch_size=32, steps=40, steps_per_loop=20, eval_every_steps=20)
    return config
"""
STUCK_SWEEP = """import os
from mwloop.sweep import product
CONFIG = os.path.join(os.path.dirname(__file__), "stuck.py")
def get_sweep():
    return product({"stuck": [False, True]})
"""
MAKE_TFRECORDS = ["mwloop.data.make_tfrecords", "--input={dir}/images", "--output={dir}/out", "--shards=2"]
IMAGENET = main("--config.dataset.data_dir={dir}/data", config="configs/resnet.py:imagenet", base={})

CASES: list[Case] = [
    # ------------------------------------------------------------------ the command line and config files
    error("config_syntax_error", "names the config file", main(config="{dir}/broken.py"), r"broken\.py",
          setup=files({"broken.py": "def get_config(arg=None:\n    return None\n"})),
    error("config_file_missing", "names the missing file", main(config="configs/nope.py"), r"nope\.py"),
    error("config_bad_variant", "names the unknown variant", main(config="configs/resnet.py:bogus"), r"bogus"),
    error("missing_config_flag", "asks for --config", ["mwloop.main", "--workdir={workdir}"], r"config"),
    error("unknown_override_key", "unknown key 'stepz', did you mean 'steps'", main("--config.train.stepz=3"),
          r"stepz.*steps"),
    error("unknown_flag", "names --wrokdir", main("--wrokdir=/tmp/x"), r"wrokdir"),
    error("unknown_mode", "names --mode=fit", main("--mode=fit"), r"fit"),
    error("stray_argument", "names the stray argument", main("extra"), r"extra"),
    error("wrong_type_string_for_int", "train.steps=abc is not an int", main("--config.train.steps=abc"),
          r"abc|train\.steps"),
    error("wrong_type_float_for_int", "train.steps=1.5 is not an int", main("--config.train.steps=1.5"),
          r"1\.5|train\.steps"),
    error("wrong_type_bool", "deterministic=maybe is not a bool", main("--config.deterministic=maybe"),
          r"maybe|deterministic"),

    # ------------------------------------------------------------------ values that cannot work
    error("train_steps_0", "train.steps=0", main("--config.train.steps=0"), r"train\.steps=0"),
    error("train_steps_negative", "train.steps=-5", main("--config.train.steps=-5"), r"train\.steps=-5"),
    error("steps_per_loop_0", "steps_per_loop=0", main("--config.train.steps_per_loop=0"), r"steps_per_loop=0"),
    error("eval_every_negative", "eval_every_steps=-1", main("--config.train.eval_every_steps=-1"),
          r"eval_every_steps=-1"),
    error("eval_fraction_1", "no training examples", main("--config.dataset.eval_fraction=1.0"), r"eval_fraction"),
    error("eval_fraction_0_with_eval", "nothing to evaluate", main("--config.dataset.eval_fraction=0.0"),
          r"0 examples|evaluate"),
    ok("eval_fraction_0_train_only", "trains without an eval set",
       main("--config.dataset.eval_fraction=0.0", "--mode=train"), check=checkpoints_are(20, 40)),
    error("batch_not_divisible", "63 among 2 replicas", main(
        "--config.distribution.strategy=mirrored", "--config.distribution.num_cpu_devices=2",
        "--config.train.global_batch_size=63"), r"63"),
    error("batch_0", "global_batch_size=0", main("--config.train.global_batch_size=0"), r"global_batch_size=0"),
    error("other_models_keys", "mlp's 'hidden' on resnet_small", main("--config.model.name=resnet_small"),
          r"hidden"),
    error("unknown_model", "names model 'vgg'", main("--config.model.name=vgg"), r"vgg"),
    error("unknown_dataset", "names dataset 'mnist'", main("--config.dataset.name=mnist"), r"mnist"),
    error("unknown_strategy", "names strategy 'tpu'", main("--config.distribution.strategy=tpu"), r"tpu"),
    # (Any Keras optimizer's name works since issue 21: a misspelt one must still be one line.)
    error("unknown_optimizer", "names optimizer 'adagrd'", main("--config.optimizer.name=adagrd"), r"adagrd"),
    error("bad_on_nonfinite", "names on_nonfinite='maybe'", main("--config.on_nonfinite=maybe"), r"on_nonfinite"),
    error("nan_loss", "non-finite loss at step 30; ckpt-20 kept, nothing saved after",
          main("--config.nan_at_steps=(30,)"), r"non-finite loss at step 30", check=checkpoints_are(20),
          fresh_stays_empty=False),

    # ------------------------------------------------------------------ user tasks
    error("task_import_unresolved", "names the module", main("--config.task=no_such_pkg.tasks:Mine"),
          r"no_such_pkg"),
    error("task_missing_attribute", "names the class", main("--config.task=examples.regression:Nope"), r"Nope"),
    error("task_not_a_task", "not a subclass of mwloop.Task", main("--config.task=collections:OrderedDict"),
          r"OrderedDict.*Task"),
    error("task_module_syntax_error", "names the task module", main("--config.task=faulttasks.broken:Tiny"),
          r"broken", setup=task_module("broken", "\ndef oops(:\n    pass\n")),
    error("task_scalar_loss", "loss returned a scalar; no checkpoint",
          main("--mode=train", "--config.task=faulttasks.scalar:Scalar"), r"scalar", check=checkpoints_are(),
          fresh_stays_empty=False, setup=task_module("scalar", """
class Scalar(Tiny):
    def loss(self, batch, outputs):
        return tf.reduce_mean(super().loss(batch, outputs))
""")),
    error("task_vector_metric_sum", "metric sums must be scalars; no checkpoint",
          main("--mode=train", "--config.task=faulttasks.vector:Vector"), r"shape", check=checkpoints_are(),
          fresh_stays_empty=False, setup=task_module("vector", """
class Vector(Tiny):
    def metric_sums(self, batch, outputs, weights):
        return {"positive": tf.reduce_sum(tf.cast(outputs > 0, tf.float32), axis=1)}
""")),
    error("task_no_build_model", "build_model missing", main("--config.task=faulttasks.nomodel:NoModel"),
          r"build_model", setup=task_module("nomodel", """
class NoModel(mwloop.Task):
    def train_arrays(self):
        return Tiny.train_arrays(self)

    def loss(self, batch, outputs):
        return outputs[:, 0]
""")),
    error("task_empty_train_arrays", "0 training examples", main("--mode=train",
          "--config.task=faulttasks.empty:Empty"), r"0 examples", setup=task_module("empty", """
class Empty(Tiny):
    def train_arrays(self):
        return {k: v[:0] for k, v in super().train_arrays().items()}
""")),

    # ------------------------------------------------------------------ data on disk
    error("data_dir_missing", "data_dir is not a directory", IMAGENET, r"data_dir"),
    error("data_dir_empty_shards", "0 train records", IMAGENET, r"0 train records|empty|no train",
          setup=files({"data/train-00000-of-00001": b"", "data/validation-00000-of-00001": b""})),
    error("data_dir_garbage_shard", "not a TFRecord file", IMAGENET, r"TFRecord|truncated",
          setup=files({"data/train-00000-of-00001": b"garbage" * 100,
                       "data/validation-00000-of-00001": b"garbage" * 100})),

    # ------------------------------------------------------------------ workdirs, checkpoints, metrics
    error("export_empty_workdir", "no checkpoint to export", main("--mode=export"), r"no checkpoint"),
    error("eval_empty_workdir", "no checkpoint to evaluate", main("--mode=eval"), r"no checkpoint"),
    ok("eval_after_training", "evaluates the trained weights once (accuracy > 0.6)", main("--mode=eval"),
       setup=trained(), check=eval_appended(0.6)),
    error("eval_other_models_config", "checkpoint does not match; nothing appended",
          main("--mode=eval", "--config.model.hidden=(16,)"), r"does not match|does not hold", setup=trained(),
          check=no_new_eval),
    error("continuous_eval_other_model", "checkpoint does not hold this model; nothing appended",
          main("--mode=continuous_eval", "--config.model.hidden=(32,16)", "--config.eval.continuous_timeout_s=5"),
          r"does not hold|does not match|runs another run", setup=trained(), check=no_new_eval),
    error("continuous_eval_no_checkpoint", "saw no checkpoint",
          main("--mode=continuous_eval", "--config.eval.continuous_timeout_s=2"), r"no checkpoint"),
    error("resume_other_model", "checkpoint does not match this model", main("--config.model.hidden=(16,)"),
          r"does not match", setup=trained()),
    ok("rerun_finished_run", "no more training, nothing rewritten", main("--mode=train"), setup=trained(),
       check=all_of(in_output(r"nothing to train"), train_events_once, checkpoints_are(20, 40))),
    ok("truncated_latest_checkpoint", "falls back to ckpt-20 with a warning and resumes",
       main("--config.train.steps=60", EXTEND), setup=steps(trained(), truncate(f"{CKPT}/ckpt-40.data-00000-of-00001")),
       check=all_of(in_output(r"ckpt-40 is unreadable.*falling back"), in_output(r"resumed from step 20"),
                    train_events_once)),
    ok("garbage_latest_index", "falls back to ckpt-20 and resumes", main("--config.train.steps=60", EXTEND),
       setup=steps(trained(), files({f"{CKPT}/ckpt-40.index": b"\x00garbage" * 50})),
       check=all_of(in_output(r"falling back"), in_output(r"resumed from step 20"))),
    ok("missing_latest_data_file", "falls back to ckpt-20 and resumes", main("--config.train.steps=60", EXTEND),
       setup=steps(trained(), remove(f"{CKPT}/ckpt-40.data-00000-of-00001")),
       check=in_output(r"resumed from step 20")),
    ok("garbage_checkpoint_state_file", "resumes from ckpt-40 (found from the files)",
       main("--config.train.steps=60", EXTEND), setup=steps(trained(), files({f"{CKPT}/checkpoint": "garbage{\n"})),
       check=in_output(r"resumed from step 40")),
    ok("missing_checkpoint_state_file", "resumes from ckpt-40", main("--config.train.steps=60", EXTEND),
       setup=steps(trained(), remove(f"{CKPT}/checkpoint")), check=in_output(r"resumed from step 40")),
    error("only_checkpoint_unreadable", "no readable checkpoint; the files are kept",
          main("--config.train.steps=60", "--config.train.checkpoint_every_steps=40"), r"no readable checkpoint",
          setup=steps(trained("--config.train.checkpoint_every_steps=40"),
                      truncate(f"{CKPT}/ckpt-40.data-00000-of-00001")),
          check=checkpoints_are(40)),
    ok("torn_metrics_last_line", "resumes; the torn line dropped, the others kept",
       main("--config.train.steps=60", EXTEND),
       setup=steps(trained(), append("run/metrics.jsonl", '{"step": 41, "split": "tr')),
       check=all_of(in_output(r"resumed from step 40"), train_events_once)),
    error("garbage_metrics_middle_line", "names metrics.jsonl and the line; the file is kept",
          main("--config.train.steps=60", EXTEND), r"metrics\.jsonl line \d+",
          setup=steps(trained(), insert_line("run/metrics.jsonl", 1, "garbage"))),
    ok("torn_config_json", "resumes and rewrites config.json", main("--config.train.steps=60", EXTEND),
       setup=steps(trained(), files({"run/config.json": '{"name": "ml'})), check=in_output(r"resumed from step 40")),
    error("checkpoints_is_a_file", "cannot write checkpoints", main(), r"cannot write checkpoints",
          setup=files({CKPT: "not a directory"})),
    error("checkpoints_read_only", "cannot write checkpoints", main(), r"cannot write checkpoints",
          setup=read_only_checkpoints),
    error("workdir_is_a_file", "names the workdir", main(), r"run", setup=files({"run": "a file"})),
    error("busy_workdir", "in use by a live run (its pid); that run goes on", main(), r"in use",
          setup=busy_workdir, check=background_still_running),
    ok("stale_lock", "a dead run's lock is taken over", main(), setup=files({"run/.lock": "pid 999999 on gone\n"}),
       check=checkpoints_are(20, 40)),

    # ------------------------------------------------------------------ signals to one process
    ok("sigterm_resumes_exactly", "exits 42 saving at the step; rerun resumes there, bitwise equal", LONG_RUN,
       fault=Fault("SIGTERM at step 2000", send(signal.SIGTERM), at_step=2000), codes=(42,), rerun=LONG_RUN,
       check=all_of(resumed_where_saved, train_events_once, same_as_uninterrupted(LONG_RUN, 20000))),
    ok("sigint_saves_exits_130", "exits 130 saving at the step; rerun resumes there", LONG_RUN,
       fault=Fault("SIGINT at step 2000", send(signal.SIGINT), at_step=2000), codes=(130,), rerun=LONG_RUN,
       check=resumed_where_saved),
    # Loop calls of 50,000 MLP steps (~3 s here): both signals land inside the call after the first checkpoint.
    ok("double_sigint_exits_now", "exits 130 at once without saving; ckpt-50000 kept",
       main("--mode=train", "--config.train.steps=400000", "--config.train.steps_per_loop=50000",
            "--config.train.log_every_steps=50000", "--config.train.checkpoint_every_steps=50000", base=LONG),
       fault=Fault("SIGINT twice, 0.5 s apart, inside the loop call after step 50000",
                   send(signal.SIGINT, again_after_s=0.5, delay_s=0.3), at_step=50000),
       codes=(130,), check=all_of(in_output(r"without saving"), checkpoints_are(50000))),
    ok("sigkill_then_rerun_resumes", "killed; rerun resumes from the newest checkpoint, bitwise equal", LONG_RUN,
       fault=Fault("SIGKILL at step 7000", send(signal.SIGKILL), at_step=7000), codes=(-9,), rerun=LONG_RUN,
       check=all_of(resumed_from_newest_left, train_events_once, same_as_uninterrupted(LONG_RUN, 20000))),
    ok("sigint_during_startup", "exits 130 in one line, no traceback", main(),
       fault=Fault("SIGINT 1.5 s after start", send(signal.SIGINT), after_s=1.5), codes=(130,),
       check=all_of(not_in_output(r"Traceback"), in_output(r"interrupted"))),

    # ------------------------------------------------------------------ TF_CONFIG and the cluster
    ok("tf_config_empty_string", "an empty TF_CONFIG is no cluster: trains", main(), env={"TF_CONFIG": ""}),
    error("tf_config_empty_object", "TF_CONFIG has no cluster", main(), r"TF_CONFIG", env={"TF_CONFIG": "{}"}),
    error("tf_config_garbage", "TF_CONFIG is not JSON", main(), r"TF_CONFIG.*JSON", env={"TF_CONFIG": "{not json"}),
    error("tf_config_index_out_of_range", "task index outside the cluster", main(), r"index",
          env={"TF_CONFIG": cluster(5)}),
    error("tf_config_ps_task", "parameter servers without a chief", main(), r"ps",
          env={"TF_CONFIG": json.dumps({"cluster": {"worker": ["localhost:1"], "ps": ["localhost:2"]},
                                        "task": {"type": "worker", "index": 0}})}),
    error("peer_never_starts", "names the missing worker 1 after startup_timeout_s=10",
          main("--config.distribution.startup_timeout_s=10"), r"worker 1|localhost:{port1}|peer",
          setup=tf_config(0), **MULTI),
    error("port_in_use", "names the busy port", main("--config.distribution.startup_timeout_s=10"),
          r"{port0}|in use", setup=tf_config(0, occupy_own_port=True), **MULTI),

    # ------------------------------------------------------------------ the launcher (2 workers)
    error("launch_user_error_not_restarted", "unknown key, exit 2, no restart",
          launch("--config.train.stepz=3", launcher=["--max_restarts=2"]), r"stepz",
          check=not_in_output(r"restart \d"), **MULTI),
    error("launch_batch_not_divisible", "63 among 2 replicas, no restart",
          launch("--config.train.global_batch_size=63", launcher=["--max_restarts=2"]), r"63",
          check=not_in_output(r"restart \d"), **MULTI),
    ok("launch_sigterm_worker", "all exit 42 at one step; rerun resumes there", FAIL_FAST,
       fault=Fault("SIGTERM to worker 1 at step 1500", send_worker(1, signal.SIGTERM), at_step=1500), codes=(42,),
       rerun=LAUNCHED_RUN, check=all_of(resumed_where_saved, train_events_once), **MULTI),
    ok("launch_sigterm_worker_restart", "restarted, resumes at the saved step, exit 0",
       launch(launcher=["--max_restarts=1"]),
       fault=Fault("SIGTERM to worker 0 at step 1500", send_worker(0, signal.SIGTERM), at_step=1500),
       check=all_of(resumed_where_saved, in_output(r"restart 1/1")), **MULTI),
    ok("launch_sigkill_worker_restart", "restarted, resumes, bitwise equal (reliability.py's trial)",
       reliability._command("{workdir}", 2, 1)[2:],
       fault=Fault("SIGKILL to worker 1 at step 150", send_worker(1, signal.SIGKILL), at_step=150),
       check=all_of(in_output(r"restart 1/1"), same_as_uninterrupted(reliability._command("{workdir}", 2, 0)[2:],
                                                                     reliability.TOTAL_STEPS)), **MULTI),
    ok("launch_worker_crash_no_restart", "exit 137 naming the killed worker; rerun resumes", FAIL_FAST,
       fault=Fault("SIGKILL to worker 1 at step 1500", send_worker(1, signal.SIGKILL), at_step=1500),
       codes=(137,), rerun=LAUNCHED_RUN,
       check=all_of(in_output(r"worker 1 exited with -9", 0), resumed_from_newest_left), **MULTI),
    ok("launch_sigint_launcher", "workers save at one step, exit 130; rerun resumes there", LAUNCHED_RUN,
       fault=Fault("SIGINT to the launcher at step 1500", send(signal.SIGINT), at_step=1500), codes=(130,),
       rerun=LAUNCHED_RUN, check=resumed_where_saved, **MULTI),
    ok("launch_sigterm_launcher", "workers save at one step, exit 143; rerun resumes there", LAUNCHED_RUN,
       fault=Fault("SIGTERM to the launcher at step 1500", send(signal.SIGTERM), at_step=1500), codes=(143,),
       rerun=LAUNCHED_RUN, check=resumed_where_saved, **MULTI),
    ok("launch_sigkill_launcher", "workers die with it; rerun resumes from the newest checkpoint", LAUNCHED_RUN,
       fault=Fault("SIGKILL to the launcher at step 2500", kill_launcher_noting_workers, at_step=2500),
       codes=(-9,), rerun=LAUNCHED_RUN, check=all_of(no_orphans, resumed_from_newest_left), **MULTI),

    # ------------------------------------------------------------------ sweeps
    error("sweep_file_missing", "sweep file not found", SWEEP + ["--sweep={dir}/nope.py"], r"nope\.py"),
    error("sweep_syntax_error", "names the sweep file", SWEEP + ["--sweep={dir}/s.py"], r"s\.py",
          setup=files({"s.py": "CONFIG = 'configs/mlp.py'\ndef get_sweep(arg=None:\n    return []\n"})),
    error("sweep_unknown_key", "unknown key, did you mean", SWEEP + ["--sweep={dir}/s.py"], r"learnin_rate",
          setup=files({"s.py": "CONFIG = 'configs/mlp.py'\n"
                               "def get_sweep(arg=None):\n    return [{'optimizer.learnin_rate': 0.1}]\n"})),
    error("sweep_wrong_type", "train.steps='many' is not an int", SWEEP + ["--sweep={dir}/s.py"], r"train\.steps",
          setup=files({"s.py": "CONFIG = 'configs/mlp.py'\n"
                               "def get_sweep(arg=None):\n    return [{'train.steps': 'many'}]\n"})),
    error("sweep_config_missing", "names the missing config",
          SWEEP + ["--sweep=experiments/mlp_smoke.py", "--config=configs/nope.py"], r"nope\.py"),
    ok("sweep_failed_point_recorded", "exit 1; 2 points done, the failed one recorded with its error",
       SWEEP + ["--sweep=experiments/mlp_smoke.py:fail"], codes=(1,), check=sweep_recorded_failure),
    ok("sweep_interrupt_resumes", "stops on SIGINT; the rerun skips the finished point",
       SWEEP + ["--sweep=experiments/mlp_smoke.py"],
       fault=Fault("SIGINT after the first point", send(signal.SIGINT), on=r"\[1/2: 1 complete"), codes=(130,),
       rerun=SWEEP + ["--sweep=experiments/mlp_smoke.py"], check=in_output(r"2 trials, 1 finished before")),
    ok("sweep_point_stuck", "the point whose data never loads is named, stopped after --trial_stall_s and failed; "
       "the other completes; exit 1", SWEEP + ["--sweep={dir}/s.py", "--parallel=2", "--trial_stall_s=15"],
       codes=(1,), setup=files({"stuck.py": STUCK_CONFIG, "s.py": STUCK_SWEEP}),
       check=all_of(in_output(r"trial 1: no progress for \d+s \(its last line"), in_output(r"trial 0 complete"),
                    in_output(r"trial 1 failed: no progress for 1\ds .*raise --trial_stall_s"))),

    # ------------------------------------------------------------------ a file-size limit (issue 23)
    error("fsize_limit_final_export", "the final export of an extended run over the file-size limit: one line "
          "naming it and the fix; export/40 intact and still loads",
          ["tests.stress.with_fsize", "40000", *main("--config.train.steps=80", EXTEND, "--config.export=True")],
          r"File too large.*export/40 is intact: raise the file-size limit", setup=trained("--config.export=True"),
          check=export_still_serves(40)),

    # ------------------------------------------------------------------ make_tfrecords
    error("tfrecords_input_missing", "names the missing folder", MAKE_TFRECORDS, r"images", check=nothing_in("out")),
    error("tfrecords_input_empty", "no images (no class folders)", MAKE_TFRECORDS, r"no sub-folders|no image",
          setup=files({"images/.keep": ""}), check=nothing_in("out")),
    error("tfrecords_all_unreadable", "every image unreadable; nothing written", MAKE_TFRECORDS, r"unreadable",
          setup=files({"images/cats/a.jpg": b"not a jpeg", "images/dogs/b.png": b"not a png"}),
          check=nothing_in("out")),
    error("tfrecords_bad_fraction", "validation_fraction=1.5", MAKE_TFRECORDS + ["--validation_fraction=1.5"],
          r"validation_fraction", setup=image_folders, check=nothing_in("out")),
    error("tfrecords_zero_shards", "--shards=0", MAKE_TFRECORDS + ["--shards=0"], r"shards", setup=image_folders,
          check=nothing_in("out")),
    error("tfrecords_output_is_a_file", "names the output path", MAKE_TFRECORDS, r"out",
          setup=steps(image_folders, files({"out": "a file"}))),
]

CASES += fault_cases_hardening.CASES  # issue 23: changed settings on resume, planted files
CASES += fault_cases_io.CASES  # issue 23: disks, remote workdirs, SIGHUP, frozen workers, the side-car, eval data
CASES += fault_cases_ps.CASES  # issue 23: a frozen ps or worker under parameter servers
CASES += fault_cases_elastic.CASES  # issue 29: elastic local jobs (--num_workers=2:3)
CASES += fault_cases_agree.CASES  # issue 31: workers that disagree on the run
CASES += fault_cases_artifacts.CASES  # issue 31: exports, the workdir's truth, leftovers
CASES += fault_cases_sweepdb.CASES  # issue 31: the study's database, the sweep's reports
CASES += fault_cases_sweepvalues.CASES  # issue 47.4: sweep values in the files written for people
CASES += fault_cases_usercode.CASES  # issue 31: user code outside the step, closed output, settings that conflict
CASES += fault_cases_readers.CASES  # issue 47: readers of a checkpoint that vanished or is half-written
