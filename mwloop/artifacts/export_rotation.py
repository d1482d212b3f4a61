"""Which exports a run may delete: the ones it wrote, oldest written first, never the one just made.

An export tree (`workdir/export`, `export_best`) is shared by every run that ever used the workdir, and by
whoever else writes there. Version numbers are steps, so they say nothing about which export is newest: a
workdir retrained from scratch beside an old `export/200` writes `export/40`, and a rotation by number would
delete the export just made. So the rotation goes by write order, kept in a manifest `<base>/.mwloop-exports.json`
(`{"exports": [{"version": 40, "mark": "..."}, ...]}`, oldest first). Each export carries a random mark in a file
inside it (`<base>/<version>/.mwloop-export`), written before it is renamed into place; a directory is deleted
only when it is a real directory (no link) directly in `<base>` whose mark is the manifest's. Anything else in
`<base>` (a version copied in by hand, an older mwloop's unmarked export, stray files) is left alone and named
in one warning line.

No TensorFlow at import: `tf.io.gfile` is taken only for remote bases (`gs://...`).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import stat
from dataclasses import dataclass

from mwloop.artifacts import jsonl

MANIFEST = ".mwloop-exports.json"
MARK = ".mwloop-export"
LATEST = "latest"
# Names mwloop itself leaves or uses in a base directory (its temporaries are `.tmp-*`, `.old-*`, `.latest-*`).
_OWN = re.compile(r"(latest|\.mwloop-exports\.json(\.\d+-\d+\.tmp|\.tmp)?|\.(tmp|old|latest)-.*)")
# The files of an unversioned SavedModel an mwloop before versioned exports wrote straight into the base.
_LEGACY = ("saved_model.pb", "variables", "assets", "fingerprint.pb", "keras_metadata.pb")


@dataclass(frozen=True)
class Entry:
    """One export this mwloop wrote into the base: its version (a directory name) and its mark."""
    version: int
    mark: str


def _gfile():
    import tensorflow as tf  # remote bases only
    return tf.io.gfile


def _remote(path: str) -> bool:
    return "://" in path


def new_mark() -> str:
    """A random mark for one export (nobody else's directory carries it by accident)."""
    return secrets.token_hex(8)


def stamp(directory: str, mark: str) -> None:
    """Writes `mark` into the (not yet renamed) export `directory`."""
    path = os.path.join(directory, MARK)
    if _remote(directory):
        with _gfile().GFile(path, "w") as f:
            f.write(mark + "\n")
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with open(fd, "w") as f:
        f.write(mark + "\n")


def read_manifest(base: str) -> list[Entry]:
    """The exports mwloop recorded in `base`, oldest written first ([] when there is no readable manifest)."""
    path = os.path.join(base, MANIFEST)
    try:
        if _remote(base):
            if not _gfile().exists(path):
                return []
            with _gfile().GFile(path) as f:
                record = json.loads(f.read())
        else:
            record = jsonl.read_json(path, nofollow=True)
        return [Entry(int(e["version"]), str(e["mark"])) for e in record["exports"]]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError, jsonl.CorruptFileError):
        # Torn or planted: nothing in it is trusted, so nothing is deleted by it.
        return []


def write_manifest(base: str, entries: list[Entry]) -> None:
    """Replaces `base`'s manifest with `entries` in one step."""
    text = json.dumps({"exports": [{"version": e.version, "mark": e.mark} for e in entries]}, indent=1) + "\n"
    jsonl.replace_file(os.path.join(base, MANIFEST), text)


def is_ours(base: str, entry: Entry) -> bool:
    """Whether `base/<version>` is a real directory (not a link) carrying `entry`'s mark."""
    directory = os.path.join(base, str(entry.version))
    try:
        if _remote(base):
            if not _gfile().isdir(directory):
                return False
            with _gfile().GFile(os.path.join(directory, MARK)) as f:
                return f.read().strip() == entry.mark
        if not stat.S_ISDIR(os.lstat(directory).st_mode):
            return False
        fd = os.open(os.path.join(directory, MARK), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with open(fd, errors="replace") as f:
            return f.read(100).strip() == entry.mark
    except Exception:  # noqa: BLE001 (missing, unreadable, a link, any file system's error): not ours
        return False


def remove_tree(path: str) -> None:
    """Deletes the directory `path` (never follows a link at `path`)."""
    if _remote(path):
        _gfile().rmtree(path)
    elif os.path.islink(path):
        raise OSError(f"{path} is a link")
    else:
        shutil.rmtree(path)


def record_and_rotate(base: str, written: Entry, keep: int) -> list[int]:
    """Records `written` (just renamed into place) as the newest export, then deletes the oldest-written of
    mwloop's own exports beyond the `keep` newest (0 keeps all); never `written`. Returns the versions deleted.

    An entry whose directory is gone or no longer carries its mark is dropped from the manifest, and its
    directory (if any) left alone.
    """
    entries = [e for e in read_manifest(base) if e.version != written.version and is_ours(base, e)]
    entries.append(written)
    removed: list[int] = []
    if keep > 0 and len(entries) > keep:
        old, entries = entries[:-keep], entries[-keep:]
        for entry in old:
            try:
                remove_tree(os.path.join(base, str(entry.version)))
                removed.append(entry.version)
            except OSError:
                # Still there: still ours, tried again at the next export.
                entries.insert(0, entry)
    write_manifest(base, entries)
    return removed


def odd_entries(base: str, entries: list[Entry] | None = None) -> list[str]:
    """The names in `base` that are not mwloop's: neither a recorded export nor its own files."""
    recorded = {str(e.version) for e in (read_manifest(base) if entries is None else entries)}
    names = _gfile().listdir(base) if _remote(base) else os.listdir(base)
    names = [n.rstrip("/") for n in names]
    legacy = "saved_model.pb" in names
    return sorted(n for n in names if n not in recorded and not _OWN.fullmatch(n)
                  and not (legacy and n in _LEGACY))


def served_version(base: str) -> int | None:
    """The version TF Serving serves from `base`: the highest integer-named directory holding saved_model.pb."""
    names = _gfile().listdir(base) if _remote(base) else os.listdir(base)
    found = sorted((int(n.rstrip("/")) for n in names if re.fullmatch(r"\d+/?", n)), reverse=True)
    exists = _gfile().exists if _remote(base) else os.path.exists
    return next((v for v in found if exists(os.path.join(base, str(v), "saved_model.pb"))), None)


def oddities(base: str, just_written: int) -> str | None:
    """One line on whatever is odd in `base` after `just_written` went in, or None."""
    parts = []
    odd = odd_entries(base)
    if odd:
        parts.append(f"{', '.join(odd[:8])}{' ...' if len(odd) > 8 else ''} not written by this mwloop (left "
                     f"alone: remove or move them yourself)")
    names = set(_gfile().listdir(base) if _remote(base) else os.listdir(base))
    if "saved_model.pb" in names:
        parts.append("an unversioned SavedModel from an older mwloop (saved_model.pb, variables/; exports are "
                     "now in <base>/<step>)")
    served = served_version(base)
    if served is not None and served != just_written:
        parts.append(f"TF Serving serves the highest version, {served}, not {just_written} just written "
                     f"({LATEST} -> {just_written})")
    return f"{base} also holds {'; '.join(parts)}" if parts else None
