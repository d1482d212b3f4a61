"""The update builder alone (mwloop/loop/update.py): make_update's Update and Accumulated called directly on
hand-made batches, on the default strategy with the tiny task. The loop around it, 2 replicas and the loss
variants are tests/test_accumulation.py's and tests/test_loss_parts.py's."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from mwloop.errors import UserError
from mwloop.loop import loops, update
from mwloop.run import state
from mwloop.step.steps import StepOptions
from tests.tiny_task import FEATURES, TinyTask, arrays, tiny_config

BATCH = 32


class Penalised(TinyTask):
    """The tiny task with an L2 penalty: the regularization loss must count once per update, whatever k."""

    def build_model(self):
        penalty = keras.regularizers.L2(0.1)
        return keras.Sequential([keras.Input((FEATURES,), name="inputs"),
                                 keras.layers.Dense(16, activation="relu", kernel_regularizer=penalty),
                                 keras.layers.Dense(3)])


class OwnStep(TinyTask):
    def train_step(self, model, optimizer, batch, global_batch_size):
        raise AssertionError("never traced")


def built(task_class=TinyTask, **overrides):
    """(task, model, optimizer) from seeded weights, on the default strategy."""
    config = tiny_config(task_class, **overrides)
    task = task_class(config)
    keras.utils.set_random_seed(0)
    run = state.create(config, tf.distribute.get_strategy(), task)
    return task, run.model, run.optimizer


def one_update(task, model, optimizer, micro_batches: list[dict], **options):
    """One call of make_update's update on the default strategy, micro-step j reading micro_batches[j].

    Returns (sums, good steps, ok, skipped) as numpy: the loop state after the update, unpacked.
    """
    strategy = tf.distribute.get_strategy()
    options = StepOptions(global_batch_size=BATCH, accumulation_steps=len(micro_batches), **options)
    update.check(task, options, strategy.num_replicas_in_sync)
    sum_vector = loops.SumVector()
    step = update.make_update(strategy, task, model, optimizer, options, sum_vector)
    stacked = {key: tf.constant(np.stack([b[key] for b in micro_batches])) for key in micro_batches[0]}
    if options.accumulation_steps > 1:  # the accumulators' gradient groups, from one micro-batch's spec
        step.prepare({key: tf.TensorSpec(value.shape[1:], value.dtype) for key, value in stacked.items()})

    @tf.function(autograph=False)
    def run(num_sums):
        def next_batch(j):
            return {key: tf.gather(value, j) for key, value in stacked.items()}
        initial = (tf.zeros([num_sums]), tf.constant(0.0), tf.constant(1.0))
        return step(initial, tf.constant(0.0), next_batch, tf.constant(0))

    (totals, good, ok), skipped = sum_vector.run(run)
    assert run.experimental_get_tracing_count() == 1  # the sums' keys and the gradient groups known from one trace
    sums = {key: float(value) for key, value in sum_vector.unpack(totals).items()}
    return sums, float(good), float(ok), float(skipped)


def weights(model) -> list[np.ndarray]:
    return [v.numpy() for v in model.trainable_variables]


def whole_batch() -> dict[str, np.ndarray]:
    return {key: value[:BATCH] for key, value in arrays(BATCH, seed=5).items()}


def split(batch: dict[str, np.ndarray], k: int) -> list[dict[str, np.ndarray]]:
    size = BATCH // k
    return [{key: value[i * size:(i + 1) * size] for key, value in batch.items()} for i in range(k)]


def test_make_update_builds_the_plain_update_for_k_1_and_the_accumulated_one_above():
    task, model, optimizer = built()
    strategy = tf.distribute.get_strategy()
    plain = update.make_update(strategy, task, model, optimizer, StepOptions(global_batch_size=BATCH), None)
    accumulated = update.make_update(strategy, task, model, optimizer,
                                     StepOptions(global_batch_size=BATCH, accumulation_steps=4), None)
    assert type(plain) is update.Update and type(accumulated) is update.Accumulated and accumulated.k == 4


@pytest.mark.parametrize("task_class", [TinyTask, Penalised], ids=["plain", "l2"])
def test_an_update_of_k_2_micro_batches_equals_one_update_on_the_whole_batch(task_class):
    batch = whole_batch()
    task, model, optimizer = built(task_class)
    before = weights(model)
    whole_sums, *_ = one_update(task, model, optimizer, [batch])
    whole = weights(model)

    task, model, optimizer = built(task_class)
    assert all(np.array_equal(a, b) for a, b in zip(weights(model), before))  # the same seeded start
    sums, good, ok, skipped = one_update(task, model, optimizer, split(batch, 2))
    assert int(optimizer.iterations.numpy()) == 1  # one optimizer update for the two micro-batches
    assert (good, ok, skipped) == (1.0, 1.0, 0.0)
    assert sums["examples"] == whole_sums["examples"] == BATCH
    np.testing.assert_allclose(sums["loss_sum"], whole_sums["loss_sum"], rtol=1e-6)
    assert sums["correct"] == whole_sums["correct"]
    moved = max(float(np.abs(w - b).max()) for w, b in zip(whole, before))
    assert moved > 1e-3, "the update did not move the weights"
    for got, want in zip(weights(model), whole):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("k", [1, 2], ids=["k1", "k2"])
def test_a_non_finite_update_is_skipped_and_leaves_the_weights_bitwise_unchanged(k):
    batch = whole_batch()
    batch["inputs"][BATCH - 1, 3] = np.nan  # in the last micro-batch: the first ones were finite
    task, model, optimizer = built()
    before = weights(model)
    slots_before = [v.numpy() for v in optimizer.variables]
    sums, good, ok, skipped = one_update(task, model, optimizer, split(batch, k), skip_nonfinite=True)
    assert skipped == 1.0 and (good, ok) == (0.0, 0.0)
    assert all(np.array_equal(a, b) for a, b in zip(weights(model), before))
    assert all(np.array_equal(a, b) for a, b in zip((v.numpy() for v in optimizer.variables), slots_before))
    assert int(optimizer.iterations.numpy()) == 0
    assert all(value == 0.0 for value in sums.values()), sums  # its NaN sums do not reach the logged ones


@pytest.mark.parametrize("k", [1, 2], ids=["k1", "k2"])
def test_skip_mode_applies_a_finite_update_like_the_plain_step(k):
    batch = whole_batch()
    task, model, optimizer = built()
    plain_sums, *_ = one_update(task, model, optimizer, split(batch, k))
    plain = weights(model)
    task, model, optimizer = built()
    sums, good, ok, skipped = one_update(task, model, optimizer, split(batch, k), skip_nonfinite=True)
    assert (good, ok, skipped) == (1.0, 1.0, 0.0) and int(optimizer.iterations.numpy()) == 1
    assert sums == plain_sums
    for got, want in zip(weights(model), plain):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8)


def test_a_plain_update_without_skipping_lets_a_non_finite_step_through_and_reports_it():
    """on_nonfinite='fail': the step is applied (the Trainer then stops the run); the state says it was bad."""
    batch = whole_batch()
    batch["inputs"][0, 0] = np.nan
    task, model, optimizer = built()
    sums, good, ok, skipped = one_update(task, model, optimizer, [batch])
    assert (good, ok, skipped) == (0.0, 0.0, 0.0) and sums["examples"] == BATCH
    assert int(optimizer.iterations.numpy()) == 1
    assert not all(np.isfinite(w).all() for w in weights(model))  # the NaN gradients were applied


def test_an_accumulated_update_refuses_batches_built_for_another_k():
    batch = whole_batch()
    task, model, optimizer = built()
    with pytest.raises(UserError, match=r"per-replica batches of 32 examples; with 2 micro-batches per update of 32 "
                                        r"on 1 replica\(s\) they must hold 16"):
        one_update(task, model, optimizer, [batch, batch])
    assert int(optimizer.iterations.numpy()) == 0


@pytest.mark.parametrize("task_class, options, message", [
    (OwnStep, {"accumulation_steps": 2}, r"gradient_accumulation_steps=2 with a task's own train_step"),
    (OwnStep, {"skip_nonfinite": True}, r"on_nonfinite='skip' with a task's own train_step"),
    (TinyTask, {"accumulation_steps": 3}, r"global_batch_size=32 does not divide into 3 micro-batches on each of 2"),
    (TinyTask, {"accumulation_steps": 0}, r"gradient_accumulation_steps=0"),
])
def test_check_refuses_what_the_step_cannot_honour_in_one_line(task_class, options, message):
    task = task_class(tiny_config(task_class))
    with pytest.raises(UserError, match=message) as error:
        update.check(task, StepOptions(global_batch_size=BATCH, **options), num_replicas=2)
    assert "\n" not in str(error.value)


def test_check_passes_what_the_step_can_honour():
    for task_class, options in ((OwnStep, {}), (TinyTask, {"accumulation_steps": 4, "skip_nonfinite": True})):
        update.check(task_class(tiny_config(task_class)), StepOptions(global_batch_size=BATCH, **options), 2)
