"""The on-disk format of one object of the disk tier: a header, the payload, and a commit record.

::

    header  (padded to a multiple of 4 KiB, so the payload starts page-aligned)
        "KVDISK01" | u16 format | u16 key length | u32 meta length | u64 payload size | u64 payload xxh3
        | u64 version | u64 generation | f64 expiry (wall clock, 0: none) | key bytes | meta bytes | zeros
    payload (payload size bytes), then zeros up to the 4 KiB block that ends with
    commit  "KVCOMMIT" | u64 payload size | u64 payload xxh3 | u64 header xxh3      (the file's last 32 bytes)

Every file is a whole number of 4 KiB blocks, so one ``O_DIRECT`` write puts it down with no ``ftruncate``.

A file is written under a temporary name (``O_DIRECT`` where the filesystem allows it, from a page-aligned
staging buffer laid out like the file), synced (``fdatasync``), then renamed into place and the directory
synced: a ``*.kv`` name means the write completed. Recovery reads only the header and the commit record
(never the payload); a file whose commit record is missing or does not match its header is deleted. The
payload's checksum is checked on every read, so a payload lost after the rename (a power cut on a device
that reorders writes) is never served either.
"""

from __future__ import annotations

import errno
import mmap
import os
import struct
from dataclasses import dataclass

import xxhash

MAGIC = b"KVDISK01"
COMMIT_MAGIC = b"KVCOMMIT"
FORMAT = 1
PAGE = 4096
_HEAD = struct.Struct("<8sHHIQQQQd")
_COMMIT = struct.Struct("<8sQQQ")
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
checksum_of = xxhash.xxh3_64_intdigest
_CHUNK = 64 << 20  # bytes per write call (a multiple of the page size, as O_DIRECT needs)


class RecordError(Exception):
    """A file that is not a complete, consistent object record (torn, truncated or foreign)."""


@dataclass(slots=True, frozen=True)
class Record:
    """What a header says (the payload is not read)."""

    key: str
    meta: bytes
    size: int
    checksum: int
    version: int
    generation: int
    payload_offset: int
    expires: float = 0.0  # time.time() after which the object is gone (0: never)

    @property
    def file_bytes(self) -> int:
        return _pages(self.payload_offset + self.size + _COMMIT.size)


def header_bytes(key: str, meta: bytes, size: int, checksum: int, version: int, generation: int,
                 expires: float = 0.0) -> bytes:
    kb = key.encode()
    head = _HEAD.pack(MAGIC, FORMAT, len(kb), len(meta), size, checksum, version, generation, expires) + kb + meta
    return head + bytes(-len(head) % PAGE)


def commit_bytes(header: bytes, size: int, checksum: int) -> bytes:
    return _COMMIT.pack(COMMIT_MAGIC, size, checksum, checksum_of(header))


def _pages(n: int) -> int:
    return n + (-n % PAGE)


def payload_offset(key: str, meta: bytes) -> int:
    return _pages(_HEAD.size + len(key.encode()) + len(meta))


def file_bytes(key: str, meta: bytes, size: int) -> int:
    """The bytes an object takes on disk (what the tier's capacity counts)."""
    return _pages(payload_offset(key, meta) + size + _COMMIT.size)


def stage(buf: mmap.mmap, key: str, meta: bytes, payload: memoryview) -> None:
    """Copy ``payload`` into ``buf`` (page-aligned, at least ``file_bytes`` long) where the file holds it;
    ``write_record`` fills in the header and the commit record."""
    offset = payload_offset(key, meta)
    with memoryview(buf) as view:
        view[offset:offset + len(payload)] = payload


def write_record(path: str, buf: mmap.mmap, key: str, meta: bytes, size: int, version: int,
                 generation: int, expires: float = 0.0) -> int:
    """Write the object staged in ``buf`` (by ``stage``) to ``path`` and sync it; returns the payload's
    checksum. ``O_DIRECT`` when the filesystem takes it (measured faster for large writes here: no copy
    into the page cache, and the cache keeps no second copy of what memory just evicted), buffered
    otherwise. An OSError (ENOSPC, EFBIG, EIO) leaves no file behind."""
    offset, total = payload_offset(key, meta), file_bytes(key, meta, size)
    with memoryview(buf) as view:
        checksum = checksum_of(view[offset:offset + size])
        header = header_bytes(key, meta, size, checksum, version, generation, expires)
        view[:offset] = header
        view[offset + size:total - _COMMIT.size] = bytes(total - _COMMIT.size - offset - size)
        view[total - _COMMIT.size:total] = commit_bytes(header, size, checksum)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_DIRECT, 0o600)
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: this filesystem takes no O_DIRECT (tmpfs on old kernels)
                raise
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            _write_all(fd, view[:total])
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # memory is the cache: keep no second copy
        except BaseException:
            os.close(fd)
            _unlink_quietly(path)
            raise
    os.close(fd)
    return checksum


def _write_all(fd: int, view: memoryview) -> None:
    done = 0
    while done < len(view):
        n = os.write(fd, view[done:done + _CHUNK])
        if n <= 0:
            raise OSError(errno.EIO, "write made no progress")
        done += n


def read_record(path: str) -> Record:
    """Parse the header and the commit record of ``path``; RecordError if they are not consistent."""
    with open(path, "rb", buffering=0) as f:
        st_size = os.fstat(f.fileno()).st_size
        first = f.read(PAGE)
        if len(first) < _HEAD.size:
            raise RecordError(f"{path}: {len(first)} bytes, shorter than a header")
        magic, fmt, klen, mlen, size, checksum, version, gen, expires = _HEAD.unpack_from(first)
        if magic != MAGIC or fmt != FORMAT:
            raise RecordError(f"{path}: not a kvstore disk record (magic {magic!r}, format {fmt})")
        head_len = _HEAD.size + klen + mlen
        padded = head_len + (-head_len % PAGE)
        if _pages(padded + size + _COMMIT.size) != st_size:
            raise RecordError(f"{path}: {st_size} bytes, the header promises {_pages(padded + size + _COMMIT.size)}")
        header = first if padded <= len(first) else first + f.read(padded - len(first))
        f.seek(st_size - _COMMIT.size)
        cmagic, csize, cchecksum, hchecksum = _COMMIT.unpack(f.read(_COMMIT.size))
    if cmagic != COMMIT_MAGIC or csize != size or cchecksum != checksum or hchecksum != checksum_of(header[:padded]):
        raise RecordError(f"{path}: commit record missing or not matching the header (torn write)")
    try:
        key = bytes(header[_HEAD.size:_HEAD.size + klen]).decode()
    except UnicodeDecodeError:
        raise RecordError(f"{path}: key is not UTF-8") from None
    meta = bytes(header[_HEAD.size + klen:head_len])
    return Record(key, meta, size, checksum, version, gen, padded, expires)


def open_record(path: str) -> tuple[int, bool]:
    """Open a record for reading: ``O_DIRECT`` where the filesystem takes it (measured faster here for
    objects of 1-64 MiB than buffered reads, whose read-ahead ramps up per file). Returns (fd, direct)."""
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT), True
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC), False


def read_payload(fd: int, record: Record, dst: memoryview, bounce: memoryview | None) -> None:
    """Read the payload into ``dst`` (``record.size`` bytes) and check its checksum; OSError on an I/O
    error, RecordError when the bytes are short or do not match. ``bounce``: a page-aligned buffer (a
    multiple of 4 KiB) that O_DIRECT reads land in before the copy into ``dst``, which need not be aligned;
    None reads straight into ``dst`` (buffered)."""
    size, got = record.size, 0
    while got < size:
        if bounce is None:
            n = os.preadv(fd, [dst[got:size]], record.payload_offset + got)
        else:
            n = os.preadv(fd, [bounce[:min(len(bounce), _pages(size - got))]], record.payload_offset + got)
            n = min(n, size - got)
            dst[got:got + n] = bounce[:n]
        if n <= 0:
            raise RecordError(f"payload of {record.key!r} ends after {got} of {size} bytes")
        got += n
    if bounce is None:
        os.posix_fadvise(fd, record.payload_offset, size, os.POSIX_FADV_DONTNEED)
    if checksum_of(dst[:size]) != record.checksum:
        raise RecordError(f"payload of {record.key!r} does not match its checksum (corrupted on disk)")


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
