"""Fused checksums in the CPU kernels: ``gather_pages(checksum=True)`` returns exactly xxhash's xxh3-64 of the
bytes it wrote, ``scatter_pages(expect_checksum=...)`` hashes what it reads and raises ChecksumError on a
mismatch; both for every layout kind and dtype, 1 / odd / many blocks, one or several threads, streaming stores
or not; and the Python fallback (``KVSTORE_NO_FUSED_HASH=1``, or libxxhash missing) gives the same results."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import xxhash
from kv_reference import (
    DTYPES,
    KINDS,
    bytes_of,
    make_caches,
    make_layout,
    pick_ids,
    poisoned_packed,
    reference_gather,
)
from paths import ROOT

import kvstore._C as native
from kvstore import KVLayoutKind, ops
from kvstore.errors import ChecksumError


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(4321)


@pytest.fixture(params=["fused", "python"])
def mode(request, monkeypatch):
    """Each test runs on the fused kernels and on the Python fallback (the switch the code itself reads)."""
    if request.param == "python":
        monkeypatch.setenv("KVSTORE_NO_FUSED_HASH", "1")
        assert ops.fused_checksums() is not None
    else:
        monkeypatch.delenv("KVSTORE_NO_FUSED_HASH", raising=False)
        if ops.fused_checksums() is not None:
            pytest.skip(ops.fused_checksums())
    return request.param


def xxh3(t: torch.Tensor) -> int:
    return xxhash.xxh3_64_intdigest(bytes_of(t).numpy().tobytes())


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 5, 40])
def test_gather_checksum_is_xxh3_of_the_bytes_written(kind, dtype, n, mode, gen):
    layout = make_layout(kind, dtype)
    caches = make_caches(layout, 64, gen)
    ids = pick_ids(64, n, gen)
    out = poisoned_packed(layout, n)
    returned, digest = ops.gather_pages(caches, ids, out, layout=layout, checksum=True)
    assert returned is out
    assert torch.equal(bytes_of(out), reference_gather(kind, caches, ids))
    assert digest == xxh3(out)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("n", [1, 7])
def test_scatter_verifies_what_it_reads(kind, dtype, n, mode, gen):
    layout = make_layout(kind, dtype)
    src_caches = make_caches(layout, 32, gen)
    packed = torch.empty(ops.packed_shape(layout, n), dtype=dtype)
    ids = pick_ids(32, n, gen)
    _, digest = ops.gather_pages(src_caches, ids, packed, layout=layout, checksum=True)
    dst = make_caches(layout, 32, gen, fill=0)
    dst_ids = pick_ids(32, n, gen)
    ops.scatter_pages(packed, dst_ids, dst, layout=layout, expect_checksum=digest)
    assert torch.equal(reference_gather(kind, dst, dst_ids), bytes_of(packed))

    bad = make_caches(layout, 32, gen, fill=0)
    with pytest.raises(ChecksumError, match="treat them as failed") as info:
        ops.scatter_pages(packed, dst_ids, bad, layout=layout, expect_checksum=digest ^ 1)
    assert info.value.expected == digest ^ 1 and info.value.actual == digest
    if mode == "python":  # the fallback hashes before it copies: nothing reached the caches
        assert all(torch.count_nonzero(c.view(torch.uint8)) == 0 for c in bad)


def test_a_corrupted_source_is_detected(mode, gen):
    layout = make_layout(KVLayoutKind.VLLM_FLASH_NHD)
    packed = torch.empty(ops.packed_shape(layout, 4), dtype=layout.dtype)
    _, digest = ops.gather_pages(make_caches(layout, 8, gen), pick_ids(8, 4, gen), packed, layout=layout,
                                 checksum=True)
    raw = packed.view(-1).view(torch.uint8)
    raw[raw.numel() - 3] ^= 0x10  # one bit, near the end (the last piece)
    with pytest.raises(ChecksumError):
        ops.scatter_pages(packed, torch.arange(4), make_caches(layout, 8, gen, fill=0), layout=layout,
                          expect_checksum=digest)


def test_bad_ids_are_value_errors_not_checksum_errors(mode, gen):
    layout = make_layout(KVLayoutKind.MLA)
    packed = torch.zeros(ops.packed_shape(layout, 2), dtype=layout.dtype)
    dst = make_caches(layout, 4, gen, fill=0)
    with pytest.raises(ValueError, match="distinct"):
        ops.scatter_pages(packed, torch.tensor([1, 1]), dst, layout=layout, expect_checksum=123)
    with pytest.raises(ValueError, match="out of range"):
        ops.scatter_pages(packed, torch.tensor([1, 9]), dst, layout=layout, expect_checksum=123)
    with pytest.raises(TypeError, match="expect_checksum"):
        ops.scatter_pages(packed, torch.tensor([0, 1]), dst, layout=layout, expect_checksum=-1)


def test_empty_request_hashes_to_xxh3_of_nothing(mode, gen):
    layout = make_layout(KVLayoutKind.FLASHINFER)
    out = torch.empty(ops.packed_shape(layout, 0), dtype=layout.dtype)
    _, digest = ops.gather_pages(make_caches(layout, 4, gen), torch.tensor([], dtype=torch.int64), out,
                                 layout=layout, checksum=True)
    assert digest == xxhash.xxh3_64_intdigest(b"")


def test_checksum_into_a_reserved_buffer(mode, gen):
    """``out`` may be a plain writable buffer (a store's reservation); the digest covers its bytes."""
    layout = make_layout(KVLayoutKind.VLLM_FLASH_HND, torch.float16)
    buf = bytearray(ops.packed_nbytes(layout, 3))
    _, digest = ops.gather_pages(make_caches(layout, 8, gen), pick_ids(8, 3, gen), buf, layout=layout,
                                 checksum=True)
    assert digest == xxhash.xxh3_64_intdigest(bytes(buf))


# -- the kernels themselves: thread counts and store kinds the ops pick by size -------------------------------
def _native_args(layout, caches, ids, packed):
    pages = ops._inspect(layout.kind.value, caches, ids, packed, "out")
    return dict(layer_ptrs=[c.data_ptr() for c in caches], **ops._launch_args(pages, ids, packed))


@pytest.mark.skipif(bool(native.xxh3_status()), reason="libxxhash.so.0 not loadable")
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("streaming", [0, 1])
def test_kernel_digest_for_any_thread_count_and_store_kind(threads, streaming, gen):
    """~26 MiB, enough for 3 threads (8 MiB each at least) and ~100 hashing pieces: the hashing thread and the
    copying threads meet in every order; ids repeat and are shuffled."""
    layout = make_layout(KVLayoutKind.VLLM_FLASH_NHD, torch.bfloat16, layers=4, heads=8, head_dim=128)
    caches = make_caches(layout, 64, gen)
    ids = torch.randint(0, 64, (101,), generator=gen)
    out = poisoned_packed(layout, len(ids))
    digest = native.gather_pages_xxh3(**_native_args(layout, caches, ids, out), num_threads=threads,
                                      streaming=streaming)
    assert torch.equal(bytes_of(out), reference_gather(layout.kind, caches, ids))
    assert digest == xxh3(out)
    dst = make_caches(layout, 128, gen, fill=0)
    dst_ids = torch.randperm(128, generator=gen)[:len(ids)]
    assert native.scatter_pages_xxh3(**_native_args(layout, dst, dst_ids, out), num_threads=threads,
                                     streaming=streaming) == digest
    assert torch.equal(reference_gather(layout.kind, dst, dst_ids), bytes_of(out))


def test_without_libxxhash_the_ops_fall_back_to_python(tmp_path):
    """A process whose extension cannot load the library (KVSTORE_XXHASH_LIB names a missing file): the fused
    entries refuse with a clear error, ops says why, and checksum=True still returns xxh3 of the bytes."""
    code = """
import torch, xxhash
import kvstore._C as native
from kvstore import KVLayout, KVLayoutKind, ops
assert "cannot load" in native.xxh3_status(), native.xxh3_status()
why = ops.fused_checksums()
assert why and "unavailable" in why and "nope.so" in why, why
layout = KVLayout(kind=KVLayoutKind.MLA, num_layers=2, num_kv_heads=1, head_dim=64, block_size=4,
                  dtype=torch.float16, model_id="m")
caches = [torch.randn(layout.cache_shape(4)).half() for _ in range(2)]
out = torch.empty(ops.packed_shape(layout, 2), dtype=torch.float16)
_, digest = ops.gather_pages(caches, torch.tensor([3, 1]), out, layout=layout, checksum=True)
assert digest == xxhash.xxh3_64_intdigest(out.view(-1).view(torch.uint8).numpy().tobytes())
one = torch.tensor([0])
try:
    native.gather_pages_xxh3(layer_ptrs=[c.data_ptr() for c in caches], block_ids=one.data_ptr(),
                             ids_int64=True, num_ids=1, num_cache_blocks=4, block_stride=256, dim_sizes=[4, 64],
                             dim_strides=[64, 1], itemsize=2, packed=out.data_ptr())
except RuntimeError as exc:
    assert "fused checksums unavailable" in str(exc), exc
else:
    raise AssertionError("the fused entry ran without its library")
print("ok")
"""
    env = {**os.environ, "KVSTORE_XXHASH_LIB": str(tmp_path / "nope.so"), "PYTHONPATH": str(ROOT)}
    env.pop("KVSTORE_NO_FUSED_HASH", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
