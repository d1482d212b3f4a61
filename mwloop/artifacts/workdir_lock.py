"""One run per workdir, and a workdir no one else can plant files in.

The chief holds an exclusive lock on DIR/.lock while it runs. The lock is an OS
file lock (fcntl), so it dies with its process: a lock left by a crashed or
killed run is simply taken over by the next one.

Files in the workdir are not trusted (SECURITY.md): before anything is written
the run checks that the workdir and the folders mwloop writes into are owned
by this user (or root) and not writable by every user (so nobody else can plant a file in
them later), and that none of the files mwloop writes is a symlink or a hard
link to somewhere else; otherwise it refuses in one line. The lock itself is
opened with O_NOFOLLOW.

Remote workdirs (`gs://...`, any `scheme://`): TensorFlow's file systems
(tf.io.gfile) hold them; there is no local lock to take. `check_remote` turns
an unknown scheme or an unreachable bucket into one line, and nothing is
created locally (no stray `gs:` directory).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat

from mwloop.artifacts import files
from mwloop.errors import UserError

LOCK = ".lock"
# What mwloop writes in a workdir: files directly in it, and folders it writes files into.
FILES = (LOCK, files.CONFIG, files.CONFIG + ".tmp", files.METRICS, files.METRICS + ".tmp", "TRAINER_DONE")
FOLDERS = (files.CHECKPOINTS, files.BEST_CHECKPOINT, files.SUMMARIES, files.EXPORT, files.EXPORT_BEST)


class WorkdirBusyError(UserError):
    """Another live run holds the workdir."""


class UntrustedWorkdirError(UserError):
    """A workdir (or a file in it) that another user could have planted or can still change."""


def is_remote(workdir: str) -> bool:
    return "://" in workdir


def make(workdir: str) -> None:
    """Creates `workdir`, or raises a one-line UserError saying why it cannot be."""
    if is_remote(workdir):
        check_remote(workdir)
        return
    try:
        os.makedirs(workdir, exist_ok=True)
    # A file in the way, no permission, a read-only file system.
    except OSError as e:
        raise UserError(f"--workdir={workdir} cannot be created ({e.strerror}); pick another --workdir") from None


def check_remote(workdir: str) -> None:
    """A `scheme://` workdir that TensorFlow's file systems can reach, or a one-line UserError naming the cause."""
    # Imported here: the lock itself needs no TensorFlow.
    import tensorflow as tf
    try:
        tf.io.gfile.makedirs(workdir)
    except tf.errors.UnimplementedError:
        scheme = workdir.split("://", 1)[0]
        raise UserError(f"--workdir={workdir}: TensorFlow has no file system for {scheme}:// here; use a local "
                        f"directory or gs:// (mounted file systems work as local paths)") from None
    except (tf.errors.OpError, OSError) as e:
        text = (getattr(e, "message", None) or str(e)).splitlines()
        raise UserError(f"--workdir={workdir} cannot be reached ({(text[0] if text else type(e).__name__)[:160]}); "
                        f"check the network and credentials, or use a local --workdir") from None


def check_trusted(workdir: str) -> None:
    """Refuses (UntrustedWorkdirError) a local workdir another user could plant files in, or whose files mwloop
    writes are symlinks or hard links."""
    uid = os.geteuid()
    for path in (workdir, *(os.path.join(workdir, f) for f in FOLDERS)):
        try:
            # stat, not lstat: the workdir itself may be a symlink the user chose; its target must be ours.
            info = os.stat(path)
        except FileNotFoundError:
            continue
        # A file in the way: the write fails later with its own message.
        if not stat.S_ISDIR(info.st_mode):
            continue
        # Root could do anything anyway: a root-owned folder is trusted.
        if info.st_uid not in (uid, 0):
            raise UntrustedWorkdirError(
                f"{path} belongs to uid {info.st_uid}, not to this user (uid {uid}): its owner can plant files in "
                f"it that this run would write through; use a --workdir of your own")
        if info.st_mode & stat.S_IWOTH and not info.st_mode & stat.S_ISVTX:
            raise UntrustedWorkdirError(
                f"{path} is writable by every user (mode {stat.S_IMODE(info.st_mode):o}): anyone can plant files "
                f"in it; chmod o-w {path} or use another --workdir")
    for name in FILES + FOLDERS:
        path = os.path.join(workdir, name)
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(info.st_mode):
            raise UntrustedWorkdirError(
                f"{path} is a symlink (to {os.readlink(path)}); mwloop does not write through links in a "
                f"workdir: remove it, or use another --workdir")
        if stat.S_ISREG(info.st_mode) and (info.st_uid not in (uid, 0) or info.st_nlink > 1):
            why = f"belongs to uid {info.st_uid}" if info.st_uid not in (uid, 0) else f"has {info.st_nlink} hard links"
            raise UntrustedWorkdirError(f"{path} {why}: mwloop would write into a file shared with others; remove "
                                        f"it, or use another --workdir")


def acquire(workdir: str):
    """Takes the workdir's lock or raises WorkdirBusyError naming the holder; keep the returned file open.

    A remote workdir has no lock (returns None): one run at a time is then the user's (or scheduler's) care.
    """
    make(workdir)
    if is_remote(workdir):
        return None
    check_trusted(workdir)
    path = os.path.join(workdir, LOCK)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UntrustedWorkdirError(f"{path} is a symlink; remove it, or use another --workdir") from None
        raise UserError(f"cannot open the workdir lock {path} ({e.strerror}); make --workdir={workdir} writable, "
                        f"or use another --workdir") from None
    # Unbuffered: a write that failed leaves nothing for close() to flush.
    handle = os.fdopen(fd, "rb+", buffering=0)
    try:
        fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read(200).decode(errors="replace").strip() or "another process"
        handle.close()
        raise WorkdirBusyError(
            f"workdir {workdir} is in use by a live run ({holder}); wait for it, stop it, or use another --workdir"
        ) from None
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
    # A full disk: the lock is held all the same (the holder's name is only informative).
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            handle.close()
            raise UserError(f"cannot write the workdir lock {path} ({e.strerror}); make --workdir={workdir} "
                            f"writable, or use another --workdir") from None
    return handle


def is_held(workdir: str) -> bool:
    """Whether a live process holds the workdir's lock (asked without taking it: F_GETLK). False for a remote
    workdir or one never locked."""
    path = os.path.join(workdir, LOCK)
    if is_remote(workdir):
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        import struct
        # struct flock on Linux: short l_type, short l_whence, off_t l_start, off_t l_len, pid_t l_pid.
        query = struct.pack("hhqqi", fcntl.F_WRLCK, 0, 0, 0, 0)
        answer = fcntl.fcntl(fd, fcntl.F_GETLK, query + b"\0" * 4)
        return struct.unpack("hhqqi", answer[:struct.calcsize("hhqqi")])[0] != fcntl.F_UNLCK
    except OSError:
        return False
    finally:
        os.close(fd)


class WorkdirLostError(UserError):
    """The workdir (or its lock) vanished or changed hands while the run held it: it stops, saving nothing."""


def lost(workdir: str, handle) -> str | None:
    """Why the local `workdir` is no longer this run's (removed, or locked anew by another run), or None.

    `handle` is what `acquire` returned (None: remote, or not the chief: nothing to check). The lock file this
    run holds open cannot be freed, so a lock at the same path with another inode is another run's (a second
    run started after an `rm -rf`), and no lock at all is a removed workdir. Two system calls: cheap enough
    before every write.
    """
    if handle is None:
        return None
    path = os.path.join(workdir, LOCK)
    try:
        mine = os.fstat(handle.fileno())
        now = os.lstat(path)
    except FileNotFoundError:
        return f"the workdir {workdir} (or its lock {LOCK}) was removed while this run trained"
    # ValueError: the handle was closed.
    except (OSError, ValueError) as e:
        return f"the workdir {workdir}'s lock cannot be checked ({getattr(e, 'strerror', None) or e})"
    if (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino) or mine.st_nlink == 0:
        try:
            with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as f:
                holder = f.read(200).decode(errors="replace").strip() or "another run"
        except OSError:
            holder = "another run"
        return f"the workdir {workdir} changed hands while this run trained (its lock is now {holder}'s)"
    return None


def stop_if_lost(workdir: str, handle, doing: str) -> None:
    """Raises WorkdirLostError (one line) when `lost` says the workdir is no longer this run's."""
    if (why := lost(workdir, handle)) is not None:
        raise WorkdirLostError(f"{why}; stopping without {doing} (nothing is written into a workdir this run no "
                               f"longer owns): give each run a workdir of its own")


class WorkdirGuard:
    """A run's hold on its workdir: the chief takes the lock when the run starts (`acquire`), every write first
    asks whether the workdir is still the run's (`why_lost`, `stop_if_lost`), and `release` lets it go.
    Other workers hold nothing and never find it lost (the chief's answer reaches them by broadcast)."""

    def __init__(self, workdir: str, *, chief: bool):
        self.workdir, self.chief = workdir, chief
        self._handle = None
        if chief:
            # A file in the way is a one-line error, before the run's writer needs the directory.
            make(workdir)

    def acquire(self) -> None:
        """Takes the lock (the chief; WorkdirBusyError naming the holder of a live run's)."""
        if self.chief:
            self._handle = acquire(self.workdir)

    def release(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def why_lost(self) -> str | None:
        """Why the workdir is no longer this run's (removed, or locked anew by another run), or None."""
        return lost(self.workdir, self._handle)

    def stop_if_lost(self, doing: str) -> None:
        """WorkdirLostError naming `doing` when the workdir is no longer this run's."""
        stop_if_lost(self.workdir, self._handle, doing)
