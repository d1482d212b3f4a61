"""Every knob a run has, declared once: default, doc, validator, policies (mwloop.config.knobs).

`base_config` builds its config from this table, `check` validates with it, `cluster.agreement` and
`artifacts.resume_check` read its policies. The order is the order of the config (and of config.json).
"""

from __future__ import annotations

from typing import Any

from mwloop.config.knobs import (
    PROCESS,
    RUN,
    SAME_RUN_OPTION,
    TRAINER,
    ConfigError,
    Policy,
    Resume,
    Section,
    Table,
    Unset,
    fail,
    knob,
)

CLASSIFICATION = "mwloop.tasks.classification:ImageClassification"
# What config.writers may name; metrics.jsonl is always written.
WRITERS = ("tensorboard", "mlflow")
INTERVAL = "use 0 (never) or a positive interval"
SECONDS_OR_FOREVER = "use 0 (wait forever) or a number of seconds"


def check_writers(key: str, writers: Any) -> None:
    """Each name in config.writers against WRITERS."""
    for name in writers:
        if name not in WRITERS:
            raise ConfigError(f"config.{key} has {name!r}; use any of {', '.join(map(repr, WRITERS))} "
                              f"(metrics.jsonl is always written)")


def _check_metric_name(key: str, metric: Any) -> None:
    split, sep, name = str(metric).partition("/")
    if metric and not (sep and split and name):
        raise fail(key, metric, "name an eval metric as 'SPLIT/NAME', e.g. 'eval/accuracy'")


def _check_profile_steps(key: str, value: Any) -> None:
    fix = "use (first, last) steps with last > first, or (0, 0) for no profile"
    if not isinstance(value, (tuple, list)) or len(value) != 2 or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value) or value[1] < value[0]:
        raise fail(key, value, fix)


def _schedule_ignores_length(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether every step's learning rate is the same for both lengths: constant after a finished warmup."""
    shortest = min(int(old["train.steps"]), int(new["train.steps"]))
    return (old.get("optimizer.schedule") == new.get("optimizer.schedule") == "constant"
            and int(new.get("optimizer.warmup_steps") or 0) <= shortest)


def _evaluator_steps(mine: Any, theirs: Any) -> bool:
    """train.steps only says when the side-car stops: one told more stops when the trainer is gone (early stop);
    one told fewer would stop before the trainer's last checkpoints."""
    return isinstance(mine, int) and isinstance(theirs, int) and mine > theirs


TRAIN_STEPS = Policy(per_task=False, evaluator=_evaluator_steps, resume=Resume(
    _schedule_ignores_length,
    why="a new length re-stretches the learning-rate schedule: the rate jumps at the resume step"))


def _at_least(n: float, fix: str) -> tuple:
    return (lambda v: v >= n, fix)


def _unit(fix: str = "use a value in [0, 1]") -> tuple:
    return (lambda v: 0 <= v <= 1, fix)


TABLE = Table([
    knob("name", "base", "default workdir is runs/<name>", policy=PROCESS),
    knob("task", CLASSIFICATION, "the run's mwloop.Task: an import string 'package.module:Class', or the class",
         policy=RUN),
    knob("seed", 0, policy=RUN, range=_at_least(0, "use a non-negative integer"), integer=True),
    knob("deterministic", False, "tf.config.experimental.enable_op_determinism", policy=SAME_RUN_OPTION),
    knob("on_nonfinite", "fail", "fail | skip: a NaN/Inf loss stops the run, or its update is skipped",
         policy=SAME_RUN_OPTION, choices=("fail", "skip")),
    knob("nan_at_steps", (0,), "fault drill: steps (1-based) whose inputs are NaN; 0 = none", policy=TRAINER),

    Section("dataset", "the built-in classification task's data (a task may replace it) and mwloop's tf.data "
                       "tuning (docs/data.md has measurements)", open=True, policy=RUN),
    knob("dataset.name", "digits", policy=RUN, task=True),
    knob("dataset.data_dir", Unset(str), policy=RUN, task=True),
    knob("dataset.eval_fraction", 0.2, policy=RUN, task=True),
    knob("dataset.split_seed", 0, policy=RUN, task=True),
    knob("dataset.flatten", False, policy=RUN, task=True),
    knob("dataset.train_eval_examples", 0, "> 0: also evaluate on the first N training examples (split eval_train)",
         policy=SAME_RUN_OPTION),
    knob("dataset.threads", 0, "0 = TensorFlow's shared thread pool, N = a private pool of N threads for every "
                               "input pipeline", policy=PROCESS),
    knob("dataset.parallel_calls", -1, "the ImageNet decode map's parallelism (-1 = AUTOTUNE)", policy=PROCESS),
    knob("dataset.prefetch", -1, "the final prefetch buffer in batches (-1 = AUTOTUNE, 0 = none)", policy=PROCESS),
    knob("dataset.skip_bad_records", 0.0,
         "records by global index (Task.train_records): 0 = a record that no longer matches its index stops the run "
         "in one line; p > 0 = it is replaced by the next good record in global index order (the same at any worker "
         "count; one that does not decode, by a copy of the next example) and counted (train metric "
         "data/skipped_records), and the run stops in one line when more than p of a log window's examples were "
         "replaced (docs/data.md)", policy=SAME_RUN_OPTION,
         range=(lambda v: 0 <= v < 1, "use 0 (stop at the first bad record) or a fraction in (0, 1)")),
    knob("dataset.cache", False, "ImageNet eval keeps its encoded records in memory after the first pass "
                                 "(in-memory array eval is always cached)", policy=TRAINER),

    Section("model", "the task's model (the built-in task: mwloop.models)", open=True, policy=RUN),
    knob("model.name", "resnet_small", policy=RUN, task=True),

    Section("train"),
    knob("train.global_batch_size", 128,
         "examples per optimizer update over all replicas (the effective batch, whatever the accumulation): each "
         "replica's micro-batch is global_batch_size / (replicas x optimizer.gradient_accumulation_steps)",
         policy=RUN, range=_at_least(1, "use a positive number of examples per update"), integer=True),
    knob("train.steps", 1000, "optimizer updates; steps_per_loop and every *_every_steps count updates too",
         policy=TRAIN_STEPS, range=_at_least(1, "train for at least 1 step"), integer=True),
    knob("train.stop_at_step", 0,
         "> 0: this process trains only up to this step and ends there as at the last one (eval, checkpoint); the "
         "schedule still spans train.steps (population-based training's segments, docs/pbt.md)", policy=TRAINER,
         range=_at_least(0, "use 0 (train.steps) or a step"), integer=True),
    knob("train.steps_per_loop", 50, policy=TRAINER, range=_at_least(1, "use 1 or more steps per loop call"),
         integer=True),
    knob("train.feed", "resident", "resident: in-memory arrays indexed in the graph (mwloop.loop.feed) | "
                                   "iterator: tf.data", policy=RUN, choices=("resident", "iterator")),
    knob("train.log_every_steps", 100, policy=TRAINER, range=_at_least(0, INTERVAL)),
    knob("train.eval_every_steps", 500, policy=TRAINER, range=_at_least(0, INTERVAL)),
    knob("train.checkpoint_every_steps", 500, policy=TRAINER, range=_at_least(0, INTERVAL)),
    knob("train.eval_every_secs", 0.0, "seconds as well as steps (0 = off): checked when a loop call ends; the "
                                       "chief's clock decides for every worker", policy=TRAINER,
         range=_at_least(0, INTERVAL)),
    knob("train.checkpoint_every_secs", 0.0, policy=TRAINER, range=_at_least(0, INTERVAL)),
    knob("train.max_to_keep", 3, policy=TRAINER, range=_at_least(1, "keep at least 1 checkpoint"), integer=True),
    knob("train.async_checkpoint", False,
         "True: a save copies the state to host memory and training goes on while TensorFlow writes it (one write "
         "in flight; the `checkpoint` pointer, the rotation and MLflow's publishing move only once it is complete; "
         "a preemption's save and the end of training wait for it). On one process and MultiWorkerMirrored; "
         "refused with parameter servers (check.check_run). It changes no update, so a resume may switch it "
         "(BENCHMARKS.md has the blocking)", policy=TRAINER),
    knob("train.allow_changed", "",
         "a resume with settings that change the run's math (batch, schedule length, data, model, optimizer...) is "
         "refused; 'key1,key2' (or a prefix, e.g. 'optimizer') continues with the new values on purpose "
         "(resume_check)", policy=TRAINER),
    knob("train.label_smoothing", 0.0, policy=RUN, task=True, range=(lambda v: 0 <= v < 1, "use a value in [0, 1)")),

    Section("eval"),
    knob("eval.global_batch_size", 256, policy=TRAINER,
         range=_at_least(1, "use a positive number of examples per eval batch"), integer=True),
    knob("eval.continuous_timeout_s", 3600.0, "continuous_eval gives up after this long without a new checkpoint",
         policy=PROCESS, range=_at_least(0, SECONDS_OR_FOREVER)),
    knob("eval.trainer_gone_s", 60.0, "continuous_eval stops once the trainer's workdir lock is free this long",
         policy=PROCESS),
    knob("eval.checkpoint", "latest", "latest | best: what --mode=eval and --mode=export restore", policy=TRAINER,
         choices=("latest", "best")),

    # Periodic actions (docs/actions.md). Metrics are named "SPLIT/NAME": eval/accuracy, eval_<set>/loss,
    # eval_ema/accuracy (with optimizer.ema). Both run after each eval, on every worker, decided by the chief.
    Section("best_checkpoint"),
    knob("best_checkpoint.metric", "", "e.g. 'eval/accuracy': keep the best eval's weights in DIR/best_checkpoint",
         policy=TRAINER, validate=_check_metric_name),
    knob("best_checkpoint.mode", "max", policy=TRAINER, choices=("max", "min")),
    knob("best_checkpoint.export", False, "also export the best weights to DIR/export_best/<step> at the end",
         policy=TRAINER),
    Section("early_stopping"),
    knob("early_stopping.metric", "", "e.g. 'eval/loss': stop when it has not improved for `patience` evals",
         policy=TRAINER, validate=_check_metric_name),
    knob("early_stopping.mode", "min", policy=TRAINER, choices=("min", "max")),
    knob("early_stopping.patience", 3, "evals without an improvement of more than min_delta", policy=TRAINER,
         range=_at_least(1, "use 1 or more evals"), integer=True),
    knob("early_stopping.min_delta", 0.0, policy=TRAINER, range=_at_least(0, "use 0 or a positive improvement")),
    knob("actions", (), "the user's own actions: import strings 'package.module:Class' or mwloop.Action subclasses, "
                        "each made with the config (Class(config)) or without arguments", policy=TRAINER),
    knob("init_checkpoint", "",
         "warm start (fine-tuning): a fresh run's model weights from another run's checkpoint (ckpt-N, its "
         "checkpoints folder or its workdir); ignored when the run resumes from a checkpoint of its own",
         policy=SAME_RUN_OPTION),
    knob("init_checkpoint_include", ".*", "the weights warm-started: those whose Keras path "
                                          "(model.weights[i].path) matches this regex", policy=SAME_RUN_OPTION),
    knob("init_checkpoint_state", "weights",
         "weights: the model weights only (fine-tuning; the run starts at step 0) | all: the whole training state "
         "(weights, optimizer slots, EMA, step; the data position follows from the step), so the run continues "
         "the other one's in this workdir (population-based training's segments, docs/pbt.md)",
         policy=SAME_RUN_OPTION, choices=("weights", "all")),

    knob("writers", ("tensorboard",), "where metrics go besides metrics.jsonl (always written): 'tensorboard' "
                                      "(DIR/summaries), 'mlflow' (docs/tracking.md; the `mlflow` extra)",
         policy=PROCESS, validate=check_writers),
    knob("record_cost", False, "also write what the run costs to metrics.jsonl (mwloop.run.cost: cost/params, "
                               "cost/examples_per_sec, cost/peak_rss_mb, export/latency_ms); sweep trials always do",
         policy=TRAINER),
    knob("export", True, "a SavedModel in DIR/export/<step> at the end of training (TF Serving's layout)",
         policy=TRAINER),
    knob("export_keep", 3, "exported versions kept in DIR/export (and DIR/export_best); 0 = all", policy=TRAINER,
         range=_at_least(0, "keep 1 or more exported versions (0: all)"), integer=True),
    knob("export_untrained", False, "--mode=export without a checkpoint exports the initial weights (else an error)",
         policy=TRAINER),

    Section("optimizer"),
    knob("optimizer.name", "sgd", "sgd | adam | adamw, or any Keras optimizer's name (with optimizer.kwargs)",
         policy=RUN),
    knob("optimizer.learning_rate", 0.1, policy=RUN, range=_at_least(0, "use a non-negative learning rate")),
    knob("optimizer.base_batch_size", 0, "> 0: linear scaling, lr * global_batch_size / base_batch_size", policy=RUN,
         range=_at_least(0, "use 0 (no linear scaling) or a batch size")),
    knob("optimizer.schedule", "cosine", "constant | cosine | linear | step (x0.1 at 1/3, 2/3, 8/9)", policy=RUN,
         choices=("constant", "cosine", "linear", "step")),
    knob("optimizer.warmup_steps", 0, policy=RUN, range=_at_least(0, "use 0 (no warmup) or a number of steps"),
         integer=True),
    knob("optimizer.momentum", 0.9, policy=RUN, range=_unit()),
    knob("optimizer.nesterov", False, policy=RUN),
    knob("optimizer.weight_decay", 5e-4, "L2 penalty in the loss (gradient weight_decay * w)", policy=RUN,
         range=_at_least(0, "use 0 (none) or a positive L2 factor")),
    knob("optimizer.decoupled_weight_decay", 0.004, "adamw only", policy=RUN,
         range=_at_least(0, "use 0 (none) or a positive factor")),
    knob("optimizer.clip_global_norm", 0.0, "> 0: clip gradients by this global norm", policy=RUN,
         range=_at_least(0, "use 0 (no clipping) or a positive norm")),
    knob("optimizer.ema", False, "keep an exponential moving average of the weights; the final weights are the EMA",
         policy=RUN),
    knob("optimizer.ema_momentum", 0.9999, policy=RUN, range=_unit()),
    knob("optimizer.gradient_accumulation_steps", 1,
         "k > 1: each update sums the gradients of k micro-batches per replica (locally, then one cross-replica "
         "sum), on every strategy; exactly one step on train.global_batch_size, k times less memory and fewer "
         "all-reduces", policy=SAME_RUN_OPTION,
         range=_at_least(1, "use 1 (one update per batch) or more micro-batches per update"), integer=True),
    knob("optimizer.kwargs", {}, "keyword arguments of an optimizer chosen by its Keras name (optimizer.name="
                                 "'lion', ...), e.g. {'beta_1': 0.95}", policy=RUN),

    Section("distribution"),
    knob("distribution.strategy", "auto", policy=TRAINER,
         choices=("auto", "default", "one_device", "mirrored", "multi_worker", "parameter_server")),
    knob("distribution.num_cpu_devices", 0, "> 1: split the CPU into N logical devices (tests, demos): auto (no "
                                            "cluster) and mirrored then have N replicas", policy=TRAINER,
         range=_at_least(0, "use 0 (as the machine has) or a number of devices")),
    knob("distribution.collective", "auto", "multi_worker's collective implementation", policy=TRAINER,
         choices=("auto", "ring", "nccl")),
    knob("distribution.collective_timeout_s", 0.0, "0: no timeout", policy=PROCESS,
         range=_at_least(0, "use 0 (no timeout) or a number of seconds")),
    knob("distribution.startup_timeout_s", 300.0,
         "multi_worker: how long joining the cluster may take (every task registered, one all-reduce done) before "
         "the process exits 2 naming the tasks that never became reachable; it logs who is missing meanwhile. "
         "0: forever", policy=PROCESS, range=_at_least(0, SECONDS_OR_FOREVER)),
    knob("distribution.peer_timeout_s", 300.0,
         "parameter servers: the chief's watch ends the attempt with one line naming the task when a worker or ps "
         "has not answered for this long (frozen, hung host, link down); the launcher restarts the job from the "
         "last checkpoint. 0: wait forever (still logging)", policy=PROCESS, range=_at_least(0, SECONDS_OR_FOREVER)),
    knob("distribution.bytes_per_pack", 0,
         "> 0: gradients all-reduce in packs of about this many bytes, last layers first, so the first packs travel "
         "while the backward pass computes the rest (multi_worker); 0: one pack after the backward pass. On CPUs "
         "slower (BENCHMARKS.md); meant for GPUs with NCCL", policy=TRAINER,
         range=_at_least(0, "use 0 (one pack) or a byte count")),

    knob("jit_compile", False, "XLA for the forward and backward pass of the train step", policy=SAME_RUN_OPTION),
    knob("mixed_precision", "float32", "float32 | mixed_bfloat16 | mixed_float16 (with loss scaling)", policy=RUN,
         choices=("float32", "mixed_bfloat16", "mixed_float16")),
    knob("profile_steps", (0, 0), "(a, b), b > a: a TensorBoard profile of steps a..b in summaries/", policy=TRAINER,
         validate=_check_profile_steps),
    knob("loss_weights", {}, "a task's loss parts by name -> weight (mwloop.Task.compute_loss); empty: the sum",
         policy=RUN),
])

__all__ = ["TABLE", "CLASSIFICATION", "WRITERS", "check_writers"]
