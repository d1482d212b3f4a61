"""Image folders for the tests of the ImageNet-layout pipeline (and the fault suite)."""

from __future__ import annotations

import os

import numpy as np
import tensorflow as tf

from mwloop.data.make_tfrecords import JPEG_QUALITY


def make_fake_image_folders(directory: str, num_classes: int, per_class: int, size: int = 32, seed: int = 0,
                            png_every: int = 0) -> list[str]:
    """A class-folder tree of smooth JPEGs (every `png_every`-th a PNG) for tests and demos.

    Class c is a colour gradient with a class-dependent hue, so images survive
    JPEG round trips recognisably. Returns the class folder names.
    """
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0.0, 1.0, size, dtype=np.float32)
    names = [f"class_{c:03d}" for c in range(num_classes)]
    for c, name in enumerate(names):
        os.makedirs(os.path.join(directory, name), exist_ok=True)
        colour = np.array([(c * 97) % 256, (c * 57 + 80) % 256, (c * 31 + 160) % 256], np.float32)
        for i in range(per_class):
            shade = rng.uniform(0.3, 1.0)
            image = colour * shade * (0.5 + 0.5 * ramp[:, None, None]) * (0.75 + 0.25 * ramp[None, :, None])
            pixels = tf.constant(np.clip(image, 0, 255).astype(np.uint8))
            png = png_every and (i + 1) % png_every == 0
            data = tf.io.encode_png(pixels) if png else tf.io.encode_jpeg(pixels, quality=JPEG_QUALITY)
            with open(os.path.join(directory, name, f"{i:04d}.{'png' if png else 'jpg'}"), "wb") as f:
                f.write(data.numpy())
    return names
