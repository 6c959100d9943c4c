"""Paged KV straight into the store and back (``put_pages`` / ``get_pages``): against the torch reference for
every layout and dtype on every backend, with metadata checked before any byte reaches the caches, and a
corrupted object detected before it is scattered."""

from __future__ import annotations

import pytest
import torch
import xxhash
from conftest import flip_byte
from kv_reference import DTYPES, KINDS, bytes_of, make_caches, make_layout, pick_ids, reference_gather

from kvstore import ChecksumError, KVLayoutKind, LayoutMismatchError, ops

NUM_CACHE_BLOCKS = 12


@pytest.fixture(autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_put_pages_then_get_pages_match_the_reference(store, prefix, kind, dtype):
    gen = torch.Generator().manual_seed(7)
    layout = make_layout(kind, dtype, block_size=4)
    src = make_caches(layout, NUM_CACHE_BLOCKS, gen)
    dst = make_caches(layout, NUM_CACHE_BLOCKS, gen, fill=0)
    src_ids, dst_ids = pick_ids(NUM_CACHE_BLOCKS, 5, gen), pick_ids(NUM_CACHE_BLOCKS, 5, gen)
    meta = store.put_pages(prefix + "p", src, src_ids, layout=layout)
    expected = reference_gather(kind, src, src_ids)
    assert meta.shape == ops.packed_shape(layout, 5) and meta.size == ops.packed_nbytes(layout, 5)
    stored = store.get(prefix + "p")
    assert bytes(stored) == bytes(expected.reshape(-1).numpy())
    assert meta.checksum == xxhash.xxh3_64_intdigest(bytes(stored))
    assert store.get_pages(prefix + "p", dst, dst_ids, layout=layout, verify=True) == meta.size
    assert torch.equal(bytes_of_blocks(kind, dst, dst_ids), expected)


def bytes_of_blocks(kind: KVLayoutKind, caches, ids) -> torch.Tensor:
    return reference_gather(kind, caches, ids)


def test_batch_forms_and_layout_checks(store, prefix):
    gen = torch.Generator().manual_seed(3)
    layout = make_layout(KVLayoutKind.VLLM_FLASH_NHD, torch.float16, block_size=4)
    src = make_caches(layout, NUM_CACHE_BLOCKS, gen)
    dst = make_caches(layout, NUM_CACHE_BLOCKS, gen, fill=0)
    store.batch_put_pages([(prefix + "a", [0, 1]), (prefix + "b", [5])], src, layout=layout)
    moved = store.batch_get_pages([(prefix + "a", [2, 3]), (prefix + "b", [4])], dst, layout=layout)
    assert moved == ops.packed_nbytes(layout, 3)
    assert torch.equal(dst[1].view(torch.uint8)[:, [2, 3, 4]], src[1].view(torch.uint8)[:, [0, 1, 5]])
    before = [bytes_of(c).clone() for c in dst]
    with pytest.raises(LayoutMismatchError, match="bytes"):
        store.get_pages(prefix + "a", dst, [7, 8, 9], layout=layout)  # 3 blocks asked, 2 stored
    other = make_layout(KVLayoutKind.VLLM_FLASH_NHD, torch.bfloat16, block_size=4)
    with pytest.raises(LayoutMismatchError, match="float16"):
        store.get_pages(prefix + "a", make_caches(other, NUM_CACHE_BLOCKS, gen, fill=0), [7, 8], layout=other)
    assert all(torch.equal(bytes_of(c), b) for c, b in zip(dst, before, strict=True)), "a refused get wrote"
    for bad in ([0.9, 1.9], torch.tensor([0.0, 1.0]), [True, False]):
        with pytest.raises(TypeError, match="integers"):
            store.put_pages(prefix + "f", src, bad, layout=layout)
        with pytest.raises(TypeError, match="integers"):
            store.get_pages(prefix + "a", dst, bad, layout=layout)
    assert not store.exists(prefix + "f")


def test_a_corrupted_object_is_detected_before_it_is_scattered(daemon, prefix):
    gen = torch.Generator().manual_seed(5)
    layout = make_layout(KVLayoutKind.FLASHINFER, torch.bfloat16, block_size=4)
    src = make_caches(layout, NUM_CACHE_BLOCKS, gen)
    dst = make_caches(layout, NUM_CACHE_BLOCKS, gen, fill=0)
    with daemon.connect("shm") as s:
        s.put_pages(prefix + "c", src, [1, 2], layout=layout)
        flip_byte(daemon.pid, s, prefix + "c")
        with pytest.raises(ChecksumError):
            s.get_pages(prefix + "c", dst, [3, 4], layout=layout, verify=True)
        assert not any(bytes_of(c).any() for c in dst), "corrupted pages reached the cache"
