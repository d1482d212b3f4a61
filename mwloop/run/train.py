"""train_and_evaluate: strategy, data, model, checkpoint and loop, wired together."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Iterator

import ml_collections
import tensorflow as tf
from absl import logging

from mwloop import task as task_lib
from mwloop.artifacts import checkpoint, disk, mlflow_sink
from mwloop.artifacts.writers import format_metrics
from mwloop.cluster import distribute, peers, ps_watch
from mwloop.config import check as config_check
from mwloop.config import schema
from mwloop.errors import UserError
from mwloop.loop import ps
from mwloop.run import sidecar
from mwloop.run.build import build_run, check_elastic_data_early
from mwloop.run.trainer import Trainer
from mwloop.step import graph_checks


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, mode: str = "train_and_eval",
                       strategy: tf.distribute.Strategy | None = None) -> dict[str, float]:
    """Runs `mode` for `config` in `workdir`, resuming from its checkpoints.

    Modes: train, eval, train_and_eval, continuous_eval (side-car: evaluate
    each new checkpoint), export (SavedModel of the latest checkpoint). An
    `evaluator` task in TF_CONFIG always runs continuous_eval. Returns the last
    eval metrics of the main eval set (of its EMA weights with optimizer.ema;
    empty when there was no eval).

    Raises:
      UserError: a setting that cannot work (checked before the strategy exists), bad data, a failed write.
    """
    config_check.check(config, mode)
    return run_checked(config, workdir, mode, strategy)


def run_checked(config: ml_collections.ConfigDict, workdir: str, mode: str = "train_and_eval",
                strategy: tf.distribute.Strategy | None = None) -> dict[str, float]:
    """`train_and_evaluate` of a config already through `config.check` (mwloop.main checks it at its edge,
    before TensorFlow loads): the config is checked once per run, and completed here (every knob present)."""
    config = schema.TABLE.complete(config)
    if distribute.ps_cluster() and distribute.task_type() in ("worker", "ps"):
        # The chief runs the loop; this task only serves (until the job stops it).
        ps.serve()
    # Outside the training cluster: a local side-car.
    if distribute.is_evaluator():
        mode = "continuous_eval"
        strategy = strategy or tf.distribute.get_strategy()
    elif mode == "train_and_eval" and distribute.cluster_has_evaluator():
        logging.info("TF_CONFIG lists an evaluator task: it evaluates, so the trainers only train")
        mode = "train"
    # An elastic job's data is checked before the strategy, so a refusal costs no cluster start-up.
    task = check_elastic_data_early(config) if strategy is None else None
    # First: before any other op.
    strategy = strategy or distribute.create_strategy(config.distribution)
    task = task or task_lib.resolve(config.task, config)
    parameter_server = distribute.is_parameter_server(strategy)
    if parameter_server:
        logging.info("%s with parameter servers: this chief schedules the steps of %d workers, %d ps tasks hold "
                     "the variables", mode, *ps.cluster_size())
    else:
        logging.info("%s with %s: %d replicas, %d workers, chief=%s", mode, type(strategy).__name__.lstrip("_"),
                     strategy.num_replicas_in_sync, distribute.num_workers(strategy), distribute.is_chief(strategy))
    if mode == "continuous_eval":
        return sidecar.continuous_eval(config, workdir, strategy, task)
    with one_line_errors(config, workdir, strategy):
        run = build_run(config, workdir, strategy=strategy, task=task, evaluate=mode != "train", checked=True)
        with Trainer.of_run(run) as trainer:
            if mode in ("eval", "export"):
                return _eval_or_export(trainer, mode)
            return _train_to_the_end(trainer, mode)


@contextlib.contextmanager
def one_line_errors(config: ml_collections.ConfigDict, workdir: str, strategy: tf.distribute.Strategy
                    ) -> Iterator[None]:
    """What TensorFlow raises as a long error, as the one line that names the cause: a lost worker or parameter
    server (exit 1 from mwloop.main: a restart can succeed), a full or read-only disk, a failed data check.
    Under parameter servers the chief also watches its peers: a frozen one is named and ends the attempt."""
    parameter_server = distribute.is_parameter_server(strategy)
    with contextlib.ExitStack() as stack:
        if parameter_server:
            stack.enter_context(ps_watch.watching(config.distribution.peer_timeout_s, workdir))
        stack.enter_context(ps.ps_failures_are_lost() if parameter_server
                            else peers.failures_are_lost(strategy, workdir))
        stack.enter_context(disk.one_line_errors(workdir))
        stack.enter_context(graph_checks.one_line_errors())
        yield


def _train_to_the_end(trainer: Trainer, mode: str) -> dict[str, float]:
    first_step, started = trainer.step, time.perf_counter()
    trainer.train()
    # Already trained to the end: evaluate what was restored, unless this is a finished run rerun
    # whose evals are in metrics.jsonl.
    if trainer.evaluators and mode == "train_and_eval" and trainer.last_eval_step is None \
            and not trainer.evaluation_on_record():
        trainer.evaluate()
    # The export holds the averaged weights.
    trainer.finalize_ema()
    exported = [trainer.export(), trainer.export_best()]
    if trainer.chief:
        logging.info("%s", _summary(trainer.config, trainer.workdir, trainer, first_step,
                                    time.perf_counter() - started, [e for e in exported if e]))
    return _main_eval(trainer)


def _main_eval(trainer: Trainer) -> dict[str, float]:
    """The main eval set's latest figures (of the EMA weights with optimizer.ema, the weights exported)."""
    return dict(trainer.metrics.get("eval_ema" if trainer.config.optimizer.ema else "eval", {}))


def _eval_or_export(trainer: Trainer, mode: str) -> dict[str, float]:
    """--mode=eval or --mode=export of the latest (or config.eval.checkpoint="best") checkpoint."""
    config = trainer.config
    which = config.eval.checkpoint
    restored = trainer.restore("best") if which == "best" else trainer.restored
    if not restored and (mode == "eval" or not config.export_untrained):
        raise checkpoint.CheckpointError(
            f"--mode={mode}: no checkpoint in {trainer.checkpointer.directory} to {mode}; train first, or check "
            f"--workdir" + (" (or set --config.export_untrained=True to export the initial weights)"
                            if mode == "export" else ""))
    # The trained run's settings stay on record.
    trainer.writer.write_config(config, keep_existing=True)
    if mode == "export":
        trainer.finalize_ema()
        trainer.export()
        return {}
    if not trainer.evaluators:
        raise UserError(f"--mode=eval: task {type(trainer.task).__name__} has no eval data; give it eval_arrays "
                        f"or eval_dataset")
    trainer.evaluate()
    return _main_eval(trainer)


def _summary(config: ml_collections.ConfigDict, workdir: str, trainer: Trainer, first_step: int, wall_s: float,
             exported: list[str]) -> str:
    """The end of a run in a few lines: what was done, the final eval, and where everything is."""
    last_step = trainer.step
    trained = last_step - first_step
    speed = (f" ({trained * config.train.global_batch_size / wall_s:,.0f} examples/s with eval and saves)"
             if trained and wall_s > 0 else "")
    directory = trainer.checkpointer.directory
    latest = checkpoint.saved_checkpoints(directory)
    lines = [f"done: steps {first_step} -> {last_step} of {config.train.steps} in {wall_s:.1f} s{speed}"]
    if trainer.stop_reason:
        lines.append(f"  stopped        {trainer.stop_reason}")
    for split, metrics in trainer.metrics.items():
        if split != "train":
            lines.append(f"  {split:<14} {format_metrics(metrics, skip=('examples',))} on {metrics['examples']:.0f} "
                         f"examples")
    lines.append(f"  checkpoints    {directory} (latest {os.path.basename(latest[0]) if latest else 'none'})")
    best = checkpoint.saved_checkpoints(trainer.best_directory)
    if best:
        lines.append(f"  best           {best[0]}")
    for directory in exported:
        lines.append(f"  export         {directory}")
    if (result := trainer.parts.goodput.report()) is not None:
        badput = ", ".join(f"{cause} {seconds:.1f} s" for cause, seconds in result.seconds.items() if seconds >= 0.05)
        lines.append(f"  goodput        {result.goodput:.1%} of {result.wall:.1f} s wall over {len(result.attempts)} "
                     f"attempt(s) ({badput}; python -m mwloop.goodput {workdir})")
    lines.append(f"  metrics        {os.path.join(workdir, 'metrics.jsonl')}")
    lines.append(f"  tensorboard    tensorboard --logdir {os.path.join(workdir, 'summaries')}")
    if "mlflow" in config.writers and mlflow_sink.where(workdir):
        lines.append(f"  mlflow         {mlflow_sink.where(workdir)}")
    return "\n".join(lines)


def default_workdir(config: ml_collections.ConfigDict) -> str:
    """runs/<config name>, e.g. runs/resnet-digits; a name that would leave runs/ is a UserError."""
    name = str(config.name)
    if not name.strip() or os.path.isabs(name) or ".." in name.replace("\\", "/").split("/"):
        raise UserError(f"config.name={name!r} would put the default workdir outside runs/; use a plain name, or "
                        f"give --workdir")
    return os.path.join("runs", name)
