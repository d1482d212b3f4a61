"""SavedModel exports in the layout TensorFlow Serving loads: `<base>/<step>/saved_model.pb`.

TF Serving watches a base directory, loads its highest integer-named version
and ignores every other name. Each export is written to a temporary directory
beside the versions (`<base>/.tmp-<step>-<pid>`, which Serving ignores) and
renamed into place only when whole, so a failed export (disk full, a crash)
leaves every earlier version as it was. The `keep` versions written last stay
(by write order, not by number: `export_rotation.py`), the one just written
always; only directories mwloop made are ever deleted, and whatever else is in
`<base>` is named in one warning. On a local disk `<base>/latest` is a symlink
to the version just written (also ignored by Serving) for scripts that want
one fixed path.
"""

from __future__ import annotations

import os
import re

import keras
import tensorflow as tf
from absl import logging

from mwloop.artifacts import checkpoint, disk, export_rotation, files, serving_latency
from mwloop.errors import UserError
from mwloop.task import Task, TaskError

LATEST = export_rotation.LATEST


class ExportError(UserError):
    """An export that could not be written (disk full, permissions); the earlier versions are intact."""


def versions(base: str) -> list[int]:
    """The exported versions in `base` (integer-named directories holding a saved_model.pb), newest first."""
    if not tf.io.gfile.isdir(base):
        return []
    found = [int(name.rstrip("/")) for name in tf.io.gfile.listdir(base) if re.fullmatch(r"\d+/?", name)]
    return sorted((v for v in found if tf.io.gfile.exists(os.path.join(base, str(v), "saved_model.pb"))),
                  reverse=True)


def latest(base: str) -> str | None:
    """The newest version's directory in `base` (what TF Serving would serve), or None."""
    found = versions(base)
    return os.path.join(base, str(found[0])) if found else None


def export(model: keras.Model, task: Task, base: str, step: int, keep: int = 3,
           timings: dict[str, float] | None = None) -> str:
    """Writes `model`'s weights as the SavedModel `base/<step>` with `task.serving_endpoints`; returns it.

    Args:
      model: the trained model (any strategy).
      task: its task (the endpoints, and `build_model` for an undistributed copy).
      base: the directory TF Serving watches (e.g. workdir/export).
      step: the version (the training step); an existing `base/<step>` is replaced, whole or not at all.
      keep: how many versions to keep (the oldest written go, after the new one is in place; never one mwloop
        did not write); 0 keeps all.
      timings: when given, gets "latency_ms": the first endpoint's latency on a fixed batch
        (`serving_latency`), when its signature has one.
    Returns:
      The version's directory.
    Raises:
      ExportError: the write failed; `base`'s earlier versions are unchanged.
    """
    archive, endpoints = _archive(model, task)
    final = os.path.join(base, str(int(step)))
    tmp = os.path.join(base, f".tmp-{int(step)}-{os.getpid()}")
    try:
        tf.io.gfile.makedirs(base)
        if tf.io.gfile.exists(tmp):
            tf.io.gfile.rmtree(tmp)
        archive.write_out(tmp, verbose=False)
        mark = export_rotation.new_mark()
        export_rotation.stamp(tmp, mark)
    except (tf.errors.OpError, OSError) as e:
        _remove(tmp)
        kept = latest(base)
        raise ExportError(f"exporting step {step} to {base} failed ({disk.reason(e)}); "
                          f"{'the last good export ' + kept + ' is intact' if kept else 'no earlier export'}: "
                          f"{disk.remedy(e)}, then rerun with --mode=export") from None
    except BaseException:
        _remove(tmp)
        raise
    aside = _move_into_place(tmp, final)
    _point_latest(base, final)
    removed = export_rotation.record_and_rotate(base, export_rotation.Entry(int(step), mark), keep)
    if removed:
        logging.info("removed the oldest exports of %s: %s", base, ", ".join(map(str, removed)))
    odd = export_rotation.oddities(base, int(step))
    if odd or aside:
        logging.warning("%s", "; ".join(filter(None, [odd, aside])))
    # Measured once the export is in place: it never holds up or spoils the write.
    if timings is not None:
        function, input_signature = next(iter(endpoints.values()))
        latency = serving_latency.latency_ms(function, input_signature)
        if latency is not None:
            timings["latency_ms"] = latency
    return final


def _archive(model: keras.Model, task: Task) -> tuple[keras.export.ExportArchive, dict[str, tuple]]:
    """The export archive of `model` and its endpoints as served: name -> (traced function, input signature)."""
    # The trained weights go into a fresh, undistributed copy of the architecture (task.build_model() outside
    # any strategy scope), so the SavedModel holds plain variables whatever strategy trained them.
    clone = task.build_model()
    clone.set_weights(model.get_weights())
    endpoints = task.serving_endpoints(clone)
    if not endpoints:
        raise TaskError(f"task {type(task).__name__}: serving_endpoints returned none; return at least one, "
                        f"or set config.export=False")
    archive = keras.export.ExportArchive()
    archive.track(clone)
    # add_endpoint returns the traced function the SavedModel serves: what a latency is measured on.
    served = {name: (archive.add_endpoint(name, function, input_signature=input_signature), input_signature)
              for name, (function, input_signature) in endpoints.items()}
    return archive, served


def _move_into_place(tmp: str, final: str) -> str | None:
    """Renames the finished `tmp` to `final`. An existing `final` that mwloop wrote (a re-export of the step)
    is set aside first and removed only after the rename, so a crash in between leaves one whole copy under one
    of the names; one it did not write is renamed to `<step>.set-aside-<pid>` and kept (returns a line on it)."""
    base, name = os.path.dirname(final), os.path.basename(final)
    old = kept = None
    if tf.io.gfile.exists(final) or os.path.lexists(final):
        ours = any(e.version == int(name) and export_rotation.is_ours(base, e)
                   for e in export_rotation.read_manifest(base))
        if ours:
            old = f"{base}/.old-{name}-{os.getpid()}"
            _remove(old)
            tf.io.gfile.rename(final, old)
        else:
            kept = f"{base}/{name}.set-aside-{os.getpid()}"
            tf.io.gfile.rename(final, kept)  # a link is renamed, not followed
    tf.io.gfile.rename(tmp, final)
    if old:
        export_rotation.remove_tree(old)
    return f"{final} was not written by mwloop: kept as {kept}" if kept else None


def _point_latest(base: str, final: str) -> None:
    """`base/latest` -> the version just written (local disks only: object stores have no symlinks)."""
    if "://" in base:
        return
    link, tmp = os.path.join(base, LATEST), os.path.join(base, f".{LATEST}-{os.getpid()}")
    # Someone's own file or directory: never replaced.
    if os.path.lexists(link) and not os.path.islink(link):
        logging.warning("%s is not mwloop's link (a %s): left alone, so it does not point at %s; remove it to "
                        "have `latest` again", link, "directory" if os.path.isdir(link) else "file",
                        os.path.basename(final))
        return
    if os.path.lexists(tmp):
        os.remove(tmp)
    os.symlink(os.path.basename(final), tmp)  # relative: the workdir can move
    os.replace(tmp, link)


def _remove(path: str) -> None:
    if tf.io.gfile.exists(path):
        if tf.io.gfile.isdir(path):
            tf.io.gfile.rmtree(path)
        else:
            tf.io.gfile.remove(path)


def export_best(model: keras.Model, task: Task, workdir: str, keep: int) -> str | None:
    """The weights of `workdir`'s best checkpoint (files.BEST_CHECKPOINT) exported as
    `workdir/export_best/<its step>`; returns the version's directory (None, with a warning, when there is no
    best checkpoint). The model keeps those weights afterwards: call it last."""
    best = files.saved_checkpoints(os.path.join(workdir, files.BEST_CHECKPOINT), glob=tf.io.gfile.glob)
    if not best:
        logging.warning("no best checkpoint to export in %s", os.path.join(workdir, files.BEST_CHECKPOINT))
        return None
    found = checkpoint.first_readable(best, lambda path: checkpoint.read_into(path, model=model))
    if found is None:
        logging.warning("no readable best checkpoint to export in %s", os.path.join(workdir, files.BEST_CHECKPOINT))
        return None
    directory = export(model, task, os.path.join(workdir, files.EXPORT_BEST), files.checkpoint_step(found[0]),
                       keep=keep)
    logging.info("exported the best checkpoint (%s) to %s", os.path.basename(found[0]), directory)
    return directory
