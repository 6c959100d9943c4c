"""ShmIndex: the daemon's object index, published read-only in shared memory for same-host clients.

It lets a same-host ``get_into`` skip the round trip: the client hashes the key, probes this table, copies
the object's bytes out of the mapped segment, then re-checks the slot's sequence number; if the daemon
changed the slot (replace, evict, remove, expiry) while the copy ran, the copy is discarded and retried
(seqlock). Segments stay mapped, so a stale read can only retry, never crash. The daemon is the only
writer; the index is an accelerator, never the truth: a miss or an unindexed object falls back to RPC.

The daemon's life shows in the header: a generation (random per daemon start), an alive word (cleared at a
clean stop) and a heartbeat (CLOCK_MONOTONIC ns, renewed every housekeeping round). A reader of another
generation, of a stopped daemon or of one whose heartbeat is stale falls back to RPC, which fails the way every
other call does; the client also checks its control connection (a SIGKILLed daemon's socket reads EOF).

Stop marks (a cluster member's, ``IndexWriter.stopped``/``checked``): two counters in the header, ``stops``
(bumped the moment the daemon learns it was stopped or stalled: its SIGCONT handler, a gap in its loop) and
``checked`` (the ``stops`` value as of the start of its last finished re-check of its entries against the
directory). While they differ the daemon may still show copies the directory no longer holds, so a gated read
(``read_into(..., gate=...)``) copies only while they are equal, and unchanged across the copy, and while the
gate (the daemon's process not stopped: ``kvstore.memory.procstate``) says so after the copy.

Layout: a 64-byte header (magic, layout, slots, table seq, generation, heartbeat, alive, stops, checked), then ``slots``
slots of 96 bytes, open addressing with linear probing on the
xxh3-128 of the key. Slot fields: seq (odd while being written), h1, h2, version, segment, state, offset,
size, expires (CLOCK_MONOTONIC seconds, 0 = never), checksum, atime (written by readers), padding.
Ordering relies on x86-64 TSO (stores and loads are not reordered with each other).
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from typing import Any

import xxhash

MAGIC = 0x4B5653544F524931  # "KVSTORI1"
LAYOUT = 2
HEADER = struct.Struct("<QIIQQQQ16x")
LIFE = struct.Struct("<QQQ")  # generation, heartbeat ns, alive: after the table seq
_LIFE_OFFSET = 24
MARKS = struct.Struct("<QQ")  # stops, checked: in what was the header's padding (zero: never stopped)
_MARKS_OFFSET = 48
_STOPS = struct.Struct("<Q")
SLOT = struct.Struct("<QQQQIIQQdQQ16x")
SEQ = struct.Struct("<Q")
BODY = struct.Struct("<QQQIIQQdQ")  # h1 .. checksum, after seq
ATIME = struct.Struct("<Q")
_ATIME_OFFSET = 8 + BODY.size
EMPTY, LIVE, TOMBSTONE = 0, 1, 2
MAX_LOAD = 0.5
REBUILD_LOAD = 0.75


def key_hash(key: str) -> tuple[int, int]:
    digest = xxhash.xxh3_128_intdigest(key.encode("utf-8"))
    return digest >> 64, digest & 0xFFFFFFFFFFFFFFFF


def table_bytes(slots: int) -> int:
    return HEADER.size + slots * SLOT.size


def slots_for_capacity(capacity: int) -> int:
    """Two slots per 64 KiB of capacity, between 4096 and 1 Mi slots (a power of two)."""
    want = max(4096, min(1 << 20, 2 * capacity // (64 << 10)))
    return 1 << (want - 1).bit_length()


class IndexWriter:
    """Daemon side. ``buf`` is the writable view of the index mapping."""

    def __init__(self, buf: memoryview, slots: int, generation: int = 1):
        if slots & (slots - 1):
            raise ValueError(f"slot count must be a power of two, got {slots}")
        self.buf, self.slots, self.mask = buf, slots, slots - 1
        self._where: dict[tuple[int, int], int] = {}
        self._state = bytearray(slots)
        self._tombstones = 0
        self._table_seq = 0
        self.generation = generation
        buf[:table_bytes(slots)] = bytes(table_bytes(slots))
        HEADER.pack_into(buf, 0, MAGIC, LAYOUT, slots, 0, generation, time.monotonic_ns(), 1)

    def beat(self) -> None:
        """The daemon is alive: renew the heartbeat readers check."""
        LIFE.pack_into(self.buf, _LIFE_OFFSET, self.generation, time.monotonic_ns(), 1)

    def stop(self) -> None:
        """The daemon is stopping: readers that still map the index stop trusting it."""
        LIFE.pack_into(self.buf, _LIFE_OFFSET, self.generation, 0, 0)

    def stopped(self) -> int:
        """The daemon was stopped or stalled: gated readers stop reading until ``checked`` catches up. Returns
        the new stop count. Safe in a signal handler (one store); a bump lost to a handler that ran between the
        load and the store still leaves the count above ``checked``."""
        stops: int = _STOPS.unpack_from(self.buf, _MARKS_OFFSET)[0] + 1
        _STOPS.pack_into(self.buf, _MARKS_OFFSET, stops)
        return stops

    def stops(self) -> int:
        stops: int = _STOPS.unpack_from(self.buf, _MARKS_OFFSET)[0]
        return stops

    def checked(self, stops: int) -> None:
        """A re-check of every entry against the directory that began when the stop count was ``stops``
        finished: gated readers read again once no stop came after it. Never moves back."""
        if stops > _STOPS.unpack_from(self.buf, _MARKS_OFFSET + 8)[0]:
            _STOPS.pack_into(self.buf, _MARKS_OFFSET + 8, stops)

    def publish(self, key: str, version: int, segment: int, offset: int, size: int,
                expires: float | None, checksum: int | None) -> bool:
        """Show ``key`` at this version; returns False when the table is too full to take it."""
        h = key_hash(key)
        idx = self._where.get(h)
        if idx is None:
            if len(self._where) + 1 > MAX_LOAD * self.slots:
                return False
            if len(self._where) + self._tombstones + 1 > REBUILD_LOAD * self.slots:
                self._rebuild()
            idx = self._free_slot(h[0])
            if self._state[idx] == TOMBSTONE:
                self._tombstones -= 1
            self._where[h] = idx
            self._state[idx] = LIVE
        self._write(idx, h, version, segment, LIVE, offset, size, expires or 0.0, checksum or 0)
        return True

    def unpublish(self, key: str, version: int) -> None:
        h = key_hash(key)
        idx = self._where.get(h)
        if idx is None or self._version(idx) != version:
            return
        del self._where[h]
        self._state[idx] = TOMBSTONE
        self._tombstones += 1
        self._write(idx, h, 0, 0, TOMBSTONE, 0, 0, 0.0, 0)

    def atime(self, key: str) -> int:
        """Last read stamp (CLOCK_MONOTONIC ns) a client wrote for ``key``; 0 if none."""
        idx = self._where.get(key_hash(key))
        return 0 if idx is None else ATIME.unpack_from(self.buf, HEADER.size + idx * SLOT.size + _ATIME_OFFSET)[0]

    def _version(self, idx: int) -> int:
        version: int = SLOT.unpack_from(self.buf, HEADER.size + idx * SLOT.size)[3]
        return version

    def _free_slot(self, h1: int) -> int:
        idx = h1 & self.mask
        while self._state[idx] == LIVE:
            idx = (idx + 1) & self.mask
        return idx

    def _write(self, idx: int, h: tuple[int, int], version: int, segment: int, state: int, offset: int,
               size: int, expires: float, checksum: int) -> None:
        base = HEADER.size + idx * SLOT.size
        seq = SEQ.unpack_from(self.buf, base)[0]
        SEQ.pack_into(self.buf, base, seq + 1)  # odd: readers back off
        BODY.pack_into(self.buf, base + 8, h[0], h[1], version, segment, state, offset, size, expires, checksum)
        SEQ.pack_into(self.buf, base, seq + 2)

    def _rebuild(self) -> None:
        """Drop tombstones: re-place every live slot. Readers see an odd table seq meanwhile and fall back."""
        self._set_table_seq(self._table_seq + 1)
        live = []
        for h, idx in self._where.items():
            base = HEADER.size + idx * SLOT.size
            live.append((h, SLOT.unpack_from(self.buf, base)))
        seqs = [SEQ.unpack_from(self.buf, HEADER.size + i * SLOT.size)[0] for i in range(self.slots)]
        self.buf[HEADER.size:table_bytes(self.slots)] = bytes(self.slots * SLOT.size)
        for i, seq in enumerate(seqs):  # keep sequence numbers monotonic per slot
            SEQ.pack_into(self.buf, HEADER.size + i * SLOT.size, seq + 2 + (seq & 1))
        self._state = bytearray(self.slots)
        self._where.clear()
        self._tombstones = 0
        for h, s in live:
            idx = self._free_slot(h[0])
            self._where[h] = idx
            self._state[idx] = LIVE
            self._write(idx, h, s[3], s[4], LIVE, s[6], s[7], s[8], s[9])
        self._set_table_seq(self._table_seq + 1)

    def _set_table_seq(self, seq: int) -> None:
        self._table_seq = seq
        SEQ.pack_into(self.buf, 16, seq)


class IndexReader:
    """Client side: find a key and copy its bytes without asking the daemon.

    ``region(segment, offset, size)`` returns a memoryview of the mapped segment."""

    MAX_PROBES = 64
    MAX_RETRIES = 8

    def __init__(self, buf: memoryview, region: Callable[[int, int, int], memoryview], generation: int | None = None,
                 stale_after: float = 30.0):
        """``generation``: the daemon's, as its hello said (None: whatever the index shows now);
        ``stale_after``: seconds without a daemon heartbeat after which the index is not trusted."""
        magic, layout, slots, _seq, gen, _beat, _alive = HEADER.unpack_from(buf, 0)
        if magic != MAGIC or layout != LAYOUT:
            raise ValueError("not a kvstore index mapping (or one of another layout)")
        self.buf, self.slots, self.mask, self._region = buf, slots, slots - 1, region
        self.generation = gen if generation is None else generation
        self._stale_ns = int(stale_after * 1e9)

    def trusted(self) -> bool:
        """Whether the daemon that writes this index is the expected one, alive, and heart-beating."""
        generation, beat, alive = LIFE.unpack_from(self.buf, _LIFE_OFFSET)
        return bool(alive == 1 and generation == self.generation and time.monotonic_ns() - beat <= self._stale_ns)

    def marks(self) -> tuple[int, int]:
        """(stops, checked): see the module's docstring."""
        stops, checked = MARKS.unpack_from(self.buf, _MARKS_OFFSET)
        return stops, checked

    def find(self, key: str) -> tuple[int, tuple[Any, ...]] | None:
        """(slot base, slot fields) of the key's live slot as seen now, or None."""
        h1, h2 = key_hash(key)
        idx = h1 & self.mask
        for _ in range(self.MAX_PROBES):
            base = HEADER.size + idx * SLOT.size
            seq = SEQ.unpack_from(self.buf, base)[0]  # read apart from the body, so it is loaded first
            slot = SLOT.unpack_from(self.buf, base)
            if slot[0] != seq:
                continue  # written meanwhile; probe this slot again
            state = slot[5]
            if state == EMPTY and not slot[0] & 1:
                return None
            if state == LIVE and slot[1] == h1 and slot[2] == h2:
                return base, slot
            idx = (idx + 1) & self.mask
        return None

    def read_into(self, key: str, out: Callable[[int], memoryview], only: int | None = None,
                  gate: Callable[[], bool] | None = None) -> tuple[int, int, int] | None:
        """Copy the object into ``out(size)``'s view; return (size, version, checksum) or None to fall back.

        ``out`` is called with the object's size and returns a writable byte view (it may raise, e.g.
        BufferTooSmallError, before anything is written). ``only``: copy only that version (another one shown
        now is None, with nothing written). ``gate``: a gated read (a cluster member's index): the stop marks
        must be equal before the copy and unchanged after it, and ``gate()`` true after it; otherwise None
        (the buffer may have been written: the caller's fallback overwrites it)."""
        if not self.trusted():
            return None
        marks = self.marks() if gate is not None else (0, 0)
        if marks[0] != marks[1]:
            return None  # stopped or stalled since the last re-check against the directory
        for _ in range(self.MAX_RETRIES):
            table_seq = HEADER.unpack_from(self.buf, 0)[3]
            if table_seq & 1:
                return None
            found = self.find(key)
            if found is None:
                return None
            base, slot = found
            seq, version, segment, size, expires, checksum = slot[0], slot[3], slot[4], slot[7], slot[8], slot[9]
            if seq & 1 or SEQ.unpack_from(self.buf, base)[0] != seq:
                continue  # fields may be torn: read again before acting on them
            if expires and time.monotonic() >= expires:
                return None
            if only is not None and version != only:
                return None
            try:
                src = self._region(segment, slot[6], size)
            except Exception:
                continue  # a torn offset/size slipped through; the re-read settles it
            dst = out(size)
            dst[:size] = src
            src.release()
            if SEQ.unpack_from(self.buf, base)[0] == seq and HEADER.unpack_from(self.buf, 0)[3] == table_seq:
                if gate is not None and (self.marks() != marks or not gate()):
                    return None  # stopped (now, or since the copy began): what it shows may be gone
                ATIME.pack_into(self.buf, base + _ATIME_OFFSET, time.monotonic_ns())
                return size, version, checksum
        return None
