"""Every knob a run has, with defaults; configs/*.py start from here and change what differs."""

from __future__ import annotations

import importlib.util
import os

import ml_collections
from ml_collections import config_dict

from mwloop import errors
from mwloop.config import check as config_check
from mwloop.errors import UserError

CLASSIFICATION = "mwloop.tasks.classification:ImageClassification"


def base_config(task: str | type = CLASSIFICATION) -> ml_collections.ConfigDict:
    """The full config schema. Fields that may stay unset are typed placeholders,
    so `--config.x=y` can still set them.

    Args:
      task: the run's `mwloop.Task`: an import string "package.module:Class" (overridable with
        `--config.task=...`), or the class itself (e.g. defined in the config file).
    Returns:
      The config; `dataset`, `model` and `train.label_smoothing` are the built-in classification
      task's keys, which other tasks may reuse or replace.
    """
    c = ml_collections.ConfigDict()
    c.name = "base"  # default workdir is runs/<name>
    c.task = task
    c.seed = 0
    c.deterministic = False  # tf.config.experimental.enable_op_determinism
    c.on_nonfinite = "fail"  # fail | skip: a NaN/Inf loss stops the run, or its update is skipped
    c.nan_at_steps = (0,)  # fault drill: steps (1-based) whose inputs are NaN; 0 = none

    c.dataset = ml_collections.ConfigDict()
    c.dataset.name = "digits"
    c.dataset.data_dir = config_dict.placeholder(str)
    c.dataset.eval_fraction = 0.2
    c.dataset.split_seed = 0
    c.dataset.flatten = False
    c.dataset.train_eval_examples = 0  # > 0: also evaluate on the first N training examples (split eval_train)
    # tf.data tuning (docs/data.md has measurements): 0 = TensorFlow's shared thread pool, N = a private
    # pool of N threads for every input pipeline; the ImageNet decode map's parallelism and the final
    # prefetch buffer in batches (-1 = AUTOTUNE; prefetch 0 = none); cache: ImageNet eval keeps its
    # encoded records in memory after the first pass (in-memory array eval is always cached).
    c.dataset.threads = 0
    c.dataset.parallel_calls = -1
    c.dataset.prefetch = -1
    c.dataset.cache = False

    c.model = ml_collections.ConfigDict()
    c.model.name = "resnet_small"

    c.train = ml_collections.ConfigDict()
    # Examples per optimizer update over all replicas (the effective batch, whatever the accumulation): each
    # replica's micro-batch is global_batch_size / (replicas x optimizer.gradient_accumulation_steps).
    c.train.global_batch_size = 128
    c.train.steps = 1000  # optimizer updates; steps_per_loop and every *_every_steps below count updates too
    c.train.steps_per_loop = 50
    c.train.feed = "resident"  # resident: in-memory arrays indexed in the graph (mwloop.loop.feed) | iterator: tf.data
    c.train.log_every_steps = 100
    c.train.eval_every_steps = 500
    c.train.checkpoint_every_steps = 500
    # Seconds as well as steps (0 = off): checked when a loop call ends; the chief's clock decides for every worker.
    c.train.eval_every_secs = 0.0
    c.train.checkpoint_every_secs = 0.0
    c.train.max_to_keep = 3
    # True: a save copies the state to host memory and training goes on while TensorFlow writes it (one write in
    # flight; the `checkpoint` pointer, the rotation and MLflow's publishing move only once it is complete; a
    # preemption's save and the end of training wait for it). One process only (BENCHMARKS.md has the blocking).
    c.train.async_checkpoint = False
    # A resume with settings that change the run's math (batch, schedule length, data, model, optimizer...) is
    # refused; "key1,key2" (or a prefix, e.g. "optimizer") continues with the new values on purpose (resume_check).
    c.train.allow_changed = ""
    c.train.label_smoothing = 0.0

    c.eval = ml_collections.ConfigDict()
    c.eval.global_batch_size = 256
    c.eval.continuous_timeout_s = 3600.0  # continuous_eval gives up after this long without a new checkpoint
    c.eval.trainer_gone_s = 60.0  # continuous_eval stops once the trainer's workdir lock is free this long
    c.eval.checkpoint = "latest"  # latest | best: what --mode=eval and --mode=export restore

    # Periodic actions (docs/actions.md). Metrics are named "SPLIT/NAME": eval/accuracy, eval_<set>/loss,
    # eval_ema/accuracy (with optimizer.ema). Both run after each eval, on every worker, decided by the chief.
    c.best_checkpoint = ml_collections.ConfigDict()
    c.best_checkpoint.metric = ""  # e.g. "eval/accuracy": keep the best eval's weights in DIR/best_checkpoint
    c.best_checkpoint.mode = "max"  # max | min
    c.best_checkpoint.export = False  # also export the best weights to DIR/export_best/<step> at the end
    c.early_stopping = ml_collections.ConfigDict()
    c.early_stopping.metric = ""  # e.g. "eval/loss": stop when it has not improved for `patience` evals
    c.early_stopping.mode = "min"  # min | max
    c.early_stopping.patience = 3  # evals without an improvement of more than min_delta
    c.early_stopping.min_delta = 0.0
    # The user's own actions: import strings "package.module:Class" or mwloop.Action subclasses, each made
    # with the config (Class(config)) or without arguments.
    c.actions = ()
    # Warm start (fine-tuning): a fresh run's model weights from another run's checkpoint (ckpt-N, its
    # checkpoints folder or its workdir); those whose Keras path (model.weights[i].path) matches the regex
    # init_checkpoint_include. Ignored when the run resumes from a checkpoint of its own.
    c.init_checkpoint = ""
    c.init_checkpoint_include = ".*"

    # Where metrics go besides metrics.jsonl (always written): "tensorboard" (DIR/summaries), "mlflow" (one MLflow
    # run per run: docs/tracking.md; the `mlflow` extra).
    c.writers = ("tensorboard",)
    c.export = True  # a SavedModel in DIR/export/<step> at the end of training (TF Serving's layout)
    c.export_keep = 3  # exported versions kept in DIR/export (and DIR/export_best); 0 = all
    c.export_untrained = False  # --mode=export without a checkpoint exports the initial weights (else an error)

    c.optimizer = ml_collections.ConfigDict()
    c.optimizer.name = "sgd"  # sgd | adam | adamw
    c.optimizer.learning_rate = 0.1
    c.optimizer.base_batch_size = 0  # > 0: linear scaling, lr * global_batch_size / base_batch_size
    c.optimizer.schedule = "cosine"  # constant | cosine | linear | step (x0.1 at 1/3, 2/3, 8/9)
    c.optimizer.warmup_steps = 0
    c.optimizer.momentum = 0.9
    c.optimizer.nesterov = False
    c.optimizer.weight_decay = 5e-4  # L2 penalty in the loss (gradient weight_decay * w)
    c.optimizer.decoupled_weight_decay = 0.004  # adamw only
    c.optimizer.clip_global_norm = 0.0  # > 0: clip gradients by this global norm
    c.optimizer.ema = False  # keep an exponential moving average of the weights; the final weights are the EMA
    c.optimizer.ema_momentum = 0.9999
    # k > 1: each update sums the gradients of k micro-batches per replica (locally, then one cross-replica sum),
    # on every strategy; exactly one step on train.global_batch_size, k times less memory and fewer all-reduces.
    c.optimizer.gradient_accumulation_steps = 1

    c.distribution = ml_collections.ConfigDict()
    c.distribution.strategy = "auto"  # auto | default | one_device | mirrored | multi_worker | parameter_server
    # > 1: split the CPU into N logical devices (tests, demos): auto (no cluster) and mirrored then have N replicas
    c.distribution.num_cpu_devices = 0
    c.distribution.collective = "auto"  # auto | ring | nccl (multi_worker)
    c.distribution.collective_timeout_s = 0.0  # 0: no timeout
    # multi_worker: how long joining the cluster may take (every task registered, one all-reduce done) before
    # the process exits 2 naming the tasks that never became reachable; it logs who is missing meanwhile. 0: forever
    c.distribution.startup_timeout_s = 300.0
    # parameter servers: the chief's watch (a small process) ends the attempt with one line naming the task when
    # a worker or ps has not answered for this long (frozen, hung host, link down); it logs who it waits for
    # meanwhile; the launcher restarts the job from the last checkpoint. 0: wait forever (still logging)
    c.distribution.peer_timeout_s = 300.0
    # > 0: gradients all-reduce in packs of about this many bytes, last layers first, so the first packs
    # travel while the backward pass computes the rest (multi_worker); 0: one pack after the backward pass.
    # On CPUs slower: every pack pays the ring's fixed latency (BENCHMARKS.md); meant for GPUs with NCCL.
    c.distribution.bytes_per_pack = 0

    c.jit_compile = False  # XLA for the forward and backward pass of the train step
    c.mixed_precision = "float32"  # float32 | mixed_bfloat16 | mixed_float16 (with loss scaling)
    c.profile_steps = (0, 0)  # (a, b), b > a: a TensorBoard profile of steps a..b in summaries/
    return c


def load_config(spec: str, overrides: dict | None = None) -> ml_collections.ConfigDict:
    """The config `python -m mwloop.main --config=SPEC --config.KEY=VALUE ...` would run, checked.

    Args:
      spec: "FILE" or "FILE:ARG", as `--config=` takes it.
      overrides: {"train.steps": 100, ...}, as `--config.train.steps=100` would set them.
    Returns:
      The config, through `config_check.check`.
    Raises:
      UserError: a missing file, an unknown key or a wrong type, or a setting that cannot work, in one line.
    """
    path, arg = spec, None
    if not os.path.isfile(spec) and ":" in spec:
        path, _, arg = spec.rpartition(":")
    return load(path, arg, overrides)


def load(path: str, arg: str | None = None, overrides: dict | None = None, *,
         check: bool = True) -> ml_collections.ConfigDict:
    """A config file's get_config(arg) with dotted-key overrides applied (type-checked), then checked.

    Args:
      path: the config file.
      arg: what get_config receives (None: no argument was given).
      overrides: {"train.steps": 100, ...}, as `--config.train.steps=100` would set them.
      check: run `config_check.check` on the result (tests of the checks themselves turn it off).
    Returns:
      The config a run of `python -m mwloop.main --config=... --config.KEY=VALUE` would get.
    Raises:
      UserError: a missing file, an unknown key or a wrong type, or a setting that cannot work, in one line.
    """
    if not os.path.isfile(path):
        raise UserError(f"config file {path!r} not found; give the path of a file defining get_config(arg)")
    spec = importlib.util.spec_from_file_location(f"config_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(arg)
    config.lock()  # as --config.KEY=VALUE: a key that is not in the config is an error, not a new field
    for key, value in (overrides or {}).items():
        try:
            config.update_from_flattened_dict({key: value})
        except (KeyError, AttributeError, TypeError, ValueError) as e:
            raise UserError(f"config override {key}={value!r}: {errors.one_line(e)}; check the key and the "
                            f"type") from None
    config.unlock()
    if check:
        config_check.check(config)
    return config
