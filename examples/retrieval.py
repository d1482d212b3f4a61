"""A dual encoder for retrieval with in-batch negatives over the *global* batch, on mwloop's public Task API.

Each training example is a (query, document) pair. A query tower and a document tower embed them (unit
vectors); the loss is InfoNCE: each query's softmax over the similarities to every document of the global
batch, its own document the right answer and all the others negatives. The documents come from every
replica through `mwloop.gather_global_batch`, so 1 replica, N mirrored replicas and N workers train the
same model (tests/test_gather.py); with `config.model.negatives="local"` each replica scores its queries
against its own documents only (what the loss computes without the gather), which trains another model on
N replicas and reports a better recall (fewer candidates): for comparison only.

The data are generated: documents are points of a hidden space seen through one fixed random map, queries
noisy views of them through another, and several queries share a document, so a batch can hold the same
document twice: those copies are masked out of each other's negatives (they are not wrong answers). The
eval reports recall@k: how often a query's own document is among the k most similar documents of its eval
batch (`config.eval.global_batch_size` candidates, padding excluded). The export has two endpoints, `query`
and `document`, each returning embeddings: a retrieval system indexes the documents' embeddings and ranks
them by their dot product with a query's.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from mwloop import Endpoint, Sums, Task, gather_global_batch

MASKED = -1e9  # the logit of a candidate that is no negative (a copy of the positive, eval padding)


def generate(num_documents: int, num_pairs: int, *, latent_dim: int, query_dim: int, document_dim: int,
             query_noise: float, seed: int, pair_seed: int) -> dict[str, np.ndarray]:
    """`num_pairs` (query, document) pairs over `num_documents` documents: "query" [n, query_dim], "document"
    [n, document_dim] (float32), "doc_id" [n] (int32). The documents and both maps depend on `seed` only, the
    pairs (which document, the query's noise) on `pair_seed`: train and eval pairs share the documents."""
    rng = np.random.default_rng(seed)
    latent = rng.standard_normal((num_documents, latent_dim))
    to_document = rng.standard_normal((latent_dim, document_dim)) / latent_dim ** 0.5
    to_query = rng.standard_normal((latent_dim, query_dim)) / latent_dim ** 0.5
    documents = np.tanh(latent @ to_document)
    pairs = np.random.default_rng(pair_seed)
    doc_id = pairs.integers(0, num_documents, num_pairs)
    noisy = latent[doc_id] + query_noise * pairs.standard_normal((num_pairs, latent_dim))
    return {"query": np.tanh(noisy @ to_query).astype(np.float32), "document": documents[doc_id].astype(np.float32),
            "doc_id": doc_id.astype(np.int32)}


def tower(name: str, input_dim: int, hidden: int, dim: int) -> keras.Model:
    """An MLP to a unit vector of `dim` (the similarity of two embeddings is their dot product)."""
    inputs = keras.Input((input_dim,), name=name)
    x = keras.layers.Dense(hidden, activation="relu")(inputs)
    x = keras.layers.Dense(dim, dtype="float32")(x)
    return keras.Model(inputs, keras.ops.normalize(x, axis=-1), name=f"{name}_tower")


class DualEncoder(Task):
    """Query and document towers trained with a global-batch InfoNCE loss; reports recall@k.

    Batches: {"query": [b, query_dim], "document": [b, document_dim], "doc_id": [b]}. Reads `config.dataset`
    (num_documents, num_train_pairs, num_eval_pairs, latent_dim, query_dim, document_dim, query_noise, seed),
    `config.model` (hidden, dim, temperature, negatives: "global" | "local") and `config.recall_at` (the ks).
    """

    def __init__(self, config):
        super().__init__(config)
        self._data: dict[str, dict[str, np.ndarray]] = {}

    def _pairs(self, split: str) -> dict[str, np.ndarray]:
        if split not in self._data:  # mwloop asks more than once: generate once
            d = self.config.dataset
            self._data[split] = generate(
                d.num_documents, d.num_train_pairs if split == "train" else d.num_eval_pairs,
                latent_dim=d.latent_dim, query_dim=d.query_dim, document_dim=d.document_dim,
                query_noise=d.query_noise, seed=d.seed, pair_seed=d.seed + (1 if split == "train" else 2))
        return self._data[split]

    def train_arrays(self) -> dict[str, np.ndarray]:
        return self._pairs("train")

    def eval_arrays(self) -> dict[str, np.ndarray]:
        return self._pairs("eval")

    def build_model(self) -> keras.Model:
        d, m = self.config.dataset, self.config.model
        query = tower("query", d.query_dim, m.hidden, m.dim)
        document = tower("document", d.document_dim, m.hidden, m.dim)
        inputs = {"query": keras.Input((d.query_dim,), name="query"),
                  "document": keras.Input((d.document_dim,), name="document")}
        # The towers stay layers of their own (get_layer finds them for the two serving endpoints).
        return keras.Model(inputs, {"query": query(inputs["query"]), "document": document(inputs["document"])},
                           name="dual_encoder")

    def forward(self, model, batch, training):
        """Both embeddings, and each query's logits against the candidate documents [b, B] with its label:
        every replica's documents (`gather_global_batch`), or with negatives="local" this replica's own."""
        embeddings = model({"query": batch["query"], "document": batch["document"]}, training=training)
        candidates = {"document": embeddings["document"], "doc_id": batch["doc_id"]}  # doc_id: from the input
        if "mask" in batch:  # eval: mwloop's padding mask (0 for padding), so padding is no candidate
            candidates["mask"] = batch["mask"]
        if self.config.model.negatives == "local":
            offset = tf.constant(0, tf.int32)
        else:
            candidates, offset = gather_global_batch(candidates)
        similarity = tf.matmul(embeddings["query"], candidates["document"], transpose_b=True)  # cosines [b, B]
        logits = similarity / self.config.model.temperature
        labels = offset + tf.range(tf.shape(logits)[0], dtype=tf.int32)
        # Not negatives: another copy of the query's own document (the same doc_id in another row), padding.
        same = tf.equal(batch["doc_id"][:, None], candidates["doc_id"][None, :])
        own = tf.one_hot(labels, tf.shape(logits)[1], on_value=True, off_value=False)
        excluded = tf.logical_and(same, tf.logical_not(own))
        if "mask" in candidates:
            excluded = tf.logical_or(excluded, tf.equal(candidates["mask"], 0.0)[None, :])
        logits = tf.where(excluded, MASKED, logits)
        return {**embeddings, "logits": logits, "labels": labels}

    def loss(self, batch, outputs) -> tf.Tensor:
        """Per-query cross-entropy over the candidates [b]; mwloop divides the sum by the global batch."""
        return tf.nn.sparse_softmax_cross_entropy_with_logits(outputs["labels"], outputs["logits"])

    def metric_sums(self, batch, outputs, weights) -> Sums:
        """Queries whose own document ranks among the first k (for each k of config.recall_at): additive sums.

        The rank is the number of candidates scored strictly higher than the own document (ties favour it)."""
        logits = outputs["logits"]
        positive = tf.gather(logits, outputs["labels"], axis=1, batch_dims=1)
        rank = tf.reduce_sum(tf.cast(logits > positive[:, None], tf.int32), axis=1)
        return {f"hits_at_{k}": tf.reduce_sum(tf.cast(rank < k, tf.float32) * weights) for k in self.config.recall_at}

    def finalize(self, sums) -> dict[str, float]:
        examples = sums["examples"]
        return {f"recall_at_{k}": sums[f"hits_at_{k}"] / examples if examples else 0.0 for k in self.config.recall_at}

    def serving_endpoints(self, model) -> dict[str, Endpoint]:
        """`query(query)` and `document(document)`: unit embeddings [b, dim] of float32 features."""
        d = self.config.dataset
        query, document = model.get_layer("query_tower"), model.get_layer("document_tower")
        return {"query": (lambda features: query(features, training=False),
                          [tf.TensorSpec([None, d.query_dim], tf.float32, name="query")]),
                "document": (lambda features: document(features, training=False),
                             [tf.TensorSpec([None, d.document_dim], tf.float32, name="document")])}
