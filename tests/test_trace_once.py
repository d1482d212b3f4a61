"""The train and eval loops are traced once: what they must know before the step is traced (the sums' keys and
number, an accumulating update's gradient groups) is learned without raising and tracing again
(mwloop/loop/loops.py `SumVector`, mwloop/loop/update.py `Accumulated.prepare`). A step that changes what it
returns between traces is still one line."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from mwloop.errors import UserError
from mwloop.loop import feed, loops
from mwloop.run import state
from mwloop.step.steps import StepOptions
from tests.tiny_task import CLASSES, FEATURES, TinyTask, tiny_config

BATCH = 32


class ManySums(TinyTask):
    """Twelve metric sums: more than the 8 entries the loop's vector used to start with (then it traced again)."""

    def metric_sums(self, batch, outputs, weights):
        error = tf.reduce_max(tf.abs(outputs), -1) * weights
        return {f"error_{p}": tf.reduce_sum(error ** p) for p in range(12)}


class Weighted(TinyTask):
    """Loss weights normalised by their global sum: accumulated, its gradients come in two groups."""

    def loss(self, batch, outputs):
        return super().loss(batch, outputs), tf.cast(batch["label"] > 0, tf.float32)


class Penalised(Weighted):
    """With an L2 penalty: the group of the parts normalised now holds it."""

    def build_model(self):
        penalty = keras.regularizers.L2(1e-3)
        return keras.Sequential([keras.Input((FEATURES,), name="inputs"),
                                 keras.layers.Dense(16, activation="relu", kernel_regularizer=penalty),
                                 keras.layers.Dense(CLASSES)])


class KeysChange(TinyTask):
    """Its metric sums differ from one trace of the step to the next (the loop unrolls 2 steps per iteration)."""
    traces = 0

    def metric_sums(self, batch, outputs, weights):
        KeysChange.traces += 1
        return {f"correct_{KeysChange.traces}": tf.reduce_sum(weights)}


class GroupsChange(TinyTask):
    """Its loss has weights in the first trace only: normalised by the weight sum there, not in the others."""
    traces = 0

    def loss(self, batch, outputs):
        GroupsChange.traces += 1
        losses = super().loss(batch, outputs)
        return (losses, tf.ones_like(losses)) if GroupsChange.traces == 1 else losses


def loops_of(task_class, strategy, **options):
    """(train loop, eval loop, resident feed at step 0, eval dataset) of `task_class`, seeded, on `strategy`."""
    config = tiny_config(task_class)
    task = task_class(config)
    keras.utils.set_random_seed(0)
    run = state.create(config, strategy, task)
    options = StepOptions(global_batch_size=BATCH, **options)
    train_loop = loops.make_train_loop(strategy, task, run.model, run.optimizer, options)
    resident = feed.ResidentFeed(strategy, task.train_arrays(), global_batch_size=BATCH, seed=0, steps_per_call=4,
                                 accumulation_steps=options.accumulation_steps)
    eval_dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices(task.eval_arrays()).batch(BATCH))
    return train_loop, loops.make_eval_loop(strategy, task, run.model), resident.at(run.step), eval_dataset


def test_twelve_sums_train_and_evaluate_from_one_trace_each():
    strategy = tf.distribute.get_strategy()
    train_loop, eval_loop, train_input, eval_dataset = loops_of(ManySums, strategy)
    sums, status = train_loop(train_input, tf.constant(4))
    assert sorted(sums) == sorted(["examples", "loss_sum", "weight_sum"] + [f"error_{p}" for p in range(12)])
    assert sums["examples"] == 4 * BATCH and sums["error_0"] == 4 * BATCH and status["nonfinite"] == 0
    eval_loop.trace(iter(eval_dataset))
    eval_sums = eval_loop(iter(eval_dataset))
    assert float(eval_sums["examples"]) == float(eval_sums["error_0"]) == 100
    assert train_loop.tracing_count() == 1 and eval_loop.tracing_count() == 1


@pytest.mark.parametrize("task_class, groups", [(Weighted, ("",)), (Penalised, (None, ""))],
                         ids=["weighted", "weighted-l2"])
def test_an_accumulated_weighted_loss_knows_its_gradient_groups_before_its_one_trace(
        mirrored_strategy, task_class, groups):
    """The groups are learned on the default strategy (the loop is called outside the strategy's scope, as the
    Trainer calls it) from the feed's batch spec; the two replicas' traces use them."""
    train_loop, *_, train_input = loops_of(task_class, mirrored_strategy, accumulation_steps=2)[:3]
    sums, status = train_loop(train_input, tf.constant(2))
    assert train_loop.tracing_count() == 1
    assert sums["examples"] == 2 * BATCH and 0 < sums["weight_sum"] < 2 * BATCH and status["nonfinite"] == 0
    one_update = next(c.cell_contents for c in train_loop.__closure__
                      if type(c.cell_contents).__name__ == "Accumulated")
    assert one_update.gradient_groups == groups


def test_the_batch_spec_of_a_distributed_iterator_is_one_replicas_batch(mirrored_strategy):
    examples = {"inputs": np.zeros((64, 8), np.float32)}
    dataset = tf.data.Dataset.from_tensor_slices(examples).batch(16, drop_remainder=True)
    spec = feed.batch_spec(iter(mirrored_strategy.experimental_distribute_dataset(dataset)))
    assert spec == {"inputs": tf.TensorSpec([8, 8], tf.float32)}


def test_a_step_whose_sums_change_between_traces_is_one_line():
    KeysChange.traces = 0
    train_loop, _, train_input, _ = loops_of(KeysChange, tf.distribute.get_strategy())
    with pytest.raises(UserError, match=r"a step returned the sums \[.*'correct_2'.*\], another trace "
                                        r"\[.*'correct_1'.*\]; return the same keys every step") as error:
        train_loop(train_input, tf.constant(4))
    assert "\n" not in str(error.value)


def test_a_loss_whose_gradient_groups_change_between_traces_is_one_line():
    GroupsChange.traces = 0
    train_loop, _, train_input, _ = loops_of(GroupsChange, tf.distribute.get_strategy(), accumulation_steps=2)
    with pytest.raises(UserError, match=r"a step's loss has the gradient groups \(None,\) .* another trace "
                                        r"\(''?,\); return the same loss parts") as error:
        train_loop(train_input, tf.constant(2))
    assert "\n" not in str(error.value)
