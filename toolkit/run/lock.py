"""The one owner of a run folder: a lock on its LOCK_FILE, which the kernel drops when the owner dies.

RunDir.claim takes it for a launch's main process and tests it for the other ranks; it is held until
RunDir.release, or the process's death, so a killed run leaves no stale lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import struct
import time
from pathlib import Path

from toolkit.config.errors import UserError
from toolkit.run.writes import writing

LOCK_FILE = ".run.lock"  # the owner's lock; neither the run's entry nor a foreign one


def in_use(root: Path, holder: dict) -> str:
    who = f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, started {holder.get('started', '?')}"
    return f"output_dir={root} is in use by another run ({who}); wait for it or choose another output_dir"


# struct flock on Linux LP64: l_type, l_whence, l_start, l_len, l_pid (and padding)
_FLOCK = "hhqqi4x"
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS}


class OwnerLock:
    """The lock file of a run folder, locked by its owner (see RunDir.claim)."""

    def __init__(self, fd: int | None, path: Path, made: list[Path]):
        self.fd, self.path, self.made = fd, path, made

    @classmethod
    def take(cls, root: Path, launch: str) -> OwnerLock:
        made = [p for p in (root, *root.parents) if not p.exists()]  # deepest first, removed if left empty
        root.mkdir(parents=True, exist_ok=True)
        path = root / LOCK_FILE
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack(_FLOCK, fcntl.F_WRLCK, 0, 0, 0, 0))
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EAGAIN, errno.EACCES):  # the owner may not have written its record yet
                    raise UserError(in_use(root, cls.holder(root) or {})) from None
                if exc.errno in _NO_LOCKS:  # a filesystem without locks: no owner can be kept
                    return cls(None, path, made)
                raise
            # the previous owner deletes the file as it releases it: lock the file that is there now
            if _same_file(fd, path):
                break
            os.close(fd)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "launch": launch}
        with writing("run lock"):  # a full disk: one line (toolkit.run.writes.WRITERS), exit 2
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode(), 0)
        return cls(fd, path, made)

    @staticmethod
    def holder(root: Path, wait_s: float = 5.0) -> dict | None:
        """Who holds the folder's lock (its record), or None when nobody does."""
        path = root / LOCK_FILE
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                return None
            try:
                probe = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, struct.pack(_FLOCK, fcntl.F_WRLCK, 0, 0, 0, 0))
                if struct.unpack(_FLOCK, probe)[0] == fcntl.F_UNLCK:
                    return None
                record = _record(fd)
            except OSError as exc:
                if exc.errno in _NO_LOCKS:
                    return None
                raise
            finally:
                os.close(fd)
            # the owner writes its record right after locking: an empty one is being written
            if record or time.monotonic() > deadline:
                return record
            time.sleep(0.05)

    def release(self) -> None:
        if self.fd is None:
            return
        # deleted while still locked, so that no one takes the lock of a file that is gone
        self.path.unlink(missing_ok=True)
        os.close(self.fd)
        self.fd = None
        with contextlib.suppress(OSError):  # not empty: the run wrote there, keep it
            for folder in self.made:
                folder.rmdir()


HELD: dict[Path, OwnerLock] = {}


@contextlib.contextmanager
def one_writer(path: Path, take: bool = True):
    """Wait for, and hold, an exclusive lock on the file `path` (made if missing): one writer at a time of an entry of
    a cache that several runs share (data.cache_dir, ~/.cache/llm-toolkit by default), so that two runs started at
    once do not write into one temporary folder (the second crashed with `Directory not empty`, leaving it). The
    kernel drops the lock with its process. `take=False` (the other ranks of a run) holds nothing; so does a file
    system without locks."""
    if not take:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in _NO_LOCKS:
                raise
            yield
            return
        if _same_file(fd, path):  # not the file a writer before deleted as it released it
            break
        os.close(fd)
    try:
        yield
    finally:  # deleted while still locked, as OwnerLock.release does: the cache keeps no lock files
        path.unlink(missing_ok=True)
        os.close(fd)


def _record(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (ValueError, OSError):
        return {}


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False
