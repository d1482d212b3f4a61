"""Gradient accumulation: k micro-batches on N replicas update exactly like one step of the whole batch."""

from __future__ import annotations

import keras
import ml_collections
import numpy as np
import pytest
import tensorflow as tf

from mwloop import testing
from mwloop.config import base as config_base
from mwloop.config import check as config_check
from mwloop.errors import UserError
from mwloop.loop import feed
from mwloop.loop import loops as loop
from mwloop.models import mlp
from mwloop.run import state, train
from mwloop.step import steps
from mwloop.tasks.classification import ImageClassification

GLOBAL_BATCH, UPDATES, SEED = 64, 20, 3
NUM_EXAMPLES = 203  # prime: updates straddle epoch ends


class Tiny(ImageClassification):
    """The built-in classification on 8 random features and 3 classes: an MLP with an L2 penalty."""

    def build_model(self):
        return mlp.mlp(input_shape=(8,), num_classes=3, hidden=(16,), kernel_regularizer=keras.regularizers.L2(1e-3))

    def train_arrays(self):
        rng = np.random.default_rng(0)
        image = rng.standard_normal((NUM_EXAMPLES, 8)).astype(np.float32)
        return {"image": image, "label": (image[:, 0] > 0).astype(np.int32) + (image[:, 1] > 0.5),
                # per-example loss weights: about half 0 (padding), unevenly many per micro-batch
                "weight": (rng.random(NUM_EXAMPLES) < 0.5).astype(np.float32)}


class Weighted(Tiny):
    """Tiny with loss weights normalised by their global sum (loss_normalization="weights")."""

    def loss(self, batch, outputs):
        return super().loss(batch, outputs), batch["weight"]


class WeightedNoPenalty(Weighted):
    def build_model(self):
        return mlp.mlp(input_shape=(8,), num_classes=3, hidden=(16,))


def tiny_config(k: int = 1, task: type = Tiny, mixed_precision: str = "float32",
                **optimizer) -> ml_collections.ConfigDict:
    config = config_base.base_config(task=task)
    config.mixed_precision = mixed_precision
    config.optimizer.update({"name": "sgd", "learning_rate": 0.1, "schedule": "cosine", "momentum": 0.9,
                             "gradient_accumulation_steps": k, **optimizer})
    config.train.steps = 4 * UPDATES  # the schedule decays over the updates: the step counts them
    return config


def train_updates(task_class, strategy, config, *, updates: int = UPDATES, skip_nonfinite: bool = False,
                  iterator=None, jit_compile: bool = False) -> tuple[list[np.ndarray], dict, dict, state.State]:
    """`updates` optimizer updates in one loop call from seeded weights; (weights, sums, status, state)."""
    task = task_class(config)
    keras.utils.set_random_seed(0)
    built = state.create(config, strategy, task)
    k = config.optimizer.gradient_accumulation_steps
    options = steps.StepOptions.from_config(config, global_batch_size=GLOBAL_BATCH, skip_nonfinite=skip_nonfinite,
                                            jit_compile=jit_compile)
    train_loop = loop.make_train_loop(strategy, task, built.model, built.optimizer, options)
    source = iterator or feed.ResidentFeed(strategy, task.train_arrays(), global_batch_size=GLOBAL_BATCH, seed=SEED,
                                           steps_per_call=updates, accumulation_steps=k).at(built.step)
    sums, status = train_loop(source, tf.constant(updates))
    return [v.numpy() for v in built.model.trainable_variables], sums, status, built


def assert_equivalent(task_class, strategy, rtol: float, mixed_precision: str = "float32", **optimizer) -> float:
    """k=4 micro-batches on `strategy`'s replicas against one step of the whole batch on 1 replica, UPDATES
    times; returns the largest weight difference relative to the largest weight."""
    def config(k):
        return tiny_config(k, mixed_precision=mixed_precision, **optimizer)
    single, single_sums, _, _ = train_updates(task_class, tf.distribute.get_strategy(), config(1))
    accumulated, sums, _, built = train_updates(task_class, strategy, config(4))
    initial, *_ = train_updates(task_class, tf.distribute.get_strategy(), config(1), updates=0)
    assert testing.relative_difference(single, initial) > 10 * rtol, "the updates did not move the weights"
    assert int(built.optimizer.iterations.numpy()) == UPDATES  # one optimizer update per k micro-batches
    assert sums["examples"] == UPDATES * GLOBAL_BATCH
    np.testing.assert_allclose(sums["loss_sum"], single_sums["loss_sum"], rtol=max(rtol, 1e-5))
    difference = testing.relative_difference(accumulated, single)
    assert difference <= rtol, f"k=4 x 2 replicas differ from 1 x the whole batch by {difference:.2e} (relative)"
    return difference


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", [
    {"name": "sgd"},
    {"name": "adam", "learning_rate": 1e-2},
    {"name": "sgd", "ema": True, "ema_momentum": 0.9},  # the average moves once per update
], ids=["sgd", "adam", "sgd-ema"])
def test_accumulated_update_equals_one_step_on_the_whole_batch(mirrored_strategy, optimizer):
    assert_equivalent(Tiny, mirrored_strategy, rtol=1e-5, **optimizer)


@pytest.mark.slow
def test_clipping_on_two_replicas_clips_the_summed_gradient(mirrored_strategy):
    """Keras alone would clip each replica's part before the sum (0.13 relative difference measured)."""
    assert_equivalent(Tiny, mirrored_strategy, rtol=1e-5, clip_global_norm=0.05)


@pytest.mark.slow
def test_clipping_applies_to_the_accumulated_gradient():
    """The clipped gradient is the accumulated one: the sum of the k micro-batches' (one replica)."""
    assert_equivalent(Tiny, tf.distribute.get_strategy(), rtol=1e-5, clip_global_norm=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("task_class", [Weighted, WeightedNoPenalty], ids=["with-l2", "no-penalty"])
def test_weighted_loss_divides_by_the_weight_sum_of_all_micro_batches(mirrored_strategy, task_class):
    """Uneven padding per micro-batch: dividing each micro-batch by its own weight sum would not be exact."""
    assert_equivalent(task_class, mirrored_strategy, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("task_class", [Tiny, Weighted], ids=["plain", "weighted-l2"])
def test_mixed_float16(mirrored_strategy, task_class):
    """mixed_float16 (a LossScaleOptimizer): the same equivalence to a looser bound. The gradients leave
    the float16 matmuls rounded to 11 bits (relative ~5e-4), and a matmul over 8 examples rounds at other
    points than one over 64. Measured (20 updates, SGD momentum 0.9): 6.0e-4 plain, 1.6e-4 weighted (Adam:
    5.4e-5, 6.8e-5); 3e-3 leaves 5x room and still fails any wrong loss scaling (off by a factor 2 or more)."""
    assert_equivalent(task_class, mirrored_strategy, rtol=3e-3, mixed_precision="mixed_float16")
    assert keras.mixed_precision.global_policy().name == "mixed_float16"  # state.create set it; conftest resets


@pytest.mark.slow
def test_jit_compiled_micro_steps(mirrored_strategy):
    """config.jit_compile: XLA compiles each micro-step's forward and backward pass (weighted loss with L2:
    the separate regularization gradients too); the accumulation and the update stay outside."""
    single, *_ = train_updates(Weighted, tf.distribute.get_strategy(), tiny_config(1))
    compiled, *_ = train_updates(Weighted, mirrored_strategy, tiny_config(4), jit_compile=True)
    assert testing.relative_difference(compiled, single) <= 1e-5


@pytest.mark.slow
def test_the_iterator_reads_the_same_micro_batches_as_the_feed(mirrored_strategy):
    """The tf.data stream cut into micro-batches (inputs.train_dataset_fn) trains like the resident feed."""
    from mwloop.loop import inputs
    config = tiny_config(4)
    config.train.global_batch_size, config.seed = GLOBAL_BATCH, SEED
    fed, *_ = train_updates(Tiny, mirrored_strategy, config)
    dataset_fn = inputs.train_dataset_fn(config, Tiny(config), start_step=0)
    iterator = iter(mirrored_strategy.distribute_datasets_from_function(dataset_fn))
    iterated, *_ = train_updates(Tiny, mirrored_strategy, config, iterator=iterator)
    assert testing.relative_difference(iterated, fed) == 0


@pytest.mark.slow
def test_a_bad_micro_batch_skips_the_whole_update_on_every_replica(mirrored_strategy):
    """on_nonfinite='skip': a NaN in one micro-batch of one replica skips that update everywhere."""
    config = tiny_config(4)
    task = Tiny(config)
    arrays = task.train_arrays()
    arrays["image"][17] = np.nan  # read by one micro-batch of one replica per epoch (~6 times in 20 updates)

    class Poisoned(Tiny):
        def train_arrays(self):
            return arrays

    skipped_weights, sums, status, built = train_updates(Poisoned, mirrored_strategy, config, skip_nonfinite=True)
    assert status["skipped"] >= 1 and status["nonfinite"] > 0
    assert int(built.optimizer.iterations.numpy()) == UPDATES - status["skipped"]
    assert all(np.isfinite(w).all() for w in skipped_weights) and np.isfinite(sums["loss_sum"])


@pytest.mark.parametrize("k,batch,replicas,match", [
    (0, 64, 2, "gradient_accumulation_steps=0; use 1"),
    (3, 64, 2, r"global_batch_size=64 does not divide into 3 micro-batches on each of 2 replica\(s\); set it to a "
               r"multiple of 2 x 3 = 6"),
    (4, 36, 2, "multiple of 2 x 4 = 8"),
])
def test_bad_accumulation_settings_are_one_line_errors(k, batch, replicas, match):
    with pytest.raises(UserError, match=match) as error:
        config_check.check_step(accumulation_steps=k, global_batch_size=batch, num_replicas=replicas)
    assert "\n" not in str(error.value)


def test_train_refuses_accumulating_a_task_that_applies_its_own_updates(tmp_path, mirrored_strategy):
    class OwnStep(Tiny):
        def train_step(self, model, optimizer, batch, global_batch_size):
            raise AssertionError("never traced")

    config = tiny_config(2, task=OwnStep)
    with pytest.raises(UserError, match="own train_step.*gradient_accumulation_steps=1$"):
        train.train_and_evaluate(config, str(tmp_path / "run"), strategy=mirrored_strategy)
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.mark.slow
def test_a_non_finite_update_is_named_by_its_update_step(tmp_path):
    """The NaN drill through train_and_evaluate (tf.data micro-batches, k=2): steps count updates, so the
    run stops at update 30 and saves nothing after it."""
    from tests.helpers import load_config
    config = load_config("mlp", **{"distribution.strategy": "default", "train.steps": 40,
                                   "optimizer.gradient_accumulation_steps": 2, "nan_at_steps": (30,),
                                   "train.eval_every_steps": 0, "train.checkpoint_every_steps": 20})
    with pytest.raises(FloatingPointError, match="non-finite loss at step 30;"):
        train.train_and_evaluate(config, str(tmp_path / "run"), mode="train")
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("*.index")) == ["ckpt-20.index"]


class OwnLion(Tiny):
    """A task's own optimizer (Task.build_optimizer): Lion with decoupled weight decay kept off the biases."""

    def build_optimizer(self, learning_rate):
        optimizer = keras.optimizers.Lion(learning_rate, weight_decay=0.5)
        optimizer.exclude_from_weight_decay(var_names=["bias"])
        return optimizer


@pytest.mark.slow
def test_a_task_optimizer_trains_with_accumulation_clipping_and_ema_like_one_replica(mirrored_strategy):
    """mwloop wraps the task's optimizer: k=4 micro-batches on 2 replicas, clipping of the summed gradient and the
    EMA equal one step on the whole batch on 1 replica."""
    difference = assert_equivalent(OwnLion, mirrored_strategy, rtol=1e-6, learning_rate=1e-3, clip_global_norm=0.05,
                                   ema=True, ema_momentum=0.9)
    print(f"\nLion k=4 x 2 replicas vs 1 x the whole batch: {difference:.2e}")
    built = train_updates(OwnLion, mirrored_strategy, tiny_config(4, ema=True), updates=0)[3]
    assert type(built.optimizer).__name__ == "Lion" and built.optimizer.use_ema


@pytest.mark.slow
def test_a_task_optimizer_resumes_bitwise(tmp_path, mirrored_strategy):
    """Its variables (Lion's momentum, the EMA) are in the checkpoint: 4 + 4 updates equal 8."""
    from mwloop.run import trainer as trainer_lib

    def run(workdir, until=None):
        config = tiny_config(2, task=OwnLion, learning_rate=1e-3, clip_global_norm=0.05, ema=True, ema_momentum=0.9)
        config.train.update({"steps": 8, "steps_per_loop": 4, "checkpoint_every_steps": 4, "log_every_steps": 4,
                             "eval_every_steps": 0, "global_batch_size": GLOBAL_BATCH})
        config.export = False
        with trainer_lib.Trainer(config, str(workdir), strategy=mirrored_strategy, task=OwnLion(config),
                                 evaluate=False, preemption=False) as trainer:
            trainer.train(until)
            return [v.numpy() for v in trainer.state.optimizer.variables]

    whole = run(tmp_path / "whole")
    run(tmp_path / "resumed", until=4)
    resumed = run(tmp_path / "resumed")
    assert len(whole) == len(resumed) and all(np.array_equal(a, b) for a, b in zip(whole, resumed))
