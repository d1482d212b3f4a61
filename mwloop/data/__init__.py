"""Input pipelines: dataset_fn(input_context) per dataset, sharded explicitly."""

from mwloop.data.sources import Source, get_source

__all__ = ["Source", "get_source"]
