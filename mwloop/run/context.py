"""What an action may touch of its run: `ActionContext`, the one object every action method receives."""

from __future__ import annotations

from typing import TYPE_CHECKING

import ml_collections

from mwloop.artifacts.writers import MetricWriter
from mwloop.step import steps

if TYPE_CHECKING:
    import keras


class ActionContext:
    """All an action may touch of its run: what it reads, and the few things it may do. Any other name is an
    AttributeError, so an action cannot come to depend on the Trainer's internals.

    Attributes:
      step: the run's current step (an action due at step N runs right after the loop call ending at N).
      metrics: the latest figures by split: "train" (the last log window), "eval", "eval_<set>", "eval_ema".
      config: the run's config (read it; changing it changes nothing).
      model, optimizer: the Keras model and optimizer being trained.
      writer: the chief's metrics writer (`write(step, split, {name: float})`: metrics.jsonl and the sinks;
        on other workers it writes nothing).
      workdir: the run's directory.
      is_chief, worker, num_workers: whether this process writes the run's files; its index (0 is the chief);
        how many run the Trainer in step.
      eval_splits: the splits an eval produces ("eval", "eval_<set>", and "<split>_ema" with optimizer.ema).
      skipped_updates: non-finite updates skipped in this `train()` call (config.on_nonfinite="skip").
    Methods:
      evaluate(): every eval set once (every worker calls it: declare `all_workers = True`).
      save(step), save_best(step): the rotating checkpoint; the best one (every worker).
      request_stop(reason): training ends after this step on every worker (declare `may_stop = True`).
      broadcast(flag): the chief's flag on every worker (a collective: every worker calls it).
      finalize(sums): metrics from sums reduced over the replicas (as `observe` receives them).
    """
    __slots__ = ("_trainer",)

    def __init__(self, trainer):
        object.__setattr__(self, "_trainer", trainer)

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"an action cannot set {name!r} on its run; keep its own state on the action")

    @property
    def step(self) -> int:
        return self._trainer.step

    @property
    def metrics(self) -> dict[str, dict[str, float]]:
        return self._trainer.metrics

    @property
    def config(self) -> ml_collections.ConfigDict:
        return self._trainer.config

    @property
    def model(self) -> keras.Model:
        return self._trainer.state.model

    @property
    def optimizer(self) -> keras.optimizers.Optimizer:
        return self._trainer.state.optimizer

    @property
    def writer(self) -> MetricWriter:
        return self._trainer.writer

    @property
    def workdir(self) -> str:
        return self._trainer.workdir

    @property
    def is_chief(self) -> bool:
        return self._trainer.parts.chief

    @property
    def worker(self) -> int:
        # The resolver is None on one machine.
        resolver = getattr(self._trainer.parts.strategy, "cluster_resolver", None)
        return resolver.task_id if resolver is not None and resolver.task_type else 0

    @property
    def num_workers(self) -> int:
        return self._trainer.parts.num_workers

    @property
    def eval_splits(self) -> list[str]:
        return self._trainer.parts.evaluation.splits

    @property
    def skipped_updates(self) -> int:
        return self._trainer.skipped_updates

    def evaluate(self) -> dict[str, dict[str, float]]:
        return self._trainer.evaluate()

    def save(self, step: int) -> None:
        self._trainer.save(step)

    def save_best(self, step: int) -> None:
        self._trainer.save_best(step)

    def request_stop(self, reason: str) -> None:
        self._trainer.request_stop(reason)

    def broadcast(self, flag: bool) -> bool:
        return self._trainer.broadcast_from_chief(flag)

    def finalize(self, sums: dict[str, float]) -> dict[str, float]:
        return steps.finalize(self._trainer.task, sums)

    def __getattr__(self, name: str):
        raise AttributeError(f"an action sees only {', '.join(_CONTEXT_NAMES)} of its run, not {name!r} "
                             f"(mwloop.ActionContext)")


_CONTEXT_NAMES = sorted(n for n in vars(ActionContext) if not n.startswith("_"))
