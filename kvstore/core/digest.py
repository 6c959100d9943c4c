"""The checksum of a payload: xxh3-64, recorded at commit and checked on ``verify=True`` reads."""

from __future__ import annotations

import xxhash

checksum_of = xxhash.xxh3_64_intdigest


class Digest:
    """The xxh3-64 of a payload, recorded at commit, computed once when first asked for: after the copy on
    the shared-memory path, so the tail of the source is still in cache. (Hashing on a second thread while
    copying was measured slower here: the two compete for memory bandwidth.)"""

    def __init__(self, view: memoryview):
        self._view: memoryview | None = view
        self._value = 0

    def __call__(self) -> int:
        if self._view is not None:
            self._value, self._view = checksum_of(self._view), None
        return self._value
