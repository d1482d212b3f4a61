"""Loss parts: a loss of several parts with different global normalisers trains on N replicas (and with
accumulation, clipping, EMA, skipping, mixed precision) exactly like on 1; each part is reported."""

from __future__ import annotations

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

from examples.detection import Detection
from mwloop import testing
from mwloop.loop import feed
from mwloop.loop import loops as loop
from mwloop.run import state, train
from mwloop.step import steps
from tests.helpers import load_config, read_metrics

GLOBAL_BATCH, UPDATES, SEED = 32, 20, 5


def detection_config(k: int = 1, **optimizer):
    config = load_config("detection", **{"distribution.strategy": "default", "dataset.num_train_examples": 203})
    config.optimizer.update({"name": "sgd", "learning_rate": 0.05, "schedule": "constant", "momentum": 0.9,
                             "gradient_accumulation_steps": k, **optimizer})
    return config


def train_updates(strategy, config, *, skip_nonfinite: bool = False, updates: int = UPDATES):
    """`updates` updates of the detection task in one loop call: (weights, finalized metrics, initial weights,
    state)."""
    task = Detection(config)
    keras.utils.set_random_seed(0)
    built = state.create(config, strategy, task)
    initial = [v.numpy() for v in built.model.trainable_variables]
    options = steps.StepOptions.from_config(config, global_batch_size=GLOBAL_BATCH, skip_nonfinite=skip_nonfinite)
    train_loop = loop.make_train_loop(strategy, task, built.model, built.optimizer, options)
    source = feed.ResidentFeed(strategy, task.train_arrays(), global_batch_size=GLOBAL_BATCH, seed=SEED,
                               steps_per_call=updates, accumulation_steps=options.accumulation_steps).at(built.step)
    sums, status = train_loop(source, tf.constant(updates))
    metrics = steps.finalize(task, sums) if sums else {}
    return [v.numpy() for v in built.model.trainable_variables], metrics, initial, built


@functools.lru_cache(maxsize=4)
def single_replica(optimizer: tuple, mixed_precision: str):
    """The 1-replica reference (one step on the whole batch per update), shared by the tests that compare to it."""
    config = detection_config(1, **dict(optimizer))
    config.mixed_precision = mixed_precision
    return train_updates(tf.distribute.get_strategy(), config)[:3]


def compare(strategy, k: int, rtol: float, mixed_precision: str = "float32", **optimizer) -> dict[str, float]:
    """N replicas (x k micro-batches) against 1 replica x the whole batch: weight and per-part loss figures."""
    multi_config = detection_config(k, **optimizer)
    multi_config.mixed_precision = mixed_precision
    single, single_metrics, initial = single_replica(tuple(sorted(optimizer.items())), mixed_precision)
    multi, metrics, _, built = train_updates(strategy, multi_config)
    assert testing.relative_difference(single, initial) > 100 * rtol, "the updates did not move the weights"
    assert int(built.optimizer.iterations.numpy()) == UPDATES
    figures = {"weights": testing.relative_difference(multi, single)}
    for key in ("loss", "loss/cls", "loss/box", "loss/count", "accuracy", "count_mae"):
        figures[key] = abs(metrics[key] - single_metrics[key]) / abs(single_metrics[key])
    assert max(figures.values()) <= rtol, figures
    return figures


@pytest.mark.slow
def test_parts_on_two_replicas_equal_one_replica(mirrored_strategy):
    """Uneven padding (1 to 8 real objects per example): the parts normalised by their global weight sums."""
    figures = compare(mirrored_strategy, 1, rtol=1e-6)
    assert figures["weights"] <= 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", [
    {},
    {"clip_global_norm": 0.5, "ema": True, "ema_momentum": 0.9},
], ids=["k4", "k4-clip-ema"])
def test_parts_accumulated_on_two_replicas_equal_one_step(mirrored_strategy, optimizer):
    """k = 4: each part's weight sum is that of all micro-batches on all replicas (one all-reduce per update)."""
    compare(mirrored_strategy, 4, rtol=1e-5, **optimizer)


@pytest.mark.slow
def test_parts_with_mixed_float16(mirrored_strategy):
    """mixed_float16 (LossScaleOptimizer), k = 2: float16 rounding only (see test_accumulation's bound)."""
    compare(mirrored_strategy, 2, rtol=3e-3, mixed_precision="mixed_float16")


@pytest.mark.slow
def test_skipping_a_bad_update_with_parts(mirrored_strategy):
    config = detection_config(2)
    arrays = Detection(config).train_arrays()
    arrays["objects"][17, 0, 0] = np.nan

    class Poisoned(Detection):
        def train_arrays(self):
            return arrays

    task = Poisoned(config)
    keras.utils.set_random_seed(0)
    built = state.create(config, mirrored_strategy, task)
    options = steps.StepOptions.from_config(config, global_batch_size=GLOBAL_BATCH, skip_nonfinite=True)
    train_loop = loop.make_train_loop(mirrored_strategy, task, built.model, built.optimizer, options)
    source = feed.ResidentFeed(mirrored_strategy, arrays, global_batch_size=GLOBAL_BATCH, seed=SEED,
                               steps_per_call=UPDATES, accumulation_steps=2).at(built.step)
    sums, status = train_loop(source, tf.constant(UPDATES))
    assert status["skipped"] >= 1 and int(built.optimizer.iterations.numpy()) == UPDATES - status["skipped"]
    assert all(np.isfinite(v.numpy()).all() for v in built.model.trainable_variables)
    assert all(np.isfinite(v) for v in steps.finalize(task, sums).values())


@pytest.mark.slow
def test_the_example_trains_and_reports_each_part(tmp_path, mirrored_strategy):
    """The shipped example through train_and_evaluate on 2 replicas: `loss/<part>` in the train log and eval
    (metrics.jsonl), the total `loss` weighted by config.loss_weights."""
    config = load_config("detection", **{"train.steps": 100, "train.log_every_steps": 50,
                                         "train.eval_every_steps": 100, "train.checkpoint_every_steps": 100,
                                         "export": False})
    results = train.train_and_evaluate(config, str(tmp_path / "run"), strategy=mirrored_strategy)
    weights = dict(config.loss_weights)
    assert results["loss"] == pytest.approx(sum(weights[p] * results[f"loss/{p}"] for p in weights), rel=1e-6)
    assert results["examples"] == 300 and results["accuracy"] > 0.8
    events = read_metrics(str(tmp_path / "run"))
    train_events = [e for e in events if e.get("split") == "train"]
    assert train_events and {"loss/cls", "loss/box", "loss/count"} <= set(train_events[-1])


@pytest.mark.slow
def test_the_detection_task_as_a_user_tests_it():
    """What a user writes for their own multi-part task with mwloop.testing (docs/tasks.md, "Testing your
    task"): the real step on 2 replicas equals 1, every part scaled by its global count."""
    import mwloop.testing
    config = load_config("detection", **{"optimizer.name": "sgd", "optimizer.momentum": 0.0})
    task = Detection(config)
    batch = {k: v[:16] for k, v in task.train_arrays().items()}  # 1 to 8 real objects per example: uneven halves
    figures = mwloop.testing.assert_replicas_agree(task, batch, num_replicas=2, num_steps=3)
    assert figures["weights"] < 1e-5 and figures["loss/box"] < 1e-5 and figures["count_mae"] < 1e-5
    assert mwloop.testing.assert_loss_scaled_by_global_batch(task, batch, num_replicas=2) < 1e-5


def test_loss_weights_for_parts_the_loss_does_not_return_are_one_line_errors():
    from mwloop.step import losses
    from mwloop.task import LossPart, TaskError
    parts = {"cls": LossPart(tf.ones([4])), "box": LossPart(tf.ones([4]), normalizer="batch")}
    with pytest.raises(TaskError, match=r"name \['bxo'\], which the loss does not return; its parts are "
                                        r"\['box', 'cls'\]$"):
        losses.part_losses(parts, 8, {"cls": 1.0, "bxo": 2.0})
    terms, sums, _ = losses.part_losses(parts, 8, {"cls": 1.0, "box": 2.0})
    assert float(terms[None]) == pytest.approx(4 / 4 + 2.0 * 4 / 8)  # cls: / its weight sum, box: / the batch
    assert {k: float(v) for k, v in sums.items()} == {"examples": 4.0, "loss_sum/cls": 4.0, "weight_sum/cls": 4.0,
                                                      "loss_sum/box": 4.0, "weight_sum/box": 4.0}
