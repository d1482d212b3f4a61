"""Recommendation by matrix factorisation on generated ratings, with embedding tables split at the Keras level.

Written only against mwloop's public Task API. It trains the same way on one process (the default
strategy) and with parameter servers (`python -m mwloop.launch --num_workers=2 --num_ps=2 -- ...`),
where each table's parts are spread over the ps tasks.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from mwloop import Sums, Task


class SplitEmbedding(keras.layers.Layer):
    """An embedding table held as `num_parts` ordinary variables of about vocab / num_parts rows each.

    Why: ParameterServerStrategy places each variable whole on one ps task (round-robin), so a table split
    into parts spreads its rows, its optimizer slots and its lookups over the ps tasks. TensorFlow's own
    `variable_partitioner` would do this, but its ShardedVariable does not work with Keras 3 (no `handle`
    for the gradient tape, not usable as a reference in `apply_gradients`). Rows are split by range, in
    TensorFlow's "div" layout: consecutive ids share a part, and the first vocab % num_parts parts hold one
    row more. `tf.nn.embedding_lookup` over the parts gathers on each part's own device, so only the rows a
    batch needs travel, and their gradients are IndexedSlices of those rows.
    """

    def __init__(self, vocab_size: int, dim: int, num_parts: int = 1, *, stddev: float = 0.1, **kwargs):
        super().__init__(**kwargs)
        if not 1 <= num_parts <= vocab_size:
            raise ValueError(f"num_parts={num_parts}: use 1..vocab_size ({vocab_size})")
        self.vocab_size, self.dim, self.num_parts, self.stddev = vocab_size, dim, num_parts, stddev
        self.parts: list = []

    def build(self, input_shape) -> None:
        base, extra = divmod(self.vocab_size, self.num_parts)
        initializer = keras.initializers.RandomNormal(stddev=self.stddev)
        self.parts = [self.add_weight(shape=(base + (1 if i < extra else 0), self.dim), initializer=initializer,
                                      name=f"part_{i}") for i in range(self.num_parts)]

    def call(self, ids):
        return tf.nn.embedding_lookup([part.value for part in self.parts], tf.cast(ids, tf.int32))

    def get_config(self) -> dict:
        return {**super().get_config(), "vocab_size": self.vocab_size, "dim": self.dim,
                "num_parts": self.num_parts, "stddev": self.stddev}


def generate_ratings(num_users: int, num_items: int, num_ratings: int, rank: int, noise: float,
                     seed: int) -> dict[str, np.ndarray]:
    """Ratings with a known structure: rating = <u_user, v_item> + b_user + b_item + noise.

    Factors are N(0, 1/sqrt(rank)) (the dot product has unit variance) and biases N(0, 0.5), so the rating
    variance is about 1.5 and a model that finds the structure gets down to noise**2.
    """
    rng = np.random.default_rng(seed)
    users_f = rng.normal(0, rank ** -0.5, (num_users, rank))
    items_f = rng.normal(0, rank ** -0.5, (num_items, rank))
    users_b, items_b = rng.normal(0, 0.5, num_users), rng.normal(0, 0.5, num_items)
    user, item = rng.integers(0, num_users, num_ratings), rng.integers(0, num_items, num_ratings)
    rating = (users_f[user] * items_f[item]).sum(1) + users_b[user] + items_b[item] + rng.normal(0, noise, num_ratings)
    return {"user": user.astype(np.int32), "item": item.astype(np.int32), "rating": rating.astype(np.float32)}


class Recommend(Task):
    """Predicts a user's rating of an item from two split embedding tables and per-user / per-item biases.

    Reads `config.dataset` (num_users, num_items, num_ratings, rank, noise, eval_fraction, seed) and
    `config.model` (dim, num_parts). Squared-error loss; reports RMSE. Batches are
    {"user": [b], "item": [b], "rating": [b]}; `serve` takes {"user", "item"} and returns ratings [b].
    """

    def __init__(self, config):
        super().__init__(config)
        self._split: tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None = None

    def _arrays(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        if self._split is None:  # mwloop asks more than once: generate once
            d = self.config.dataset
            ratings = generate_ratings(d.num_users, d.num_items, d.num_ratings, d.rank, d.noise, d.seed)
            n_eval = int(round(d.num_ratings * d.eval_fraction))
            self._split = ({k: v[n_eval:] for k, v in ratings.items()}, {k: v[:n_eval] for k, v in ratings.items()})
        return self._split

    def train_arrays(self) -> dict[str, np.ndarray]:
        return self._arrays()[0]

    def eval_arrays(self) -> dict[str, np.ndarray]:
        return self._arrays()[1]

    def build_model(self) -> keras.Model:
        """user, item -> <user vector, item vector> + user bias + item bias + global bias."""
        d, m = self.config.dataset, self.config.model
        user = keras.Input((), dtype="int32", name="user")
        item = keras.Input((), dtype="int32", name="item")
        user_vector = SplitEmbedding(d.num_users, m.dim, m.num_parts, name="user_embedding")(user)
        item_vector = SplitEmbedding(d.num_items, m.dim, m.num_parts, name="item_embedding")(item)
        user_bias = SplitEmbedding(d.num_users, 1, m.num_parts, stddev=0.0, name="user_bias")(user)
        item_bias = SplitEmbedding(d.num_items, 1, m.num_parts, stddev=0.0, name="item_bias")(item)
        dot = keras.layers.Dot(axes=1)([user_vector, item_vector])
        rating = keras.layers.Add()([dot, user_bias, item_bias])
        rating = keras.layers.Dense(1, kernel_initializer="ones", trainable=True, name="scale")(rating)
        return keras.Model({"user": user, "item": item}, rating, name="matrix_factorisation")

    def forward(self, model: keras.Model, batch, training: bool):
        return model({"user": batch["user"], "item": batch["item"]}, training=training)

    def loss(self, batch, outputs) -> tf.Tensor:
        """Per-example squared error, shape [b]."""
        return tf.square(outputs[:, 0] - batch["rating"])

    def metric_sums(self, batch, outputs, weights) -> Sums:
        return {"sq_error": tf.reduce_sum(tf.square(outputs[:, 0] - batch["rating"]) * weights)}

    def finalize(self, sums) -> dict[str, float]:
        return {"rmse": (sums["sq_error"] / sums["weight_sum"]) ** 0.5} if sums["weight_sum"] else {}
