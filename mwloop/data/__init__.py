"""Input pipelines: datasets by name (`config.dataset.name`), each a `Source` of dataset_fn(input_context)
factories for train and eval, sharded explicitly.

`source` defines `Source`; `digits`, `synthetic`, `imagenet` and `records` (`records_source`) each build one;
`pipeline` holds the tf.data pipelines over in-memory arrays and the sharding; `faults` injects NaN inputs for
drills. `records` (files plus an index: any record by global index), `indexed` (their training stream,
`open_dataset`) and `convert` (`python -m mwloop.data.convert`) hold data on disk with the in-memory arrays'
promises.
"""

from __future__ import annotations

import os
from typing import Callable

import ml_collections

from mwloop.data import digits, imagenet, records_source, synthetic
from mwloop.data.indexed import OnDisk, example_seed, open_dataset
from mwloop.data.source import Source
from mwloop.errors import UserError

__all__ = ["SOURCES", "OnDisk", "Source", "example_seed", "get_source", "open_dataset"]

SOURCES: dict[str, Callable[[ml_collections.ConfigDict], Source]] = {
    "digits": digits.digits, "synthetic": synthetic.synthetic, "imagenet": imagenet.imagenet,
    "records": records_source.records}


def get_source(cfg: ml_collections.ConfigDict) -> Source:
    """The Source named by `cfg.name`; `cfg.data_dir`, when set, must exist."""
    data_dir = cfg.get("data_dir")
    if data_dir and not os.path.isdir(data_dir):
        raise UserError(
            f"config.dataset.data_dir={data_dir!r} does not exist; point it at a data directory or unset it")
    if cfg.name not in SOURCES:
        raise UserError(f"config.dataset.name={cfg.name!r} is unknown; use one of {', '.join(SOURCES)}")
    return SOURCES[cfg.name](cfg)
