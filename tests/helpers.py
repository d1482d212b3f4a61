"""Small shared helpers for tests."""

from __future__ import annotations

import json
import os

import ml_collections

from mwloop.config import base as config_base

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_config(name: str, arg: str | None = None, **overrides) -> ml_collections.ConfigDict:
    """configs/<name>.py's get_config(arg), with dotted-key overrides applied (unchecked: tests hand bad
    settings to the entry points that must refuse them)."""
    return config_base.load(os.path.join(ROOT, "configs", f"{name}.py"), arg, overrides, check=False)


def read_metrics(workdir: str) -> list[dict]:
    """The events of workdir/metrics.jsonl."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def visible(directory: str) -> list[str]:
    """The names in `directory` without mwloop's hidden bookkeeping (e.g. an export tree's manifest), sorted."""
    return sorted(name for name in os.listdir(directory) if not name.startswith("."))
