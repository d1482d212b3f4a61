"""A run's evaluation: every eval set once, on the current weights and, with optimizer.ema, on their moving
averages (swapped in exactly, then back out); logged and written by the chief."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import keras
import tensorflow as tf
from absl import logging

from mwloop.artifacts.writers import MetricWriter, format_metrics
from mwloop.errors import UserError
from mwloop.task import SKIPPED_KEY

# One eval set, evaluated once: its finalized metrics.
Evaluator = Callable[[], dict[str, float]]


class Evaluation:
    """Evaluates a run's eval sets (`evaluators`: split -> evaluator) and writes their metrics.

    Args:
      evaluators: split name ("eval", "eval_<set>") -> function evaluating that set once.
      writer: the chief's metrics writer (it writes nothing on other workers).
      optimizer: the run's optimizer, whose moving averages `ema_weights` swaps in (with `ema`).
      ema: also evaluate the moving averages (config.optimizer.ema), as splits `<split>_ema`.
      skip_bad_records: config.dataset.skip_bad_records: the largest fraction of an eval set's records that may be
        bad (skipped and counted by the eval input, SKIPPED_KEY) before the eval stops the run in one line.
    """

    def __init__(self, evaluators: dict[str, Evaluator], writer: MetricWriter,
                 optimizer: keras.optimizers.Optimizer, *, ema: bool, skip_bad_records: float = 0.0):
        self.evaluators, self.writer, self.optimizer, self.ema = evaluators, writer, optimizer, ema
        self.skip_bad_records = skip_bad_records
        self._swap = None

    @property
    def splits(self) -> list[str]:
        """The splits an eval produces: each eval set's, then (with `ema`) each one's `<split>_ema`."""
        return [*self.evaluators, *([f"{split}_ema" for split in self.evaluators] if self.ema else [])]

    def recall(self, step: int, agree: Callable[[bool], bool]) -> dict[str, dict[str, float]] | None:
        """The figures of every split at `step` if metrics.jsonl holds them all already (a finished run, rerun),
        else None; nothing is evaluated or written, so a rerun adds no duplicate history. `agree` makes the
        chief's answer every worker's (evaluating runs collectives, so all must decide alike)."""
        splits, found = self.splits, {}
        if self.writer.enabled:
            for event in self.writer.read():
                if event["step"] == step and event["split"] in splits:
                    found[event["split"]] = {k: v for k, v in event.items() if k not in ("step", "split")}
        if not agree(bool(splits) and set(found) == set(splits)):
            return None
        if self.writer.enabled:
            logging.info("step %d was evaluated already (%s): nothing new to evaluate", step, self.writer.metrics_path)
        return found

    def run(self, step: int) -> dict[str, dict[str, float]]:
        """Every eval set once, then on the EMA weights too (with `ema`); returns split -> metrics."""
        results = self._all(step, "")
        if self.ema and self.evaluators:
            with self.ema_weights():
                results.update(self._all(step, "_ema"))
        return results

    def _all(self, step: int, suffix: str) -> dict[str, dict[str, float]]:
        results = {}
        for split, evaluator in self.evaluators.items():
            started = time.perf_counter()
            metrics = results[split + suffix] = evaluator()
            if self.writer.enabled:
                logging.info("%s at step %d: %s on %d examples (%.1fs)", split + suffix, step,
                             format_metrics(metrics, skip=("examples",)), metrics["examples"],
                             time.perf_counter() - started)
            self.writer.write(step, split + suffix, metrics)
            self._check_skipped(split + suffix, step, metrics)
        return results

    def _check_skipped(self, split: str, step: int, metrics: dict[str, float]) -> None:
        """More bad records skipped than the fraction allows: one line, after the figures are written (the sums
        are global, so every worker decides alike)."""
        skipped = metrics.get(SKIPPED_KEY, 0.0)
        total = metrics["examples"] + skipped
        if skipped > self.skip_bad_records * total:
            raise UserError(f"{skipped:.0f} of the {total:.0f} examples of {split} at step {step} were bad records, "
                            f"skipped: more than config.dataset.skip_bad_records={self.skip_bad_records:g} of them; "
                            f"repair or rewrite the dataset with python -m mwloop.data.convert, or allow a larger "
                            f"fraction")

    @contextlib.contextmanager
    def ema_weights(self) -> Iterator[None]:
        """A context in which the model holds the optimizer's moving averages (swapped in, then back out)."""
        self._swap_ema()
        try:
            yield
        finally:
            self._swap_ema()

    def _swap_ema(self) -> None:
        if self._swap is None:
            optimizer = getattr(self.optimizer, "inner_optimizer", self.optimizer)
            # Keras keeps the averages beside the variables it trains, in the same order (private names).
            pairs = list(zip(optimizer._trainable_variables, optimizer._model_variables_moving_average))

            # Exact: a copy, not Keras' add-and-subtract swap, which rounds the weights.
            @tf.function(autograph=False)
            def swap():
                for variable, average in pairs:
                    held = tf.identity(variable.value)
                    variable.assign(average.value)
                    average.assign(held)
            self._swap = swap
        self._swap()
