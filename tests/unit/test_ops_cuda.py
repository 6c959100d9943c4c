"""kvstore.ops on CUDA: the same reference checks as on CPU, plus streams, alignment and the layer table.

Every test that needs a GPU is skipped without one; the host-side checks of the built extension run anywhere.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from kv_reference import (
    POISON,
    alloc_cache,
    bytes_of,
    make_caches,
    make_layout,
    pick_ids,
    poisoned_packed,
    reference_gather,
)

from kvstore import KVLayoutKind, ops

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICE = "cuda"


def cuda_module():
    try:
        return importlib.import_module("kvstore._C_cuda")
    except ImportError:
        pytest.skip("kvstore._C_cuda is not built (no nvcc at build time, or KVSTORE_CUDA=0)")


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(4321)


# -- host-side checks of the extension: run on any machine where it was built -----------------------------------
def test_cuda_errors_are_runtime_errors():
    assert issubclass(cuda_module().CudaError, RuntimeError)


@pytest.mark.parametrize("ptr_bits,packed,stride,expected", [
    (0x7F0000000000, 0x7F1000000000, 16 * 2 * 32, 16),  # everything 16-byte aligned
    (0x7F0000000000, 0x7F1000000008, 16 * 2 * 32, 8),   # packed buffer at an 8-byte offset
    (0x7F0000000002, 0x7F1000000000, 16 * 2 * 32, 2),   # one layer at a 2-byte offset
], ids=["aligned", "packed+8", "layer+2"])
def test_vector_width_follows_alignment(ptr_bits, packed, stride, expected):
    width = cuda_module().vector_bytes(layer_ptr_bits=ptr_bits, block_stride=stride, dim_sizes=[16, 2, 32],
                                       dim_strides=[64, 32, 1], itemsize=2, packed=packed)
    assert width == expected


# -- on a GPU ------------------------------------------------------------------------------------------------
@needs_gpu
@pytest.mark.parametrize("kind", list(KVLayoutKind), ids=lambda k: k.name)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float8_e5m2],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("block_size,num_blocks", [(16, 1), (16, 64), (32, 7), (64, 64)])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_gather_and_scatter_match_reference(kind, dtype, block_size, num_blocks, id_dtype, gen):
    layout = make_layout(kind, dtype, block_size)
    total = num_blocks + 5
    caches = make_caches(layout, total, gen, DEVICE)
    ids = pick_ids(total, num_blocks, gen, id_dtype, DEVICE)
    out = ops.gather_pages(caches, ids, poisoned_packed(layout, num_blocks, DEVICE), layout=layout)
    assert torch.equal(bytes_of(out), reference_gather(kind, caches, ids))
    restored = make_caches(layout, total, gen, DEVICE, fill=0)
    ops.scatter_pages(out, ids, restored, layout=layout)
    block_dim = kind.cache_dims.index("block")
    mask = torch.zeros(total, dtype=torch.bool, device=DEVICE)
    mask[ids.long()] = True
    for src, dst in zip(caches, restored, strict=True):
        kept = bytes_of(dst).index_select(block_dim, ids.long())
        assert torch.equal(kept, bytes_of(src).index_select(block_dim, ids.long()))
        assert not bytes_of(dst).index_select(block_dim, (~mask).nonzero().flatten()).any()


@needs_gpu
def test_misaligned_buffers_fall_back_to_narrow_vectors(gen):
    layout = make_layout(KVLayoutKind.VLLM_FLASH_NHD, torch.float16)
    caches = make_caches(layout, 9, gen, DEVICE)
    ids = pick_ids(9, 4, gen, device=DEVICE)
    numel = ops.packed_nbytes(layout, 4) // 2
    arena = torch.zeros(numel + 1, dtype=torch.float16, device=DEVICE)
    out = arena[1:].view(ops.packed_shape(layout, 4))  # 2-byte aligned only
    ops.gather_pages(caches, ids, out, layout=layout)
    assert torch.equal(bytes_of(out), reference_gather(layout.kind, caches, ids))


@needs_gpu
def test_runs_on_the_callers_current_stream(gen):
    layout = make_layout(KVLayoutKind.FLASHINFER, torch.bfloat16, block_size=64)
    caches = make_caches(layout, 300, gen, DEVICE)
    ids = pick_ids(300, 256, gen, device=DEVICE)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = poisoned_packed(layout, 256, DEVICE)
        ops.gather_pages(caches, ids, out, layout=layout)
    side.synchronize()
    assert torch.equal(bytes_of(out), reference_gather(layout.kind, caches, ids))


@needs_gpu
def test_layer_table_is_built_once_per_set_of_caches(gen):
    layout = make_layout(KVLayoutKind.MLA)
    caches = make_caches(layout, 4, gen, DEVICE)
    ptrs = [c.data_ptr() for c in caches]
    first, bits = ops._layer_table(ptrs, caches[0].device)
    again, _ = ops._layer_table(list(ptrs), caches[0].device)
    assert first is again
    assert first.tolist() == [c.data_ptr() for c in caches] and bits & 0xF == 0


@needs_gpu
def test_opcheck_and_compile_on_cuda(gen):
    layout = make_layout(KVLayoutKind.VLLM_FLASH_HND, torch.float32)
    caches = [torch.randn(layout.cache_shape(8), device=DEVICE) for _ in range(layout.num_layers)]
    ids = pick_ids(8, 3, gen, device=DEVICE)
    out = torch.empty(ops.packed_shape(layout, 3), device=DEVICE)
    torch.library.opcheck(torch.ops.kvstore.gather_pages.default, (caches, ids, out, layout.kind.value))
    torch.library.opcheck(torch.ops.kvstore.scatter_pages.default, (out.clone(), ids, caches, layout.kind.value))

    def move(src_caches, dst_caches, block_ids):
        packed = torch.empty(ops.packed_shape(layout, block_ids.shape[0]), device=DEVICE)
        ops.gather_pages(src_caches, block_ids, packed, layout=layout)
        ops.scatter_pages(packed + 1, block_ids, dst_caches, layout=layout)

    eager = [torch.zeros_like(c) for c in caches]
    compiled = [torch.zeros_like(c) for c in caches]
    move(caches, eager, ids)
    torch.compile(move, fullgraph=True, backend="aot_eager")(caches, compiled, ids)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled, strict=True))


@needs_gpu
def test_cuda_validation(gen):
    layout = make_layout(KVLayoutKind.VLLM_FLASH_NHD, torch.float16)
    caches = make_caches(layout, 8, gen, DEVICE)
    out = poisoned_packed(layout, 2, DEVICE)
    with pytest.raises(ValueError, match=r"block_ids: expected device cuda:0 .*got cpu"):
        ops.gather_pages(caches, torch.tensor([1, 2]), out, layout=layout)
    with pytest.raises(ValueError, match=r"block_ids\[1\] = 8 is out of range"):
        ops.gather_pages(caches, torch.tensor([1, 8], device=DEVICE), out, layout=layout)
    with pytest.raises(ValueError, match=r"out: expected device cuda:0 .*got cpu"):
        ops.gather_pages(caches, torch.tensor([1, 2], device=DEVICE), poisoned_packed(layout, 2), layout=layout)
    with pytest.raises(ValueError, match="expected distinct ids for scatter"):
        ops.scatter_pages(out, torch.tensor([3, 3], device=DEVICE), caches, layout=layout)
    assert (out.view(torch.uint8) == POISON).all()
    mixed = [caches[0], alloc_cache(layout, 8, "cpu", gen=gen), caches[2]]
    with pytest.raises(ValueError, match=r"kv_caches\[1\]: expected the device of kv_caches\[0\]"):
        ops.gather_pages(mixed, torch.tensor([1, 2], device=DEVICE), out, layout=layout)
