"""A causal Transformer language model on generated additions ("37+5=42$"), on mwloop's public Task API.

The sequences vary in length and are padded to a fixed `config.dataset.max_len`: mwloop needs a static
number of tokens per example, and the padding gets loss weight 0, so the mean is over real tokens only.
"""

from __future__ import annotations

import math

import keras
import numpy as np
import tensorflow as tf

from mwloop import Endpoint, Sums, Task

PAD = 0
VOCAB = ("<pad>",) + tuple("0123456789+=$")  # "$" ends a sequence, so the model learns where to stop
IDS = {ch: i for i, ch in enumerate(VOCAB)}
EQUALS = IDS["="]


def encode(text: str, length: int) -> np.ndarray:
    """Character ids of `text`, right-padded with PAD to `length` (int32)."""
    if len(text) > length:
        raise ValueError(f"{text!r} has {len(text)} characters; max_len is {length}")
    return np.array([IDS[ch] for ch in text] + [PAD] * (length - len(text)), np.int32)


def decode(ids) -> str:
    """The text of character ids, up to the first PAD."""
    ids = np.asarray(ids).tolist()
    return "".join(VOCAB[i] for i in ids[:ids.index(PAD) if PAD in ids else len(ids)])


def additions(n: int, *, max_digits: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """[n, length] int32 token ids of "a+b=c$" with a and b of 1..max_digits digits (the digit count uniform,
    so 1-digit operands are as common as 3-digit ones and lengths vary)."""
    if length < 3 * max_digits + 4:  # two operands, the sum (one more digit), "+", "=", "$"
        raise ValueError(f"max_len={length} is too short for {max_digits}-digit additions; "
                         f"use at least {3 * max_digits + 4}")
    digits = rng.integers(1, max_digits + 1, size=(n, 2))
    operands = rng.integers(np.where(digits == 1, 0, 10 ** (digits - 1)), 10 ** digits)
    return np.stack([encode(f"{a}+{b}={a + b}$", length) for a, b in operands.tolist()])


class CausalLM(Task):
    """Next-token prediction on `additions`. Batches {"tokens": int32 [b, max_len]}: the model reads
    tokens[:, :-1] and predicts tokens[:, 1:]. Reports per-token loss, token accuracy, perplexity, and,
    for the part after "=" (the part the prompt determines; operand digits are random), answer-token
    accuracy and exact match.

    Config: `dataset.{train_size, eval_size, max_digits, max_len, seed}`,
    `model.{d_model, num_heads, num_layers, mlp_ratio}`.
    """

    def __init__(self, config):
        super().__init__(config)
        self._splits: dict[str, np.ndarray] | None = None

    def _data(self) -> dict[str, np.ndarray]:
        # mwloop asks for the arrays several times per run: generate them once. Their own seed (not
        # config.seed) keeps the data fixed when only the run's initialisation/order seed changes.
        if self._splits is None:
            d = self.config.dataset
            rng = np.random.default_rng(d.seed)
            def make(n):
                return additions(n, max_digits=d.max_digits, length=d.max_len, rng=rng)
            self._splits = {"train": make(d.train_size), "eval": make(d.eval_size)}
        return self._splits

    def train_arrays(self) -> dict[str, np.ndarray]:
        """The fixed training set, in memory: exact resume and mwloop's resident feed."""
        return {"tokens": self._data()["train"]}

    def eval_arrays(self) -> dict[str, np.ndarray]:
        """The fixed eval set (drawn after the training set from the same seeded generator)."""
        return {"tokens": self._data()["eval"]}

    def build_model(self) -> keras.Model:
        """Token + learned position embeddings, pre-norm causal self-attention blocks, float32 logits."""
        m, length = self.config.model, self.config.dataset.max_len - 1
        tokens = keras.Input((length,), dtype="int32", name="tokens")  # named: the serving signature
        positions = keras.ops.cumsum(keras.ops.ones_like(tokens), axis=1) - 1  # 0..length-1, symbolic
        x = (keras.layers.Embedding(len(VOCAB), m.d_model)(tokens)
             + keras.layers.Embedding(length, m.d_model)(positions))
        for _ in range(m.num_layers):
            h = keras.layers.LayerNormalization()(x)
            # Right padding and the causal mask: real positions never attend to padding, so no
            # attention mask is needed, and padded positions' outputs only meet weight-0 losses.
            x = x + keras.layers.MultiHeadAttention(m.num_heads, m.d_model // m.num_heads)(
                h, h, use_causal_mask=True)
            h = keras.layers.LayerNormalization()(x)
            h = keras.layers.Dense(m.mlp_ratio * m.d_model, activation="gelu")(h)
            x = x + keras.layers.Dense(m.d_model)(h)
        x = keras.layers.LayerNormalization()(x)
        logits = keras.layers.Dense(len(VOCAB), dtype="float32", name="logits")(x)  # float32 under mixed precision
        return keras.Model(tokens, logits, name="causal_lm")

    def forward(self, model, batch, training):
        """Logits [b, max_len - 1, vocab] for the inputs tokens[:, :-1]."""
        return tf.cast(model(batch["tokens"][:, :-1], training=training), tf.float32)

    def loss(self, batch, outputs):
        """Per-token cross-entropy [b, max_len - 1] against tokens[:, 1:], weight 0 on padding.

        Unreduced: mwloop divides the weighted sum by the global sum of weights (all replicas)."""
        targets = batch["tokens"][:, 1:]
        losses = keras.losses.sparse_categorical_crossentropy(targets, outputs, from_logits=True)
        return losses, tf.cast(tf.not_equal(targets, PAD), tf.float32)

    def metric_sums(self, batch, outputs, weights) -> Sums:
        """Correct tokens; answer tokens (after "=") and correct ones; sequences with the whole answer right.

        `weights` already holds the padding weights times the eval mask of padded examples."""
        inputs, targets = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
        correct = tf.cast(tf.equal(tf.argmax(outputs, -1, output_type=tf.int32), targets), tf.float32)
        # A target is part of the answer when an "=" is at or before its input position.
        answer = weights * tf.cast(tf.cumsum(tf.cast(tf.equal(inputs, EQUALS), tf.int32), axis=1) > 0, tf.float32)
        wrong_answer_tokens = tf.reduce_sum(answer * (1.0 - correct), axis=1)
        example_weight = tf.reduce_max(weights, axis=1)  # 1 for a real example, 0 for eval padding
        return {"correct_tokens": tf.reduce_sum(correct * weights),
                "answer_tokens": tf.reduce_sum(answer),
                "correct_answer_tokens": tf.reduce_sum(correct * answer),
                "exact_answers": tf.reduce_sum(tf.cast(wrong_answer_tokens == 0, tf.float32) * example_weight)}

    def finalize(self, sums):
        """Token accuracy and perplexity over real tokens; answer accuracy and exact match."""
        def ratio(a, b):
            return sums[a] / sums[b] if sums[b] else 0.0
        mean_loss = ratio("loss_sum", "weight_sum")
        return {"token_accuracy": ratio("correct_tokens", "weight_sum"),
                "perplexity": math.exp(min(mean_loss, 50.0)),  # capped: a diverged run must still log
                "answer_accuracy": ratio("correct_answer_tokens", "answer_tokens"),
                "exact_match": ratio("exact_answers", "examples")}

    def serving_endpoints(self, model) -> dict[str, Endpoint]:
        """`serve(tokens)`: next-token probabilities [b, max_len - 1, vocab] for int32 ids [b, max_len - 1]
        (right-padded with 0: position i's row is the distribution of the token after position i)."""
        length = self.config.dataset.max_len - 1
        return {"serve": (lambda tokens: tf.nn.softmax(tf.cast(model(tokens, training=False), tf.float32)),
                          [tf.TensorSpec([None, length], tf.int32, name="tokens")])}
