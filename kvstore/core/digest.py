"""The checksum of a payload: xxh3-64, recorded at commit and checked on ``verify=True`` reads."""

from __future__ import annotations

import xxhash

checksum_of = xxhash.xxh3_64_intdigest
#: Copies that hash as they go do so in pieces this big: each piece is hashed right after it is written, while
#: it is still in cache (measured here: the copy plus hash costs ~1.1-1.5x the copy alone, against ~2.2-2.7x
#: for a copy followed by a separate pass; bigger pieces fall out of L2).
FUSED_PIECE = 128 << 10


class Digest:
    """The xxh3-64 of a payload, recorded at commit, computed once when first asked for — or while copying the
    payload (``copy_into``), so the bytes are hashed while in cache. (Hashing on a second thread while
    copying was measured slower here: the two compete for memory bandwidth.) ``known`` is a digest the
    writer already computed: it is recorded as given."""

    def __init__(self, view: memoryview, known: int | None = None):
        self._view = view
        self._value = known

    def __call__(self) -> int:
        if self._value is None:
            self._value = checksum_of(self._view)
        return self._value

    @property
    def known(self) -> int | None:
        """The digest if already computed (or given), else None; computes nothing."""
        return self._value

    def record(self, value: int) -> None:
        """Take ``value`` as the digest: the receiver hashed the bytes as they arrived (the stream path)."""
        if self._value is not None and self._value != value:
            raise ValueError(f"digest {value:#x} recorded for a payload already hashed to {self._value:#x}")
        self._value = value

    def copy_into(self, dst: memoryview) -> None:
        """Copy the payload into ``dst`` (same length), computing the digest in the same pass."""
        src = self._view
        if len(dst) != len(src):
            raise ValueError(f"copy_into: destination of {len(dst)} bytes for a payload of {len(src)}")
        if self._value is not None:
            dst[:] = src
            return
        hasher = xxhash.xxh3_64()
        for start in range(0, len(src), FUSED_PIECE):
            piece = dst[start:start + FUSED_PIECE]
            piece[:] = src[start:start + FUSED_PIECE]
            hasher.update(piece)
        self._value = hasher.intdigest()
