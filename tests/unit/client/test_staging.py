"""The staging pool behind writes in place on the paths that send bytes at commit."""

from __future__ import annotations

import threading

from kvstore.client.staging import POOL_MIN, StagingPool


def test_a_released_buffer_is_handed_out_again_for_the_same_size():
    pool = StagingPool(limit=8 * POOL_MIN)
    first = pool.take(2 * POOL_MIN)
    first[:4] = b"warm"
    pool.give(first)
    assert pool.idle_bytes == 2 * POOL_MIN
    again = pool.take(2 * POOL_MIN)
    assert again is first and pool.idle_bytes == 0
    other = pool.take(3 * POOL_MIN)
    assert other is not first and len(other) == 3 * POOL_MIN


def test_small_buffers_and_buffers_over_the_limit_are_not_kept():
    pool = StagingPool(limit=4 * POOL_MIN)
    pool.give(bytearray(POOL_MIN - 1))
    pool.give(bytearray(5 * POOL_MIN))
    assert pool.idle_bytes == 0


def test_the_pool_never_holds_more_than_its_limit():
    pool = StagingPool(limit=4 * POOL_MIN)
    for size in (POOL_MIN, 2 * POOL_MIN, 3 * POOL_MIN, POOL_MIN, 2 * POOL_MIN):
        pool.give(bytearray(size))
        assert pool.idle_bytes <= 4 * POOL_MIN
    assert pool.idle_bytes > 0


def test_threads_never_get_the_same_buffer():
    pool = StagingPool(limit=64 * POOL_MIN)
    for _ in range(8):
        pool.give(bytearray(POOL_MIN))
    taken: list[bytearray] = []
    lock = threading.Lock()

    def grab():
        for _ in range(4):
            b = pool.take(POOL_MIN)
            with lock:
                taken.append(b)

    threads = [threading.Thread(target=grab) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(b) for b in taken}) == len(taken) == 16
