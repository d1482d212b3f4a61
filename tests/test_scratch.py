"""Nothing of a run outlives it in TMPDIR (issue 31, item 8): a worker's save directory is locked while used and
swept by a later process once its owner is gone; no `mwloop-preemption-handler-*` directory is made."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from mwloop.artifacts import scratch


def test_an_owned_dir_is_removed_after_use_and_kept_while_its_owner_lives(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)  # TMPDIR is read again
    with scratch.owned_dir("mwloop-worker1-") as directory:
        assert os.path.dirname(directory) == str(tmp_path)
        os.utime(os.path.join(directory, scratch.OWNER), (0, 0))  # old, but locked by this process
        assert scratch.sweep(str(tmp_path)) == []
    assert os.listdir(tmp_path) == []


def test_a_killed_owners_dir_is_swept_and_others_are_left(tmp_path):
    # A process that makes an owned dir and is killed mid-use (SIGKILL: no cleanup of its own).
    code = ("import os, sys, time; from mwloop.artifacts import scratch\n"
            "with scratch.owned_dir('mwloop-worker1-') as d:\n    print(d, flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, TMPDIR=str(tmp_path)), cwd=os.path.dirname(os.path.dirname(__file__)))
    left = proc.stdout.readline().strip()
    proc.kill()
    proc.wait()
    old = time.time() - 3600
    os.utime(os.path.join(left, scratch.OWNER), (old, old))
    handler = tmp_path / "mwloop-preemption-handler-abc"  # an older mwloop's, empty and old
    handler.mkdir()
    os.utime(handler, (old, old))
    fresh = tmp_path / "mwloop-worker2-new"  # made a moment ago, its lock not taken yet: left
    fresh.mkdir()
    half_made = tmp_path / "mwloop-worker4-abc"  # its maker killed before it made the lock file (or after removing it)
    half_made.mkdir()
    os.utime(half_made, (time.time() - 5, time.time() - 5))
    older = tmp_path / "mwloop-worker5-abc"  # files but no lock file: an older mwloop's, perhaps still writing
    older.mkdir()
    (older / "checkpoint").write_text("")
    os.utime(older, (time.time() - 5, time.time() - 5))
    other = tmp_path / "mwloop-worker3-link"
    other.symlink_to(tmp_path / "elsewhere")
    assert sorted(scratch.sweep(str(tmp_path))) == sorted([left, str(handler), str(half_made)])
    assert sorted(os.listdir(tmp_path)) == ["mwloop-worker2-new", "mwloop-worker3-link", "mwloop-worker5-abc"]


def test_an_owned_dir_removes_its_lock_file_last(tmp_path, monkeypatch):
    """Killed while its directory is removed, a worker leaves either a locked-or-sweepable directory or nothing."""
    removed = []
    real_unlink = os.unlink
    monkeypatch.setattr(os, "unlink", lambda path, *a, **k: (removed.append(os.path.basename(path)),
                                                              real_unlink(path, *a, **k))[1])
    with scratch.owned_dir(str(tmp_path / "mwloop-worker1-")) as directory:
        for name in ("checkpoint", "ckpt-1.index", "ckpt-1.data-00000-of-00001"):
            open(os.path.join(directory, name), "w").close()
    assert removed[-1] == scratch.OWNER and len(removed) == 4
    assert os.listdir(tmp_path) == []

