"""Small shared helpers for tests."""

from __future__ import annotations

import json
import os

import ml_collections

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_config(name: str, arg: str | None = None, **overrides) -> ml_collections.ConfigDict:
    """configs/<name>.py's get_config(arg), with dotted-key overrides applied."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"configs_{name}", os.path.join(ROOT, "configs", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(arg)
    config.update_from_flattened_dict(overrides)
    return config


def read_metrics(workdir: str) -> list[dict]:
    """The events of workdir/metrics.jsonl."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]
