"""The `records` source: the built-in image classification trained on records by global index.

    --config.dataset.name=records --config.dataset.data_dir=OUT    (OUT written by python -m mwloop.data.convert)

OUT/train is read through `Task.train_records` (the same records per step at any worker count, resume without
reading what came before, elastic re-forms), OUT/validation is the eval set (every record once, masked padding).
Either images from class folders (labels from 0) or ImageNet-layout TFRecords indexed in place (labels from
`config.dataset.label_offset`).
"""

from __future__ import annotations

import functools
import os

import ml_collections

from mwloop.data import imagenet, indexed
from mwloop.data.source import Source
from mwloop.errors import UserError


def records(cfg: ml_collections.ConfigDict) -> Source:
    """OUT/train and OUT/validation of `cfg.data_dir` as a Source whose training data is `train_records`."""
    data_dir = cfg.get("data_dir")
    if not data_dir:
        raise UserError("config.dataset.name='records' needs config.dataset.data_dir: the folder written by "
                        "python -m mwloop.data.convert --output=DIR")
    image_size, tuning = cfg.get("image_size", 224), imagenet.tuning_knobs(cfg)
    train = _open(os.path.join(data_dir, "train"), cfg, image_size, augment=True)
    validation = _open(os.path.join(data_dir, "validation"), cfg, image_size, augment=False)
    classes = train.records.meta.get("classes")
    num_classes = cfg.get("num_classes") or (len(classes) if classes else None)
    if not num_classes:
        raise UserError(f"{data_dir}/train names no classes (TFRecords indexed in place); set "
                        f"config.dataset.num_classes")

    def train_dataset_fn(global_batch_size: int, seed: int, start_step: int = 0):
        return functools.partial(train.train_dataset, global_batch_size=global_batch_size, seed=seed,
                                 start_step=start_step, **tuning)

    def eval_dataset_fn(global_batch_size: int):
        # The training rule for bad records holds for eval too: one line, or counted when opted in.
        return functools.partial(validation.eval_dataset, global_batch_size=global_batch_size,
                                 skip_bad_records=cfg.get("skip_bad_records", 0.0), **tuning)

    return Source("records", (image_size, image_size, 3), num_classes, len(train.records), len(validation.records),
                  train_dataset_fn, eval_dataset_fn,
                  decode_image=functools.partial(imagenet.preprocess_eval, image_size=image_size), train_records=train)


def _open(root: str, cfg: ml_collections.ConfigDict, image_size: int, augment: bool) -> indexed.OnDisk:
    on_disk = indexed.open_dataset(root, image_size=image_size, augment=augment)
    kind = on_disk.records.meta.get("kind")
    if kind == "tfrecords":
        decode = indexed.decode_imagenet_layout(image_size, augment, label_offset=cfg.get("label_offset", 1))
        return indexed.OnDisk(on_disk.records, decode)
    if kind != "images":
        raise UserError(f"{root} holds {kind}, not images; the built-in image classification reads images (a task of "
                        f"your own reads any records: docs/data.md)")
    return on_disk
