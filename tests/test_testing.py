"""mwloop.testing runs the task's real step (mwloop's default, the compute_loss seam, a whole custom train_step)
under 2 replicas against 1, and names the likely cause of each classic bug planted in it."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import mwloop
from mwloop import testing
from mwloop.config import base as config_base
from mwloop.task import LossPart, Task

GLOBAL_BATCH, TOKENS, FEATURES = 8, 5, 3
BUGS = ("none", "loss_per_replica", "local_token_count", "part_local_batch", "metric_mean")


def global_batch() -> dict[str, np.ndarray]:
    """Uneven padding: the first replica's half holds many more real tokens than the second's."""
    rng = np.random.default_rng(0)
    lengths = np.array([5, 5, 4, 5, 1, 2, 1, 1])
    return {"x": rng.standard_normal((GLOBAL_BATCH, TOKENS, FEATURES)).astype(np.float32),
            "y": rng.standard_normal((GLOBAL_BATCH, TOKENS)).astype(np.float32),
            "z": rng.standard_normal(GLOBAL_BATCH).astype(np.float32),
            "real": (np.arange(TOKENS)[None, :] < lengths[:, None]).astype(np.float32)}


class TokenTask(Task):
    """Per-token regression (normalised by the global number of real tokens) and a per-example one (by the
    global batch), with one of BUGS planted (`bug`)."""
    bug = "none"

    def build_model(self):
        inputs = keras.Input((TOKENS, FEATURES))
        return keras.Model(inputs, keras.layers.Dense(2)(inputs))

    def forward(self, model, batch, training):
        return model(batch["x"], training=training)

    def parts(self, batch, outputs) -> dict[str, LossPart]:
        real = batch["real"]
        token = tf.square(outputs[..., 0] - batch["y"])
        example = tf.square(tf.reduce_mean(outputs[..., 1], axis=1) - batch["z"])
        local = tf.cast(tf.shape(token)[0], tf.float32)  # this replica's batch
        per_replica = GLOBAL_BATCH / local  # 1 on 1 replica: the bugs show only on several
        if self.bug == "loss_per_replica":  # every part divided by the per-replica batch
            return {"token": LossPart(token * per_replica, real), "example": LossPart(example * per_replica,
                                                                                      normalizer="batch")}
        if self.bug == "local_token_count":  # each replica's mean over its own real tokens
            return {"token": LossPart(token * real * local / tf.reduce_sum(real), normalizer="batch"),
                    "example": LossPart(example, normalizer="batch")}
        if self.bug == "part_local_batch":
            return {"token": LossPart(token, real), "example": LossPart(example * per_replica, normalizer="batch")}
        return {"token": LossPart(token, real), "example": LossPart(example, normalizer="batch")}

    def loss(self, batch, outputs):
        return self.parts(batch, outputs)

    def metric_sums(self, batch, outputs, weights, mask=None):
        error = tf.abs(tf.reduce_mean(outputs[..., 1], axis=1) - batch["z"])
        if self.bug == "metric_mean":
            return {"abs_error": tf.reduce_mean(error * mask)}
        return {"abs_error": tf.reduce_sum(error * mask)}

    def finalize(self, sums):
        return {"mae": sums["abs_error"] / sums["examples"]}


class SeamTask(TokenTask):
    """The same loss through compute_loss: a forward pass the task controls (here: the model on the inputs
    scaled by 1, as a stand-in for an auxiliary pass), mwloop's step for the rest."""

    def compute_loss(self, model, batch, training):
        outputs = model(batch["x"] * 1.0, training=training)
        return self.parts(batch, outputs), outputs


class CustomStepTask(TokenTask):
    """A whole custom train_step: its own tape, normalisation (mwloop.part_losses), sums and update."""

    def train_step(self, model, optimizer, batch, global_batch_size):
        with tf.GradientTape() as tape:
            outputs = self.forward(model, batch, training=True)
            terms, sums, _ = mwloop.part_losses(mwloop.loss_parts(self, self.parts(batch, outputs)),
                                               global_batch_size, self.loss_weights())
        grads = tape.gradient(terms[None], model.trainable_variables)
        mwloop.apply_gradients(model, optimizer, grads)
        mask = tf.ones(tf.shape(batch["z"]))
        return {**sums, **self.metric_sums(batch, outputs, None, mask=mask)}


KINDS = {"default": TokenTask, "seam": SeamTask, "custom": CustomStepTask}
# The fast lane checks each helper on the custom step (its cheapest trace); the others' 2-replica traces take
# 3-10 s per case.
KIND_PARAMS = [kind if kind == "custom" else pytest.param(kind, marks=pytest.mark.slow) for kind in KINDS]


def make(kind: str, bug: str) -> Task:
    config = config_base.base_config()
    config.optimizer.update({"name": "sgd", "learning_rate": 0.1, "schedule": "constant", "momentum": 0.0})
    task = KINDS[kind](config)
    task.bug = bug
    return task


@pytest.mark.parametrize("kind", KIND_PARAMS)
def test_a_correct_step_passes_on_two_replicas(kind, mirrored_strategy):
    figures = testing.assert_replicas_agree(make(kind, "none"), global_batch(), num_replicas=2)
    assert figures["weights"] < 1e-6 and figures["mae"] < 1e-6
    assert testing.assert_loss_scaled_by_global_batch(make(kind, "none"), global_batch(), num_replicas=2) < 1e-5


CAUSES = {  # bug -> what the failure must say
    "loss_per_replica": r"2\.000x the 1-replica update on 2 replicas: divided per replica",
    "local_token_count": r"no multiple of the 1-replica update .*each replica's own token count",
    "part_local_batch": r"loss part 'example': update is 2\.000x the 1-replica update",
    "metric_mean": r"metric_sums' sum 'abs_error' is 2\.000x the 1-replica sum on 2 replicas: a per-replica mean",
}


@pytest.mark.parametrize("bug", CAUSES)
@pytest.mark.parametrize("kind", KIND_PARAMS)
def test_each_planted_bug_is_caught_and_named(kind, bug, mirrored_strategy):
    task = make(kind, bug)
    cause = CAUSES[bug]
    if kind == "custom" and bug == "part_local_batch":  # a custom step's parts cannot be tried alone
        cause = r"no multiple of the 1-replica update .*one loss part divided by the local batch"
    with pytest.raises(AssertionError, match=cause) as failure:
        testing.assert_replicas_agree(task, global_batch(), num_replicas=2)
    print(f"\n{kind} x {bug}: {failure.value}")  # the report's table: pytest -s tests/test_testing.py


@pytest.mark.parametrize("kind", KIND_PARAMS)
def test_the_loss_scaling_check_runs_the_real_step(kind, mirrored_strategy):
    """The classic bug (each replica divides by its own token count) planted in each kind of step."""
    with pytest.raises(AssertionError, match="not scaled by the global count.*each replica's own token count"):
        testing.assert_loss_scaled_by_global_batch(make(kind, "local_token_count"), global_batch(), num_replicas=2)


# ---------------------------------------------------------------------------- losses over the global batch

QUERIES, EMBEDDING = 6, 4


def retrieval_batch() -> dict[str, np.ndarray]:
    """Queries and their documents (a noisy linear map of the query): document i is query i's positive."""
    rng = np.random.default_rng(0)
    query = rng.standard_normal((GLOBAL_BATCH, QUERIES)).astype(np.float32)
    doc = query @ rng.standard_normal((QUERIES, QUERIES)) + 0.3 * rng.standard_normal((GLOBAL_BATCH, QUERIES))
    return {"query": query, "doc": doc.astype(np.float32)}


class DualEncoder(Task):
    """In-batch negatives (InfoNCE): each query against every document of the *global* batch, gathered across
    replicas inline (`negatives="global"`), or against its own replica's only (`"local"`: the bug). The
    documents' bias shifts a query's every logit alike, so its gradient is zero in theory: float noise that
    Adam turns into steps. `batch_norm` normalises the queries by each replica's own statistics."""
    negatives, batch_norm = "global", False

    def build_model(self):
        query, doc = keras.Input((QUERIES,), name="query"), keras.Input((QUERIES,), name="doc")
        encoded = keras.layers.Dense(EMBEDDING)(query)
        if self.batch_norm:
            encoded = keras.layers.BatchNormalization()(encoded)
        return keras.Model({"query": query, "doc": doc}, {"query": encoded, "doc": keras.layers.Dense(EMBEDDING)(doc)})

    def forward(self, model, batch, training):
        return model({"query": batch["query"], "doc": batch["doc"]}, training=training)

    def logits(self, outputs):
        """Each query's logits over the documents it is compared with, and the index of its own document."""
        docs, first = outputs["doc"], 0
        if self.negatives == "global":
            context = tf.distribute.get_replica_context()
            first = tf.cast(context.replica_id_in_sync_group, tf.int32) * tf.shape(docs)[0]
            docs = context.all_gather(docs, axis=0)
        return tf.matmul(outputs["query"], docs, transpose_b=True), first + tf.range(tf.shape(outputs["doc"])[0])

    def loss(self, batch, outputs):
        logits, positives = self.logits(outputs)
        return tf.nn.sparse_softmax_cross_entropy_with_logits(positives, logits)

    def metric_sums(self, batch, outputs, weights):
        logits, positives = self.logits(outputs)
        hits = tf.cast(tf.equal(tf.argmax(logits, axis=1, output_type=tf.int32), positives), tf.float32)
        return {"hits": tf.reduce_sum(hits * weights)}

    def finalize(self, sums):
        return {"recall_at_1": sums["hits"] / sums["examples"]}


def dual_encoder(optimizer: str, negatives: str = "global", batch_norm: bool = False) -> DualEncoder:
    config = config_base.base_config()
    config.optimizer.update({"name": optimizer, "learning_rate": 0.01 if optimizer == "adam" else 0.1,
                             "schedule": "constant", "momentum": 0.0, "weight_decay": 0.0})
    task = DualEncoder(config)
    task.negatives, task.batch_norm = negatives, batch_norm
    return task


@pytest.mark.parametrize("optimizer", [pytest.param("sgd", marks=pytest.mark.slow), "adam"])
def test_a_global_batch_contrastive_step_passes_with_adam_and_sgd(optimizer, mirrored_strategy):
    figures = testing.assert_replicas_agree(dual_encoder(optimizer), retrieval_batch(), num_replicas=2, num_steps=3)
    print(f"\n{optimizer}: {figures}")
    assert figures["loss"] < 1e-6 and figures["recall_at_1"] == 0
    if optimizer == "adam":  # what comparing Adam's weights alone raised: the document bias' noise, amplified
        assert figures["weights"] > 1e-5
    else:  # the gradients, which the check above compared whatever the optimizer (with plain SGD)
        gradients = testing.assert_loss_scaled_by_global_batch(dual_encoder(optimizer), retrieval_batch())
        print(f"gradients: {gradients}")
        assert gradients < 1e-6


def test_local_negatives_are_caught_and_named_as_such(mirrored_strategy):
    """A loss normalised correctly whose examples see only their own replica's: not a normalisation bug."""
    for check in (testing.assert_replicas_agree, testing.assert_loss_scaled_by_global_batch):
        with pytest.raises(AssertionError, match="by no factor per replica: the loss of an example depends on "
                                                 r"other examples of its replica only: gather across replicas "
                                                 r"\(mwloop\.gather_global_batch\)") as failure:
            check(dual_encoder("adam", "local"), retrieval_batch(), num_replicas=2)
        message = str(failure.value)
        print(f"\n{check.__name__}: {message}")
        assert "normalised by a count" not in message and "not scaled by the global count" not in message


@pytest.mark.slow
def test_per_replica_batch_statistics_are_named(mirrored_strategy):
    with pytest.raises(AssertionError, match="the model's output for an example depends on other examples of its "
                                             r"replica, e\.g\. per-replica batch statistics") as failure:
        testing.assert_replicas_agree(dual_encoder("sgd", batch_norm=True), retrieval_batch(), num_replicas=2)
    print(f"\n{failure.value}")


def test_a_planted_bug_is_caught_with_adam_too(mirrored_strategy):
    """Adam is blind to a gradient's scale: the weights barely show a loss divided per replica, the gradient does."""
    task = make("custom", "local_token_count")
    task.config.optimizer.update({"name": "adam", "learning_rate": 0.01})
    with pytest.raises(AssertionError, match=CAUSES["local_token_count"]):
        testing.assert_replicas_agree(task, global_batch(), num_replicas=2)
