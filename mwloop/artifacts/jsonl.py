"""JSON and JSON-lines files that survive a crash mid-write. Never imports TensorFlow (the sweep uses it).

Appends can be torn by a crash: only the last line of a JSON-lines file can be
incomplete, so `parse` drops it with a warning; anything else malformed is a
`CorruptFileError`. Rewrites go through `atomic_open`: a temporary file beside
the target, fsynced, then renamed over it, so the old content survives any
failure before the rename.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
from collections.abc import Iterator
from typing import IO, Any

from absl import logging

from mwloop.errors import UserError


class CorruptFileError(UserError):
    """A file that cannot be read back; the message is one line naming the file (and line)."""


# The splits already warned about (once each per process).
_warned_nonfinite: set[str] = set()


def dumps(event: dict[str, Any]) -> str:
    """`event` as one line of strict JSON: a NaN or Inf value becomes null, its key listed under "nonfinite"
    (strict readers reject bare NaN), with a warning naming the split and step (once per split)."""
    bad = [k for k, v in event.items() if isinstance(v, float) and not math.isfinite(v)]
    if not bad:
        return json.dumps(event)
    split = str(event.get("split", "?"))
    if split not in _warned_nonfinite:
        _warned_nonfinite.add(split)
        logging.warning("%s at step %s: %s not finite (%s); written as null with \"nonfinite\" in metrics.jsonl, "
                        "never taken as a best value (warned once per split)", split, event.get("step", "?"),
                        ", ".join(bad), ", ".join(f"{k}={event[k]}" for k in bad))
    return json.dumps({**{k: None if k in bad else v for k, v in event.items()}, "nonfinite": bad})


def _object(text: str) -> dict[str, Any] | None:
    """`text` as a JSON object, or None when it is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def parse(text: str, path: str) -> list[dict[str, Any]]:
    """The JSON objects of `text`, one per non-blank line (`path` names the file in messages).

    A malformed last line is what a crash mid-append leaves: it is skipped
    with a warning. A malformed line before it raises CorruptFileError.
    """
    lines = [(number, line) for number, line in enumerate(text.split("\n"), 1) if line.strip()]
    records = []
    for i, (number, line) in enumerate(lines):
        record = _object(line)
        if record is not None:
            records.append(record)
        elif i == len(lines) - 1:
            logging.warning("%s line %d is incomplete (a crash mid-write?); ignoring it", path, number)
        else:
            raise CorruptFileError(f"{path} line {number} is not a JSON object ({line[:60]!r}); only a last "
                                   f"line can be torn by a crash: fix or delete line {number}")
    return records


def read(path: str) -> list[dict[str, Any]]:
    """The records of the local JSON-lines file `path` (see `parse`)."""
    # errors="replace": a torn multi-byte character only spoils its own line.
    with open(path, errors="replace") as f:
        return parse(f.read(), path)


def read_json(path: str, nofollow: bool = False) -> dict[str, Any]:
    """The JSON object in the local file `path`; CorruptFileError if it is not one (e.g. torn).
    With `nofollow`, a symlink at `path` is an OSError (ELOOP), not read through."""
    flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_NOFOLLOW if nofollow else 0)
    with open(os.open(path, flags), errors="replace") as f:
        text = f.read()
    record = _object(text)
    if record is None:
        raise CorruptFileError(f"{path} is not a whole JSON object ({len(text)} bytes: torn by a crash?)")
    return record


@contextlib.contextmanager
def atomic_open(path: str, mode: str = "w", **kwargs: Any) -> Iterator[IO]:
    """A file to write `path`'s new content to; it replaces `path` only when the block succeeds.

    The content goes to `path.<pid>-<thread>.tmp` in the same directory (so the
    rename stays on one filesystem; a name of its own, so writers in other
    processes, e.g. sweep agents ending at once, never rename each other's), is
    flushed and fsynced, then `os.replace`d onto `path`: after a crash or an
    exception `path` holds its old content or the whole new one, never a mix.
    The temporary file is created afresh (O_EXCL | O_NOFOLLOW: a leftover or
    planted one, symlink or not, is removed, never written through), and the
    rename replaces a link at `path` rather than following it.
    """
    tmp = f"{path}.{os.getpid()}-{threading.get_ident()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        # A leftover of a crash, or a planted link: removed, not followed.
        os.remove(tmp)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with open(fd, mode, **kwargs) as f:
            yield f
            f.flush()
            # The data is on disk before the rename can be.
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def replace_file(path: str, text: str) -> None:
    """Replaces the file `path` with `text` in one step: if writing fails half-way, `path` keeps its old content."""
    # Local: atomic_open fsyncs before the atomic rename.
    if "://" not in path:
        with atomic_open(path) as f:
            f.write(text)
        return
    # Only for a remote path: jsonl never imports TensorFlow otherwise.
    import tensorflow as tf
    # GCS and other gfile filesystems: no fsync, but the rename only follows a whole write.
    tmp = path + ".tmp"
    try:
        with tf.io.gfile.GFile(tmp, "w") as f:
            f.write(text)
        tf.io.gfile.rename(tmp, path, overwrite=True)
    except BaseException:
        if tf.io.gfile.exists(tmp):
            tf.io.gfile.remove(tmp)
        raise
