"""The payload digest: a copy that hashes as it goes gives exactly the one-shot xxh3 of the bytes."""

import numpy as np
import pytest

from kvstore.core.digest import FUSED_PIECE, Digest, checksum_of


@pytest.mark.parametrize("size", [0, 1, FUSED_PIECE - 1, FUSED_PIECE, FUSED_PIECE + 1, 5 * FUSED_PIECE + 17])
def test_copy_into_copies_and_hashes_in_one_pass(size):
    src = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    dst = np.zeros(size, np.uint8)
    digest = Digest(memoryview(src))
    digest.copy_into(memoryview(dst))
    assert np.array_equal(dst, src)
    assert digest() == checksum_of(memoryview(src))


def test_a_known_digest_is_recorded_as_given_and_still_copies():
    src = np.arange(100, dtype=np.uint8)
    dst = np.zeros(100, np.uint8)
    digest = Digest(memoryview(src), known=42)
    digest.copy_into(memoryview(dst))
    assert np.array_equal(dst, src) and digest() == 42


def test_copy_into_refuses_a_destination_of_another_size():
    with pytest.raises(ValueError, match="destination of 3 bytes"):
        Digest(memoryview(b"abcd")).copy_into(memoryview(bytearray(3)))
