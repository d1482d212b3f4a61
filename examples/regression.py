"""Regression on scikit-learn's bundled diabetes data (442 patients, 10 features), on mwloop's public Task API."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_diabetes

from mwloop import Sums, Task


class Regression(Task):
    """A small MLP predicting disease progression; squared-error loss; reports MAE, MSE and R^2.

    Reads `config.dataset.eval_fraction` / `split_seed`, `config.model.hidden` and
    `config.optimizer.weight_decay`. Features and target are standardised with the training split's
    statistics, so the target (raw range 25..346) has unit scale and the loss starts near 1 whatever the
    learning rate; MAE and MSE are therefore in standard deviations of the training target (R^2 is
    unchanged by the rescaling). `serve` returns standardised predictions: multiply by
    `target_std` and add `target_mean` for raw units.
    """

    def __init__(self, config):
        super().__init__(config)
        self._split: tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None = None

    def _arrays(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """(train, eval) arrays, split and standardised once: mwloop asks for them more than once."""
        if self._split is None:
            x, y = load_diabetes(return_X_y=True, scaled=False)  # raw units; we standardise below
            order = np.random.default_rng(self.config.dataset.split_seed).permutation(len(x))
            n_eval = int(round(len(x) * self.config.dataset.eval_fraction))
            train, held_out = order[n_eval:], order[:n_eval]
            # Train statistics only, so nothing about the eval split leaks into training.
            x_mean, x_std = x[train].mean(0), x[train].std(0)
            self.target_mean, self.target_std = y[train].mean(), y[train].std()

            def arrays(index):
                return {"inputs": ((x[index] - x_mean) / x_std).astype(np.float32),
                        "target": ((y[index] - self.target_mean) / self.target_std).astype(np.float32)}
            self._split = arrays(train), arrays(held_out)
        return self._split

    def train_arrays(self) -> dict[str, np.ndarray]:
        """Standardised training features ("inputs", [n, 10]) and target ("target", [n])."""
        return self._arrays()[0]

    def eval_arrays(self) -> dict[str, np.ndarray]:
        """The held-out split, standardised with the training statistics."""
        return self._arrays()[1]

    def build_model(self) -> keras.Model:
        """Functional MLP with a named input (the inherited `serve` endpoint is built from it); output [b, 1]."""
        wd = self.config.optimizer.weight_decay
        # L2 of wd / 2 so the gradient is wd * w, as mwloop's built-in models do.
        regularizer = keras.regularizers.L2(wd / 2) if wd else None
        inputs = keras.Input((self.train_arrays()["inputs"].shape[1],), name="inputs")
        x = inputs
        for width in self.config.model.hidden:
            x = keras.layers.Dense(width, activation="relu", kernel_regularizer=regularizer)(x)
        outputs = keras.layers.Dense(1, kernel_regularizer=regularizer, dtype="float32")(x)
        return keras.Model(inputs, outputs, name="regression_mlp")

    def loss(self, batch, outputs) -> tf.Tensor:
        """Per-example squared error, shape [b]; mwloop does the (global) mean."""
        return tf.square(self._error(batch, outputs))

    def metric_sums(self, batch, outputs, weights) -> Sums:
        """Weighted sums (weights zero the eval padding) from which `finalize` gets MAE, MSE and R^2."""
        error, target = self._error(batch, outputs), batch["target"]
        return {"abs_error": tf.reduce_sum(tf.abs(error) * weights),
                "sq_error": tf.reduce_sum(tf.square(error) * weights),
                "target": tf.reduce_sum(target * weights),
                "target_sq": tf.reduce_sum(tf.square(target) * weights)}

    def finalize(self, sums) -> dict[str, float]:
        """MAE, MSE and R^2 = 1 - SS_res / SS_tot over everything summed. R^2 is a ratio of global sums,
        not a mean of per-example values, which is why it is computed here and not per batch."""
        n = sums["weight_sum"]
        if not n:
            return {}
        ss_tot = sums["target_sq"] - sums["target"] ** 2 / n
        return {"mae": sums["abs_error"] / n, "mse": sums["sq_error"] / n,
                "r2": 1.0 - sums["sq_error"] / ss_tot if ss_tot > 0 else float("nan")}

    @staticmethod
    def _error(batch, outputs) -> tf.Tensor:
        # [b, 1] -> [b]: broadcasting [b, 1] against [b] would silently give [b, b].
        return tf.cast(outputs[:, 0], tf.float32) - batch["target"]
