"""Records on disk addressed by one global index: TFRecord files plus a small index of where each record is.

A records dataset is a folder:

    records.json         the manifest: the files (name, size, record count), the features, the index's digest
    records.index.npy    one row per record, in global index order: (file, offset, length, fingerprint)
    part-00000 ...       TFRecord files (tf.data.TFRecordDataset reads them as they are)

Any process reads any record by its global index: one positioned read (`os.pread`, or a seek and read through
`tf.io.gfile` for gs:// and other remote paths) per record, the reads of one batch sorted by file and offset.
Why this and not ArrayRecord: docs/data.md (the figures).

Nothing is silently skipped. `open_records` refuses, in one line naming the file, a missing file, a file whose
size is not the one indexed (truncated, grown, rewritten) and an index that does not match its manifest;
`Records.read` refuses a short record, and `check` (in the graph: `indexed.read_batch`) one whose bytes no
longer have the indexed fingerprint (a flipped byte), naming the file, the record's global index and offset.
The fingerprint is farmhash64 (`tf.fingerprint`): computed in C++ without the GIL, about 5x cheaper than
Python's zlib.crc32 per 110 kB record here (11 vs 53 us), which made the Python reader the bottleneck.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
from typing import Sequence

import numpy as np
import tensorflow as tf

from mwloop.errors import UserError

MANIFEST = "records.json"
INDEX = "records.index.npy"
FORMAT = "mwloop-records-1"
# A TFRecord's framing: uint64 length, uint32 masked crc of the length, the payload, uint32 masked crc.
HEADER_BYTES, FOOTER_BYTES = 12, 4
INDEX_DTYPE = np.dtype([("file", "<u4"), ("offset", "<u8"), ("length", "<u4"), ("fingerprint", "<i8")])


class RecordsError(UserError):
    """Records that do not match their index (missing, truncated, changed or corrupt): one line, exit 2."""


def index_digest(index: np.ndarray) -> str:
    """sha256 of the index rows: the manifest holds it, so an index that is not the files' own is refused."""
    return hashlib.sha256(np.ascontiguousarray(index).tobytes()).hexdigest()


def _is_local(path: str) -> bool:
    return "://" not in path


@dataclasses.dataclass
class Records:
    """An opened records dataset: its files, its index and reads by global index.

    Attributes:
      root: the dataset's folder.
      files: the files' paths, by file number.
      index: INDEX_DTYPE rows, one per record.
      features: the manifest's description of a record's features (what the converter wrote).
      meta: the manifest's other entries (kind, classes, ...).
    """
    root: str
    files: list[str]
    index: np.ndarray
    features: dict
    meta: dict
    _handles: dict = dataclasses.field(default_factory=dict, repr=False)

    def __len__(self) -> int:
        return len(self.index)

    def record_error(self, position: int, what: str) -> RecordsError:
        """The one-line error naming the record at global index `position` (its file and offset), `what` is wrong."""
        row = self.index[position]
        return RecordsError(f"{self.files[row['file']]}: record {position} (offset "
                            f"{int(row['offset'])}) {what}; the file changed after it was indexed: rewrite the "
                            f"dataset with python -m mwloop.data.convert")

    def _read_at(self, file_number: int, offset: int, length: int) -> bytes:
        path = self.files[file_number]
        if _is_local(path):
            fd = self._handles.get(file_number)
            if fd is None:
                # tf.data's threads may race here: the loser's descriptor stays open until the process ends.
                fd = self._handles.setdefault(file_number, os.open(path, os.O_RDONLY))
            return os.pread(fd, length, offset)
        with tf.io.gfile.GFile(path, "rb") as f:
            f.seek(offset)
            return f.read(length)

    def read(self, positions: Sequence[int] | np.ndarray, short_ok: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """The payloads of the records at global indices `positions`, and their indexed fingerprints.

        Reads are sorted by (file, offset) so a batch of neighbours is read in disk order. The payloads'
        fingerprints are checked by `check` (or in the graph), not here: Python would hold the GIL for it.

        Args:
          positions: global indices.
          short_ok: a record cut short (its file truncated since it was opened) is returned as read, for the
            fingerprint check to find (skipping bad records); else it raises.
        Returns:
          (an object array of bytes, an int64 array of the fingerprints the index holds for them).
        Raises:
          RecordsError: a global index out of range, or a record cut short (the file was truncated).
        """
        positions = np.asarray(positions, np.int64).reshape(-1)
        if positions.size and (positions.min() < 0 or positions.max() >= len(self.index)):
            raise RecordsError(f"{self.root}: global index {int(positions.max())} is outside its "
                               f"{len(self.index)} records")
        rows = self.index[positions]
        out = np.empty(len(positions), object)
        for k in np.lexsort((rows["offset"], rows["file"])):
            row = rows[k]
            data = self._read_at(int(row["file"]), int(row["offset"]) + HEADER_BYTES, int(row["length"]))
            if len(data) != row["length"] and not short_ok:
                raise self.record_error(int(positions[k]), f"is cut short ({len(data)} of {int(row['length'])} bytes)")
            out[k] = data
        return out, rows["fingerprint"]

    def fail_checksum(self, positions: np.ndarray, found: np.ndarray) -> np.ndarray:
        """Raises the RecordsError naming the first of `positions` whose `found` fingerprint is not the index's."""
        bad = np.flatnonzero(self.index[np.asarray(positions)]["fingerprint"] != found)
        if not bad.size:
            raise AssertionError("fail_checksum called with matching fingerprints")
        raise self.record_error(int(positions[bad[0]]), "does not match its checksum")

    def check(self, positions: Sequence[int] | np.ndarray, payloads: np.ndarray) -> None:
        """Raises RecordsError when a payload read for `positions` does not have its indexed fingerprint."""
        positions = np.asarray(positions, np.int64).reshape(-1)
        found = fingerprints(tf.constant(list(payloads), tf.string)).numpy() if len(payloads) else np.zeros(0)
        if np.any(self.index[positions]["fingerprint"] != found):
            self.fail_checksum(positions, found)

    def close(self) -> None:
        for fd in self._handles.values():
            os.close(fd)
        self._handles.clear()


def _size(path: str) -> int | None:
    if _is_local(path):
        try:
            return os.path.getsize(path)
        except FileNotFoundError:
            return None
    return tf.io.gfile.stat(path).length if tf.io.gfile.exists(path) else None


def _read_json(path: str) -> dict:
    if _is_local(path):
        with open(path) as f:
            return json.load(f)
    with tf.io.gfile.GFile(path) as f:
        return json.load(f)


def _load_index(path: str) -> np.ndarray:
    if _is_local(path):
        return np.load(path)
    with tf.io.gfile.GFile(path, "rb") as f:
        return np.load(io.BytesIO(f.read()))


def open_records(root: str) -> Records:
    """Opens the records dataset in `root` after checking its index against its files.

    Args:
      root: a folder written by `python -m mwloop.data.convert` (local or gs://).
    Returns:
      The dataset, ready to read by global index.
    Raises:
      RecordsError: no manifest, an index that is not the manifest's, a missing file, or a file whose size
        differs from the indexed one (truncated, grown or rewritten since); the line names the file and the fix.
    """
    manifest_path = os.path.join(root, MANIFEST)
    if _size(manifest_path) is None:
        raise RecordsError(f"{root} has no {MANIFEST}: it is not a records dataset; write one with "
                           f"python -m mwloop.data.convert --output={root}")
    manifest = _read_json(manifest_path)
    if manifest.get("format") != FORMAT:
        raise RecordsError(f"{manifest_path} has format {manifest.get('format')!r}, not {FORMAT!r}; rewrite the "
                           f"dataset with python -m mwloop.data.convert")
    index_path = os.path.join(root, INDEX)
    if _size(index_path) is None:
        raise RecordsError(f"{index_path} is missing; rewrite the dataset with python -m mwloop.data.convert")
    index = _load_index(index_path)
    if index.dtype != INDEX_DTYPE or index_digest(index) != manifest["index_sha256"]:
        raise RecordsError(f"{index_path} does not match {manifest_path} (its digest differs): the index is not "
                           f"this dataset's; rewrite the dataset with python -m mwloop.data.convert")
    files = [os.path.join(root, entry["name"]) for entry in manifest["files"]]
    for path, entry in zip(files, manifest["files"]):
        size = _size(path)
        if size is None:
            raise RecordsError(f"{path} is missing (record file of {root}); restore it or rewrite the dataset with "
                               f"python -m mwloop.data.convert")
        if size != entry["size"]:
            raise RecordsError(f"{path} has {size} bytes where {entry['size']} were indexed: it was "
                               f"{'truncated' if size < entry['size'] else 'changed'} after indexing; restore it "
                               f"or rewrite the dataset with python -m mwloop.data.convert")
    meta = {k: v for k, v in manifest.items() if k not in ("files", "features", "index_sha256", "format")}
    return Records(root, files, index, manifest.get("features", {}), meta)


def fingerprints(payloads: tf.Tensor) -> tf.Tensor:
    """farmhash64 of each string of `payloads` [N], as int64 [N]: the per-record checksum of the index."""
    return tf.reshape(tf.bitcast(tf.fingerprint(payloads), tf.int64), [-1])


def index_file(file_number: int, payloads: Sequence[bytes]) -> np.ndarray:
    """Index rows of `payloads` written in order as TFRecords from the start of file `file_number`."""
    rows = np.zeros(len(payloads), INDEX_DTYPE)
    rows["file"] = file_number
    rows["length"] = [len(p) for p in payloads]
    rows["offset"] = np.concatenate([[0], np.cumsum(rows["length"].astype(np.uint64) + HEADER_BYTES
                                                    + FOOTER_BYTES)[:-1]]) if len(payloads) else []
    if len(payloads):
        rows["fingerprint"] = fingerprints(tf.constant(list(payloads), tf.string)).numpy()
    return rows


def write_manifest(root: str, file_names: list[str], index: np.ndarray, features: dict, **meta) -> None:
    """Writes the index, then the manifest (temp then rename: a dataset is complete once its manifest exists)."""
    np.save(os.path.join(root, INDEX), index)
    counts = np.bincount(index["file"], minlength=len(file_names)) if len(index) else np.zeros(len(file_names))
    manifest = {"format": FORMAT, "num_records": int(len(index)), "index_sha256": index_digest(index),
                "files": [{"name": name, "size": os.path.getsize(os.path.join(root, name)), "records": int(count)}
                          for name, count in zip(file_names, counts)],
                "features": features, **meta}
    temp = os.path.join(root, MANIFEST + ".tmp")
    with open(temp, "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(temp, os.path.join(root, MANIFEST))
