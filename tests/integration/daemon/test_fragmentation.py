"""Fragmentation with a real daemon: a put whose bytes are free but in pieces is placed by relocating unheld
objects (same-host lock-free readers and TCP readers then find them at their new place, held zero-copy views
never move); a put the space really cannot take gets StoreFullError with the true numbers, and the daemon
keeps serving."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import MiB, wait_until

import kvstore

pytestmark = pytest.mark.timeout(120)


def payload(seed: int, size: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def test_fragmented_put_relocates_then_a_real_refusal_tells_the_truth(daemon_factory):
    d = daemon_factory(capacity="64MiB", args=("--high-watermark", "1.0", "--low-watermark", "1.0"))
    shm, tcp = d.connect("shm"), d.connect("tcp")
    try:
        pinned = {f"pin{i}": payload(i, 5 * MiB // 2) for i in range(16)}
        for i in range(16):  # issue 11: pinned data 1.5 MiB apart once the rest goes
            shm.put(f"pin{i}", pinned[f"pin{i}"], pin=True)
            shm.put(f"tmp{i}", payload(100 + i, 3 * MiB // 2))
        for i in range(16):
            shm.remove(f"tmp{i}")
        s = shm.stats()
        assert s["used_bytes"] == 40 * MiB and s["largest_free_bytes"] == 3 * MiB // 2
        with shm.get("pin3", copy=False) as view3, shm.get("pin4", copy=False) as view4:
            big = payload(999, 8 * MiB)
            shm.put("big", big, pin=True)  # 24 MiB free in 1.5 MiB pieces: relocation, not a refusal
            s = shm.stats()
            assert s["relocations"] >= 2 and s["evictions"] == 0 and s["refusals"] == 0
            assert bytes(view3) == pinned["pin3"] and bytes(view4) == pinned["pin4"]  # held views never moved
            for key, value in pinned.items():  # lock-free shm reads and tcp reads find the moved objects
                assert bytes(shm.get(key)) == value, key
                assert bytes(tcp.get(key)) == value, key
            assert bytes(tcp.get("big")) == big
            # 16 MiB free, but the two held objects split it: no stretch without them holds 15 MiB
            filler = payload(7, 15 * MiB)
            s = shm.stats()
            with pytest.raises(kvstore.StoreFullError) as info:
                tcp.put("filler", filler, pin=True)
            assert not isinstance(info.value, kvstore.ObjectTooLargeError)
            msg = str(info.value)
            assert (f"{s['used_bytes']} of {64 * MiB} bytes used, {s['free_bytes']} free, largest free extent "
                    f"{s['largest_free_bytes']}") in msg, msg
            assert "the free space is in pieces" in msg and f"{5 * MiB} bytes leased" in msg, msg
            assert f"{s['used_bytes'] - 5 * MiB} bytes pinned" in msg and "pending" not in msg, msg
            assert shm.stats()["refusals"] == 1 and not tcp.exists("filler")
        assert wait_until(lambda: shm.stats()["leases"] == 0, 10)  # zero-copy releases are pipelined
        tcp.put("filler", filler, pin=True)  # the views are released: now those two may move as well
        assert shm.stats()["evictions"] == 0
        s = shm.stats()
        with pytest.raises(kvstore.StoreFullError) as info:
            tcp.put("too-much", payload(8, 4 * MiB))
        msg = str(info.value)
        assert (f"{s['used_bytes']} of {64 * MiB} bytes used, {s['free_bytes']} free, largest free extent "
                f"{s['largest_free_bytes']}") in msg, msg
        assert "the free space is smaller than the request" in msg and f"{s['used_bytes']} bytes pinned" in msg
        assert "leased" not in msg and "pending" not in msg and "quarantined" not in msg, msg
        # the daemon keeps serving, and every byte is where it should be
        tcp.put("after", b"still serving")
        assert bytes(shm.get("after")) == b"still serving"
        assert all(bytes(shm.get(k)) == v for k, v in pinned.items())
    finally:
        shm.close()
        tcp.close()
