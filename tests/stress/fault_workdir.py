"""The fault suite's view of a workdir before and after a command (tests/stress/fault_harness.py runs the
commands): a `Snapshot` of its checkpoints (each readable or not) and metrics.jsonl, what a command lost
(`data_lost`), which of a run's files it wrote (`written`), and whether an export loads. Importable from
fault_harness too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re


@dataclasses.dataclass
class Snapshot:
    exists: bool
    checkpoints: dict[int, bool]  # step -> readable
    events: list[dict]  # the well-formed lines of metrics.jsonl
    malformed: list[int]  # line numbers of malformed lines (but a torn last one)


def readable(prefix: str) -> bool:
    """Whether every tensor of the checkpoint `prefix` can be read."""
    import tensorflow as tf
    try:
        reader = tf.train.load_checkpoint(prefix)
        for name in reader.get_variable_to_shape_map():
            reader.get_tensor(name)
        return True
    except Exception:  # noqa: BLE001 - any failure means unreadable
        return False


def export_load_error(path: str, name: str) -> str | None:
    """None if the SavedModel at `path` loads (what a server would meet); else one line naming `name`."""
    import tensorflow as tf
    try:
        tf.saved_model.load(path)
    except Exception as e:  # noqa: BLE001 - any failure is the finding
        return f"{name} does not load: {str(e).splitlines()[0][:160]}"
    return None


def snapshot(workdir: str) -> Snapshot:
    directory = os.path.join(workdir, "checkpoints")
    steps = {}
    if os.path.isdir(directory):
        for name in os.listdir(directory):
            if m := re.fullmatch(r"ckpt-(\d+)\.index", name):
                steps[int(m[1])] = readable(os.path.join(directory, f"ckpt-{m[1]}"))
    events, malformed = [], []
    path = os.path.join(workdir, "metrics.jsonl")
    if os.path.isfile(path):
        with open(path, errors="replace") as f:
            lines = [(n, line) for n, line in enumerate(f.read().split("\n"), 1) if line.strip()]
        for i, (n, line) in enumerate(lines):
            try:
                events.append(json.loads(line))
            except ValueError:
                if i < len(lines) - 1:
                    malformed.append(n)
    return Snapshot(os.path.isdir(workdir), steps, events, malformed)


def data_lost(before: Snapshot, after: Snapshot) -> str | None:
    """What a command lost: the newest readable checkpoint went back, or a metrics line of a checkpointed step."""
    newest_before = max((s for s, ok in before.checkpoints.items() if ok), default=None)
    newest_after = max((s for s, ok in after.checkpoints.items() if ok), default=None)
    if newest_before is not None and (newest_after is None or newest_after < newest_before):
        return f"readable ckpt-{newest_before} was lost (newest readable now: {newest_after})"
    for event in before.events:
        if newest_before is not None and event.get("step", 0) <= newest_before and event not in after.events:
            return f"metrics.jsonl lost the line {json.dumps(event)[:80]}"
    new_malformed = sorted(set(after.malformed) - set(before.malformed))
    if new_malformed:
        return f"metrics.jsonl has malformed line(s) {new_malformed} afterwards"
    return None


WRITTEN = ("config.json", "metrics.jsonl", "checkpoints", "export")


def written(workdir: str) -> list[str]:
    return [name for name in WRITTEN if os.path.exists(os.path.join(workdir, name))]
