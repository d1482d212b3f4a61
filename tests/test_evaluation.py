"""A run's evaluation alone (mwloop/run/evaluation.py): Evaluation.run over the tiny task's eval sets with the
real evaluators (every example counted once, the values numpy computes), and the EMA swap: exact, and back."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from mwloop.artifacts.writers import MetricWriter
from mwloop.run import evaluation, state
from tests.helpers import read_metrics
from tests.tiny_task import TinyTask, arrays, reference_metrics, tiny_config

SMALL = 37  # not a multiple of the eval batch (32): the last batch is padded and masked


class TwoSets(TinyTask):
    """The tiny task's eval set (100 examples) and a named one of SMALL."""

    def eval_sets(self):
        return {"small": arrays(SMALL, seed=2)}


def built(task_class=TwoSets, strategy=None, **overrides):
    config = tiny_config(task_class, **overrides)
    strategy = strategy or tf.distribute.get_strategy()
    task = task_class(config)
    keras.utils.set_random_seed(0)
    run = state.create(config, strategy, task)
    return config, task, run, state.make_evaluators(config, strategy, task, run.model)


def weights(variables) -> list[np.ndarray]:
    return [v.numpy() for v in variables]


def test_run_evaluates_every_set_once_counting_each_example_and_writes_them(tmp_path):
    config, task, run, evaluators = built()
    writer = MetricWriter(str(tmp_path), enabled=True, sinks=[])
    results = evaluation.Evaluation(evaluators, writer, run.optimizer, ema=False).run(step=7)
    assert list(results) == ["eval", "eval_small"]
    for split, data in (("eval", task.eval_arrays()), ("eval_small", arrays(SMALL, seed=2))):
        want = reference_metrics(run.model, data)
        assert results[split]["examples"] == want["examples"]  # 100 and 37: padding counts for nothing
        assert results[split]["accuracy"] == pytest.approx(want["accuracy"], abs=1e-9)
        assert results[split]["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert [(e["step"], e["split"], e["examples"]) for e in read_metrics(str(tmp_path))] == [
        (7, "eval", 100), (7, "eval_small", SMALL)]


def test_two_replicas_count_each_example_once(mirrored_strategy, tmp_path):
    """37 examples in batches of 32 on 2 replicas: a padded batch of 16 + 5 real ones, each counted once."""
    config, task, run, evaluators = built(strategy=mirrored_strategy)
    results = evaluation.Evaluation(evaluators, MetricWriter(str(tmp_path), enabled=False), run.optimizer,
                                    ema=False).run(step=0)
    assert results["eval_small"]["examples"] == SMALL and results["eval"]["examples"] == 100
    want = reference_metrics(run.model, arrays(SMALL, seed=2))
    assert results["eval_small"]["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert not (tmp_path / "metrics.jsonl").exists()  # a disabled writer (not the chief) writes nothing


def moved_averages(run) -> None:
    """A few updates with EMA (momentum 0.5), so the averages differ from the weights; then one awkward pair
    where Keras' add-and-subtract swap would round: a weight of 1 + 2^-20 against an average of 3e7."""
    for step in range(3):
        grads = [tf.fill(v.shape, 0.1 * (step + 1)) for v in run.model.trainable_variables]
        run.optimizer.apply_gradients(zip(grads, run.model.trainable_variables))
    kernel = run.model.trainable_variables[0]
    inner = getattr(run.optimizer, "inner_optimizer", run.optimizer)
    average = dict(zip([id(v) for v in inner._trainable_variables], inner._model_variables_moving_average))[id(kernel)]
    kernel.assign(tf.fill(kernel.shape, 1.0 + 2.0 ** -20))
    average.assign(tf.fill(kernel.shape, 3e7))


def test_ema_evaluates_the_averages_swapped_in_exactly_and_swaps_them_back(tmp_path):
    config, task, run, evaluators = built(**{"optimizer.ema": True, "optimizer.ema_momentum": 0.5})
    moved_averages(run)
    inner = getattr(run.optimizer, "inner_optimizer", run.optimizer)
    before = weights(run.model.trainable_variables)
    averages = weights(inner._model_variables_moving_average)
    assert any(not np.array_equal(w, a) for w, a in zip(before, averages))

    seen = {}

    def recording(split, evaluator):
        def evaluate():
            seen.setdefault(split, []).append(weights(run.model.trainable_variables))
            return evaluator()
        return evaluate
    wrapped = {split: recording(split, evaluator) for split, evaluator in evaluators.items()}
    writer = MetricWriter(str(tmp_path), enabled=True, sinks=[])
    results = evaluation.Evaluation(wrapped, writer, run.optimizer, ema=True).run(step=3)

    assert list(results) == ["eval", "eval_small", "eval_ema", "eval_small_ema"]
    for split in ("eval", "eval_small"):  # each evaluator twice: on the weights, then on the averages
        on_weights, on_averages = seen[split]
        assert all(np.array_equal(a, b) for a, b in zip(on_weights, before))
        assert all(np.array_equal(a, b) for a, b in zip(on_averages, averages))  # swapped in bitwise
    # Swapped back out: weights and averages bitwise what they were (the awkward pair too).
    assert all(np.array_equal(a, b) for a, b in zip(weights(run.model.trainable_variables), before))
    assert all(np.array_equal(a, b) for a, b in zip(weights(inner._model_variables_moving_average), averages))

    for variable, average in zip(run.model.trainable_variables, averages):
        variable.assign(average)
    want = reference_metrics(run.model, task.eval_arrays())
    assert results["eval_ema"]["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert results["eval_ema"]["examples"] == 100 and results["eval_small_ema"]["examples"] == SMALL
    assert results["eval_ema"]["loss"] != results["eval"]["loss"]
    assert [e["split"] for e in read_metrics(str(tmp_path))] == ["eval", "eval_small", "eval_ema", "eval_small_ema"]


def test_the_ema_swap_undoes_itself_when_an_eval_raises():
    config, task, run, evaluators = built(**{"optimizer.ema": True, "optimizer.ema_momentum": 0.5})
    moved_averages(run)
    before = weights(run.model.trainable_variables)
    run_evaluation = evaluation.Evaluation(evaluators, MetricWriter("/nonexistent", enabled=False), run.optimizer,
                                           ema=True)
    with pytest.raises(RuntimeError, match="eval failed"), run_evaluation.ema_weights():
        raise RuntimeError("eval failed")
    assert all(np.array_equal(a, b) for a, b in zip(weights(run.model.trainable_variables), before))


def test_without_eval_sets_nothing_is_evaluated_or_swapped(tmp_path):
    config, task, run, _ = built(**{"optimizer.ema": True, "optimizer.ema_momentum": 0.5})
    moved_averages(run)
    before = weights(run.model.trainable_variables)
    writer = MetricWriter(str(tmp_path), enabled=True, sinks=[])
    assert evaluation.Evaluation({}, writer, run.optimizer, ema=True).run(step=1) == {}
    assert all(np.array_equal(a, b) for a, b in zip(weights(run.model.trainable_variables), before))
    assert not (tmp_path / "metrics.jsonl").exists()
