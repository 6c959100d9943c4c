"""WirePolicy: whether the next transfer on a tcp connection goes compressed, from what this connection measured.

Modes: ``"off"`` (never), ``"lz4"`` / ``"lz4-shuffle"`` (always ask; the sender still stores chunks that do
not shrink), and ``"auto"``: compress only when it is measured to pay on this link and this data.

``auto`` keeps, per connection, the link's goodput when nothing is compressed (raw bytes per second of
transfers of at least ``MIN_TIMED`` bytes) and, from a 256 KiB sample of a received payload, lz4's compress and
decompress speeds and ratio on this data. A transfer then costs about ``S/c + S/(r L) + S/d`` compressed against
``S/L`` plain (c, d: compressor and decompressor bytes/s, r: ratio, L: link bytes/s), so compression is chosen
when ``1/c + 1/(r L) + 1/d < 1/L`` by a margin — never when the link is faster than the compressor, and never
when the data does not compress (r near 1). Once a compressed transfer has run, its measured goodput replaces
the prediction. Every ``REPROBE`` transfers the other choice is tried once and the sample re-taken, so a link
or data that changes is noticed.
"""

from __future__ import annotations

import time
from typing import Any

import lz4.block

from kvstore.errors import InvalidArgumentError
from kvstore.protocol.compression import CODECS, MIN_SIZE, shuffle

MODES = ("off", "auto", *CODECS)
MIN_TIMED = 1 << 20  # transfers smaller than this say more about round trips than about the link
SAMPLE = 256 << 10
REPROBE = 16
MARGIN = 0.9  # compress only when predicted at least 10 % faster: a prediction is not a measurement
_EWMA = 0.3


class WirePolicy:
    def __init__(self, mode: str = "off"):
        if mode not in MODES:
            raise InvalidArgumentError(f"compression must be one of {list(MODES)}, got {mode!r}")
        self.mode = mode
        self.codec = "lz4"  # the codec auto asks for: lz4 without shuffle (README "When compression pays")
        self.plain_rate: float | None = None  # bytes/s, uncompressed transfers
        self.packed_rate: float | None = None  # raw bytes/s, compressed transfers
        self.ratio: float | None = None
        self.compress_rate: float | None = None
        self.decompress_rate: float | None = None
        self.transfers = 0
        self._last: str | None = None

    def choose(self) -> str | None:
        """The codec to ask for on the next transfer (None: uncompressed)."""
        if self.mode == "off":
            return None
        if self.mode != "auto":
            return self.mode
        self.transfers += 1
        prefer = self.codec if self._pays() else None
        if self.transfers % REPROBE == 0 and (prefer is not None or self._might_pay()):
            prefer = None if prefer else self.codec  # try the other once: links and data change
        self._last = prefer
        return prefer

    def _predicted(self) -> float | None:
        """Seconds per byte of a compressed transfer: measured when one ran, else from the sample."""
        if self.packed_rate is not None:
            return 1 / self.packed_rate
        plain, ratio, pack, unpack = self.plain_rate, self.ratio, self.compress_rate, self.decompress_rate
        if plain is None or ratio is None or pack is None or unpack is None:
            return None
        return 1 / pack + 1 / (ratio * plain) + 1 / unpack

    def _pays(self) -> bool:
        packed = self._predicted()
        return packed is not None and self.plain_rate is not None and packed < MARGIN / self.plain_rate

    def _might_pay(self) -> bool:
        # worth a probe only where the sample's ratio and speed could beat the link at all
        plain, ratio, pack = self.plain_rate, self.ratio, self.compress_rate
        return plain is not None and ratio is not None and pack is not None and ratio > 1.05 and pack > plain

    def observe(self, nbytes: int, seconds: float, codec: str | None, received: memoryview | None = None) -> None:
        """Record a transfer of ``nbytes`` raw bytes that took ``seconds`` (``codec`` as it was asked for);
        ``received``: the payload, to sample lz4 on when a sample is due."""
        if self.mode != "auto" or nbytes < MIN_TIMED or seconds <= 0:
            return
        rate = nbytes / seconds
        if codec is None:
            self.plain_rate = rate if self.plain_rate is None else (1 - _EWMA) * self.plain_rate + _EWMA * rate
            if received is not None and (self.ratio is None or self.transfers % REPROBE == 0):
                self.sample(received)
        else:
            self.packed_rate = rate if self.packed_rate is None else (1 - _EWMA) * self.packed_rate + _EWMA * rate

    def sample(self, data: memoryview) -> None:
        """Measure lz4 on (the start of) ``data``: ratio, compress and decompress speed."""
        chunk = data.cast("B")[:SAMPLE] if data.format != "B" else data[:SAMPLE]
        if len(chunk) < MIN_SIZE:
            return
        src = shuffle(chunk, CODECS[self.codec]) if CODECS[self.codec] else chunk
        t0 = time.perf_counter()
        packed = lz4.block.compress(src, store_size=False)
        t1 = time.perf_counter()
        lz4.block.decompress(packed, uncompressed_size=len(chunk))
        t2 = time.perf_counter()
        self.ratio = len(chunk) / max(len(packed), 1)
        self.compress_rate = len(chunk) / max(t1 - t0, 1e-9)
        self.decompress_rate = len(chunk) / max(t2 - t1, 1e-9)
        self.packed_rate = None  # the data changed: the next compressed transfer measures afresh

    def describe(self) -> dict[str, Any]:
        """What the policy knows (``stats()["compression"]``): rates in GB/s."""
        def gb(rate: float | None) -> float | None:
            return None if rate is None else round(rate / 1e9, 3)

        return {"mode": self.mode, "codec": self.codec if self.mode == "auto" else self.mode,
                "compressing": self._pays() if self.mode == "auto" else self.mode != "off",
                "link_plain_gbs": gb(self.plain_rate), "link_compressed_gbs": gb(self.packed_rate),
                "sample_ratio": None if self.ratio is None else round(self.ratio, 3),
                "compress_gbs": gb(self.compress_rate), "decompress_gbs": gb(self.decompress_rate),
                "transfers": self.transfers}
