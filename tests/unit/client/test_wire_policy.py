"""WirePolicy (kvstore.client.compression): when ``auto`` compresses, from measured rates and a data sample."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.client.compression import REPROBE, WirePolicy
from kvstore.errors import InvalidArgumentError

MiB = 1 << 20


def _compressible() -> memoryview:
    data = np.zeros(MiB, np.uint8)
    data[::9] = 1
    return memoryview(data.tobytes())


def _noise() -> memoryview:
    return memoryview(np.random.default_rng(0).bytes(MiB))


def _policy_after_plain(rate_bytes_s: float, data: memoryview) -> WirePolicy:
    policy = WirePolicy("auto")
    assert policy.choose() is None  # nothing measured yet: the link is measured plain first
    policy.observe(64 * MiB, 64 * MiB / rate_bytes_s, None, data)
    return policy


def test_fixed_modes():
    assert WirePolicy("off").choose() is None
    assert WirePolicy("lz4").choose() == "lz4"
    assert WirePolicy("lz4-shuffle").choose() == "lz4-shuffle"
    with pytest.raises(InvalidArgumentError):
        WirePolicy("gzip")


def test_auto_compresses_compressible_data_on_a_slow_link():
    policy = _policy_after_plain(1e6, _compressible())  # 8 Mbit/s: far slower than lz4 anywhere
    assert policy.ratio > 5
    assert policy.choose() == "lz4"


def test_auto_stays_off_when_the_link_is_faster_than_the_compressor():
    policy = _policy_after_plain(1e13, _compressible())  # 80 Tbit/s: no compressor keeps up
    assert all(policy.choose() is None for _ in range(3 * REPROBE))


def test_auto_turns_itself_off_when_the_data_does_not_compress():
    policy = _policy_after_plain(1e6, _noise())
    assert policy.ratio < 1.05
    assert all(policy.choose() is None for _ in range(3 * REPROBE))  # not even a probe


def test_auto_follows_the_measured_compressed_rate_and_reprobes():
    policy = _policy_after_plain(1e6, _compressible())
    assert policy.choose() == "lz4"
    policy.observe(64 * MiB, 64 * MiB / 0.5e6, "lz4")  # measured: compressed transfers went slower after all
    choices = [policy.choose() for _ in range(2 * REPROBE)]
    assert choices.count("lz4") == 1 or choices.count("lz4") == 2  # only the periodic probe tries it again
    policy.observe(64 * MiB, 64 * MiB / 1e8, "lz4")  # a probe found it fast again
    policy.observe(64 * MiB, 64 * MiB / 1e8, "lz4")
    assert policy.choose() == "lz4"


def test_small_transfers_say_nothing_about_the_link():
    policy = WirePolicy("auto")
    policy.observe(4096, 1.0, None, _compressible())
    assert policy.plain_rate is None and policy.choose() is None
    assert policy.describe()["mode"] == "auto"
