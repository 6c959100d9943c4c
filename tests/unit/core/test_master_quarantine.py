"""The master's side of quarantine and per-client quotas (pure logic; the daemon's tests use real processes)."""

import pytest

from kvstore.core.master import Master
from kvstore.core.meta import ObjectMeta
from kvstore.core.quota import ClientQuota
from kvstore.errors import ObjectBusyError, QuotaExceededError, StoreFullError

K = 1024


def meta(key, size):
    return ObjectMeta(key=key, size=size, checksum=1)


def put(m, c, key, size):
    return m.commit(m.begin_put(meta(key, size), c).id)


def test_quarantined_space_is_not_reused_until_released():
    m = Master([64 * K], high_watermark=1.0, low_watermark=1.0)
    paused, other = m.register_client("paused"), m.register_client("other")
    put(m, other, "viewed", 16 * K)
    lease = m.lease("viewed", paused)
    pending = m.begin_put(meta("big", 32 * K), paused)
    m.drop_client(paused, quarantine=True)
    assert m.stats()["pending"] == 0 and m.stats()["leases"] == 0
    assert m.quarantined_bytes() == 48 * K
    with pytest.raises(ObjectBusyError):
        m.evict("viewed")  # its bytes may still be read by the paused process
    for i in range(8):  # the store cycles through what is left, never through the held space
        r = put(m, other, f"fill/{i}", 16 * K)
        assert not (pending.offset <= r.offset < pending.offset + pending.reserved)
        assert r.offset != lease.replica.offset
    with pytest.raises(StoreFullError, match="quarantined"):
        m.begin_put(meta("huge", 40 * K), other)
    assert m.remove("viewed")  # removable (invisible now); its space stays held
    assert m.release_quarantine(paused) == 48 * K
    assert m.quarantined_bytes() == 0
    put(m, other, "huge", 40 * K)  # the space is back


def test_drop_without_quarantine_frees_at_once():
    m = Master([64 * K])
    c = m.register_client()
    m.begin_put(meta("p", 32 * K), c)
    m.drop_client(c)
    assert m.used_bytes == 0 and m.quarantined_bytes() == 0


def test_pending_over_the_cap_takes_free_space_but_never_evicts():
    m = Master([64 * K], high_watermark=0.9, low_watermark=0.5, quota=ClientQuota(max_pending_bytes=16 * K))
    writer, hog = m.register_client(), m.register_client()
    for i in range(6):
        put(m, writer, f"c/{i}", 8 * K)  # 48 KiB committed
    m.begin_put(meta("p0", 8 * K), hog)
    m.begin_put(meta("p1", 8 * K), hog)  # within the cap: may evict
    evictions = m.evictions
    with pytest.raises(QuotaExceededError, match="max-pending-bytes"):
        while True:
            m.begin_put(meta("px", 8 * K), hog)
    assert m.evictions == evictions


def test_held_bytes_and_lease_count_caps():
    m = Master([64 * K], quota=ClientQuota(max_held_bytes=16 * K, max_leases=3))
    c = m.register_client()
    put(m, c, "a", 12 * K)
    put(m, c, "b", 8 * K)
    m.lease("a", c)
    m.lease("a", c)  # the same object again costs no more bytes
    with pytest.raises(QuotaExceededError, match="max-held-bytes"):
        m.lease("b", c)
    m.lease("a", c)
    with pytest.raises(QuotaExceededError, match="max-leases"):
        m.lease("a", c)
    assert m.stats()["leases"] == 3
    big = m.register_client()
    m.lease("a", big)  # the first hold of any size is allowed to every client
