"""A worker's scratch directories in TMPDIR: owned while used, swept when their owner is gone.

Every worker but the chief saves each checkpoint into a fresh temporary directory (saving runs collectives;
only the chief's copy is kept) and deletes it afterwards. A worker killed mid-save (SIGKILL, the OOM killer)
cannot delete it, so each directory holds a lock file its owner keeps `flock`ed while the directory is in
use; any later mwloop process of the same user sweeps the directories whose lock nobody holds. An older
mwloop's `mwloop-preemption-handler-*` directories (mwloop no longer makes them) are swept too.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator

OWNER = ".owner"
PREFIXES = ("mwloop-worker", "mwloop-preemption-handler-")
# A directory with files but no lock file (an older mwloop's) is left this long.
GRACE_S = 120.0
# A lock file nobody holds, or an empty directory without one, is left this long after it was made: its maker
# takes the lock right after creating it (and removes the directory right after the lock file).
LOCK_GRACE_S = 1.0


@contextlib.contextmanager
def owned_dir(prefix: str) -> Iterator[str]:
    """A fresh directory in TMPDIR (`<prefix>XXXX`), locked by this process while the block runs, then removed."""
    directory = tempfile.mkdtemp(prefix=prefix)
    try:
        with open(os.open(os.path.join(directory, OWNER), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                          0o600), "w") as owner:
            # Released when this process dies, however it dies.
            fcntl.flock(owner, fcntl.LOCK_EX)
            owner.write(f"pid {os.getpid()}\n")
            owner.flush()
            yield directory
    finally:
        _remove(directory)


def _remove(directory: str) -> None:
    """Removes `directory` with its lock file last: killed midway, what is left is still locked-or-swept (with
    the lock file gone first, a half-removed directory would look like one made a moment ago, left alone)."""
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            if entry.name != OWNER:
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(directory, OWNER))
    # An empty directory without its lock file (killed between these two calls) is swept by `_abandoned`.
    shutil.rmtree(directory, ignore_errors=True)


def _abandoned(directory: str) -> bool:
    """Whether `directory`'s owner is gone: its lock file can be locked, or it has none and is old."""
    try:
        fd = os.open(os.path.join(directory, OWNER), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        # Empty: its maker was killed between making it and its lock file (or after removing the lock file,
        # `_remove`): both are two calls apart, so a short grace suffices. Not empty: an older mwloop's.
        grace = LOCK_GRACE_S if not os.listdir(directory) else GRACE_S
        return time.time() - os.lstat(directory).st_mtime > grace
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return time.time() - os.fstat(fd).st_mtime > LOCK_GRACE_S
    except OSError:
        return False  # a live owner holds it
    finally:
        os.close(fd)


def sweep(root: str | None = None) -> list[str]:
    """Removes this user's abandoned mwloop scratch directories in `root` (default TMPDIR); returns them.
    Only real directories (no links) owned by this user are considered; errors leave a directory alone."""
    root = root or tempfile.gettempdir()
    removed = []
    for prefix in PREFIXES:
        for path in glob.glob(os.path.join(glob.escape(root), prefix + "*")):
            try:
                info = os.lstat(path)
                if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or not _abandoned(path):
                    continue
                shutil.rmtree(path)
                removed.append(path)
            except OSError:
                continue  # gone meanwhile, or not ours to remove
    return removed
