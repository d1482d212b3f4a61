"""Random in-memory images and labels of any shape: for speed measurements."""

from __future__ import annotations

import ml_collections
import numpy as np

from mwloop.data.source import Source, arrays_source


def synthetic(cfg: ml_collections.ConfigDict) -> Source:
    """Random images and labels of a given shape, for speed measurements (nothing to learn)."""
    shape, num_classes = tuple(cfg.image_shape), cfg.num_classes

    def make(seed: int, n: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        return {"image": rng.standard_normal((n, *shape), dtype=np.float32),
                "label": rng.integers(0, num_classes, n).astype(np.int32)}

    return arrays_source("synthetic", make(0, cfg.num_train_examples), make(1, cfg.num_eval_examples), num_classes,
                         threads=cfg.get("threads", 0))
