"""The disk tier's directory: the lock that gives it to one process, directory syncs, and the recovery scan
(headers and commit records only, see ``kvstore.memory.disk_file``)."""

from __future__ import annotations

import fcntl
import logging
import os
import re
import time

from kvstore.errors import DiskPathError
from kvstore.memory.disk_file import SUFFIX, TMP_SUFFIX, Record, RecordError, read_record

log = logging.getLogger("kvstore.memory.disk")
LOCK_NAME = ".kvstore-disk.lock"
#: the names the tier gives its files (``DiskObject.name``: a hash of the key and a generation), and their
#: temporary names while written. Only files named so are the tier's: the directory may hold anything else (a
#: user's own files), which recovery never reads, deletes or counts.
_RECORD_NAME = re.compile(r"[0-9a-f]{32}-[0-9a-f]{16}" + re.escape(SUFFIX))
_TMP_NAME = re.compile(r"\.[0-9a-f]{32}-[0-9a-f]{16}" + re.escape(SUFFIX + TMP_SUFFIX))


def scan(path: str) -> tuple[list[Record], int]:
    """The complete records in ``path``, least recently written first, and how many torn or partial files
    were deleted (temporary files of interrupted writes, records whose commit record does not match).
    Expired records and older copies of a key are deleted too. Files not named as the tier names its own are
    left alone."""
    found: dict[str, tuple[Record, str, float]] = {}
    dropped = foreign = 0
    now = time.time()
    for entry in os.scandir(path):
        if _TMP_NAME.fullmatch(entry.name):  # a write that never completed
            os.unlink(entry.path)
            dropped += 1
        elif _RECORD_NAME.fullmatch(entry.name):
            dropped += _scan_one(entry, found, now)
        elif entry.name != LOCK_NAME:
            foreign += 1
    if foreign:
        log.info("disk tier %s: %d files not written by the tier are left alone", path, foreign)
    return [r for r, _, _ in sorted(found.values(), key=lambda f: f[2])], dropped


def _scan_one(entry: os.DirEntry[str], found: dict[str, tuple[Record, str, float]], now: float) -> int:
    try:
        record = read_record(entry.path)
    except (RecordError, OSError) as exc:
        log.warning("disk tier: dropping %s: %s", entry.name, exc)
        os.unlink(entry.path)
        return 1
    old = found.get(record.key)
    if (old is not None and old[0].generation > record.generation) or 0 < record.expires <= now:
        os.unlink(entry.path)  # an older copy whose replacement completed, or past its TTL
        return 0
    if old is not None:
        os.unlink(os.path.join(os.path.dirname(entry.path), old[1]))
    found[record.key] = (record, entry.name, entry.stat().st_mtime)
    return 0


def lock_directory(path: str) -> int:
    if not os.path.isdir(path):
        raise DiskPathError(f"disk path {path} {'is not a directory' if os.path.exists(path) else 'does not exist'}")
    lock_path = os.path.join(path, LOCK_NAME)
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise DiskPathError(f"disk path {path} is not writable: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise DiskPathError(f"disk path {path} is in use by another kvstore process (pid {holder})") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as exc:
        os.close(fd)
        raise DiskPathError(f"disk path {path} is not writable: {exc.strerror}") from None
    return fd


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
