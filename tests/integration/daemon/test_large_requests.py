"""Requests and replies at the frame limits (issue 24, defects 5 and 6), against a real daemon: a batch over the
bound is refused before anything is sent (no desync, nothing reserved or quarantined); a reply that would not
fit in one frame is paged, or refused with a typed error on that request, never a dropped connection."""

from __future__ import annotations

import pytest

import kvstore

BATCH = 4096  # kvstore.protocol.wire.MAX_BATCH: objects one request may name

pytestmark = pytest.mark.timeout(120)


def _still_usable(s: kvstore.KVStore, prefix: str) -> None:
    s.ping()
    s.put(f"{prefix}after", b"after")
    assert bytes(s.get(f"{prefix}after")) == b"after"
    stats = s.stats()
    assert stats["pending"] == 0 and stats.get("quarantined_bytes", 0) == 0, stats


# ---- defect 6: batches over the bound ----------------------------------------------------------------------
@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("n", [BATCH + 1, 2 * BATCH + 1])
def test_batch_put_over_the_bound_is_refused_before_anything_is_sent(daemon, prefix, transport, n):
    with daemon.connect(transport) as s:
        items = [(f"{prefix}{i}", b"v%d" % i) for i in range(n)]
        with pytest.raises(kvstore.InvalidArgumentError, match="at most 4096"):
            s.batch_put(items)
        assert s.keys(prefix) == []
        _still_usable(s, prefix)
        assert len(s.batch_put(items[:BATCH])) == BATCH  # at the bound: one atomic batch
        assert s.batch_exists([k for k, _ in items]) == [True] * BATCH + [False] * (n - BATCH)
        for key in s.keys(prefix):
            s.remove(key)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_reservation_and_wait_over_the_bound_are_refused(daemon, prefix, transport):
    with daemon.connect(transport) as s:
        with pytest.raises(kvstore.InvalidArgumentError, match="at most 4096"):
            with s.batch_reserve([(f"{prefix}{i}", 8) for i in range(BATCH + 1)]):
                pass
        with pytest.raises(kvstore.InvalidArgumentError, match="at most 4096"):
            with s.reservation() as batch:
                for i in range(BATCH + 1):
                    batch.add(f"{prefix}{i}", 8)[:] = b"12345678"
        with pytest.raises(kvstore.InvalidArgumentError, match="at most 4096"):
            s.wait([f"{prefix}w{i}" for i in range(2 * BATCH + 1)], timeout=0.1)
        assert s.keys(prefix) == []
        _still_usable(s, prefix)
        s.remove(f"{prefix}after")
