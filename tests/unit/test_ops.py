"""kvstore.ops on CPU: gather/scatter against a pure-torch reference, opcheck, torch.compile, validation.

The reference below is written per layout kind on purpose (not derived from kvstore.layout's tables), so a
mistake in those tables shows up here. All comparisons are bit-exact on byte views.
"""

from __future__ import annotations

import pytest
import torch
from kv_reference import (
    DTYPES,
    HEAD_DIM,
    HEADS,
    KINDS,
    LAYERS,
    POISON,
    alloc_cache,
    bytes_of,
    make_caches,
    make_layout,
    pick_ids,
    poisoned_packed,
    random_bytes,
    reference_gather,
    reference_scatter,
)

from kvstore import KVLayout, KVLayoutKind, ops


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Single-threaded torch (and kernels): these tiny copies gain nothing from threads, and on a busy shared
    machine OpenMP barriers waiting for a descheduled thread make the suite several times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- the matrix ------------------------------------------------------------------------------------------------
MATRIX = pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
DTYPE_PARAMS = pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
SIZES = pytest.mark.parametrize("block_size,num_blocks", [(bs, n) for bs in (16, 32, 64) for n in (1, 7, 64)])


@MATRIX
@DTYPE_PARAMS
@SIZES
def test_gather_matches_reference(kind, dtype, block_size, num_blocks, gen):
    layout = make_layout(kind, dtype, block_size)
    caches = make_caches(layout, num_blocks + 5, gen)
    ids = pick_ids(num_blocks + 5, num_blocks, gen)
    out = poisoned_packed(layout, num_blocks)
    assert ops.gather_pages(caches, ids, out, layout=layout) is out
    assert torch.equal(bytes_of(out), reference_gather(kind, caches, ids))


@MATRIX
@DTYPE_PARAMS
@SIZES
def test_scatter_matches_reference(kind, dtype, block_size, num_blocks, gen):
    layout = make_layout(kind, dtype, block_size)
    caches = make_caches(layout, num_blocks + 5, gen)
    expected = [c.clone() for c in caches]
    ids = pick_ids(num_blocks + 5, num_blocks, gen)
    src = random_bytes(ops.packed_shape(layout, num_blocks), dtype, gen)
    ops.scatter_pages(src, ids, caches, layout=layout)
    reference_scatter(kind, src.view(torch.uint8), ids, [c.view(torch.uint8) for c in expected])
    for got, want in zip(caches, expected, strict=True):
        assert torch.equal(bytes_of(got), bytes_of(want))


@MATRIX
@DTYPE_PARAMS
@SIZES
def test_gather_then_scatter_restores_only_selected_blocks(kind, dtype, block_size, num_blocks, gen):
    layout = make_layout(kind, dtype, block_size)
    total = num_blocks + 5
    caches = make_caches(layout, total, gen)
    ids = pick_ids(total, num_blocks, gen)
    packed = ops.gather_pages(caches, ids, poisoned_packed(layout, num_blocks), layout=layout)
    restored = make_caches(layout, total, gen, fill=0)
    ops.scatter_pages(packed, ids, restored, layout=layout)
    block_dim = kind.cache_dims.index("block")
    others = torch.tensor(sorted(set(range(total)) - set(ids.tolist())), dtype=torch.int64)
    for src, dst in zip(caches, restored, strict=True):
        dst_bytes = bytes_of(dst)
        assert torch.equal(dst_bytes.index_select(block_dim, ids), bytes_of(src).index_select(block_dim, ids))
        assert not dst_bytes.index_select(block_dim, others).any(), "a block that was not selected changed"


@MATRIX
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_id_dtypes_and_repeats_in_gather(kind, id_dtype, gen):
    layout = make_layout(kind)
    caches = make_caches(layout, 9, gen)
    ids = torch.tensor([4, 4, 0, 8, 4], dtype=id_dtype)
    out = ops.gather_pages(caches, ids, poisoned_packed(layout, 5), layout=layout)
    assert torch.equal(bytes_of(out), reference_gather(kind, caches, ids))


def test_empty_block_ids_is_a_no_op(gen):
    layout = make_layout(KVLayoutKind.VLLM_FLASH_NHD)
    caches = make_caches(layout, 4, gen)
    before = [c.clone() for c in caches]
    out = torch.empty(ops.packed_shape(layout, 0), dtype=layout.dtype)
    ops.gather_pages(caches, torch.empty(0, dtype=torch.int64), out, layout=layout)
    ops.scatter_pages(out, torch.empty(0, dtype=torch.int32), caches, layout=layout)
    assert all(torch.equal(bytes_of(a), bytes_of(b)) for a, b in zip(caches, before, strict=True))


def test_large_request_uses_threads_and_stays_exact(gen, monkeypatch):
    # 113 blocks x 3 layers x 64 KiB pages = 21 MiB: 2 threads' worth, taking 4-page chunks, 339 pages in all.
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)  # what ops passes to the kernel as its thread cap
    layout = make_layout(KVLayoutKind.VLLM_FLASH_NHD, torch.float32, block_size=64, heads=4, head_dim=32)
    caches = make_caches(layout, 120, gen)
    ids = pick_ids(120, 113, gen)
    out = ops.gather_pages(caches, ids, poisoned_packed(layout, 113), layout=layout)
    assert torch.equal(bytes_of(out), reference_gather(layout.kind, caches, ids))
    restored = make_caches(layout, 120, gen, fill=0)
    ops.scatter_pages(out, ids, restored, layout=layout)
    assert all(torch.equal(bytes_of(r.index_select(1, ids)), bytes_of(c.index_select(1, ids)))
               for r, c in zip(restored, caches, strict=True))


def test_foreign_strides_are_copied_correctly(gen):
    """An HND layout over NHD memory (and layer views of one big tensor) is exact, just not memcpy-wide."""
    layout = make_layout(KVLayoutKind.VLLM_FLASH_HND, torch.float16)
    big = random_bytes((2, 12, LAYERS, 16, HEADS, HEAD_DIM), torch.float16, gen)  # layers interleaved
    caches = [big[:, :, layer] for layer in range(LAYERS)]
    ids = pick_ids(12, 6, gen)
    out = ops.gather_pages(caches, ids, poisoned_packed(layout, 6), layout=layout)
    assert torch.equal(bytes_of(out), reference_gather(layout.kind, caches, ids))
    restored = torch.zeros_like(big)
    ops.scatter_pages(out, ids, [restored[:, :, layer] for layer in range(LAYERS)], layout=layout)
    assert torch.equal(bytes_of(restored[:, ids.long()]), bytes_of(big[:, ids.long()]))


@pytest.mark.parametrize("kind,runs,run_elems", [
    (KVLayoutKind.VLLM_FLASH_NHD, 2, 16 * HEADS * HEAD_DIM),  # one run per K and V
    (KVLayoutKind.VLLM_FLASH_HND, 2, 16 * HEADS * HEAD_DIM),
    (KVLayoutKind.FLASHINFER, 1, 2 * 16 * HEADS * HEAD_DIM),  # K and V adjacent: one run
    (KVLayoutKind.MLA, 1, 16 * HEAD_DIM),
], ids=lambda v: getattr(v, "name", str(v)))
def test_native_layouts_copy_as_few_long_runs(kind, runs, run_elems, gen):
    from kvstore import _C
    layout = make_layout(kind)
    cache = alloc_cache(layout, 4, gen=gen)
    block_dim = kind.cache_dims.index("block")
    dims = [kind.cache_dims.index(d) for d in kind.block_dims]
    plan = _C.describe_plan([cache.shape[d] for d in dims], [cache.stride(d) for d in dims], cache.element_size(),
                            cache.stride(block_dim), LAYERS, 4)
    assert (plan["runs_per_item"], plan["run_bytes"]) == (runs, run_elems * cache.element_size())


@pytest.mark.parametrize("streaming", [0, 1], ids=["cached-stores", "streaming-stores"])
@pytest.mark.parametrize("offset", [0, 3], ids=["aligned", "odd-offset"])
def test_both_store_paths_are_exact(streaming, offset, gen):
    """The size-based choice of cache-bypassing stores is forced both ways here, on awkward run lengths
    (40-byte MLA runs) and a packed buffer at an odd address."""
    from kvstore import _C
    layout = make_layout(KVLayoutKind.MLA, torch.float16, block_size=1, head_dim=20)
    caches = make_caches(layout, 30, gen)
    ids = pick_ids(30, 17, gen)
    nbytes = ops.packed_nbytes(layout, 17)
    arena = torch.full((nbytes + offset,), POISON, dtype=torch.uint8)
    out = arena[offset:]
    plan = dict(ids_int64=True, num_ids=17, num_cache_blocks=30, block_stride=caches[0].stride(0),
                dim_sizes=[1, 20], dim_strides=[20, 1], itemsize=2, num_threads=2, streaming=streaming)
    _C.gather_pages([c.data_ptr() for c in caches], ids.data_ptr(), packed=out.data_ptr(), **plan)
    assert torch.equal(out, reference_gather(layout.kind, caches, ids).flatten())
    restored = make_caches(layout, 30, gen, fill=0)
    _C.scatter_pages([c.data_ptr() for c in restored], ids.data_ptr(), packed=out.data_ptr(), **plan)
    assert all(torch.equal(bytes_of(r[ids]), bytes_of(c[ids])) for r, c in zip(restored, caches, strict=True))
    assert (arena[:offset] == POISON).all()


def test_extension_checks_ids_before_copying(gen):
    """The CPU extension is where CPU ids are checked: called directly, it still refuses bad ids."""
    from kvstore import _C
    layout = make_layout(KVLayoutKind.MLA, torch.float32)
    cache = alloc_cache(layout, 4, gen=gen)
    out = poisoned_packed(layout, 2)
    args = dict(layer_ptrs=[cache.data_ptr()] * LAYERS, ids_int64=True, num_ids=2, num_cache_blocks=4,
                block_stride=cache.stride(0), dim_sizes=[16, HEAD_DIM], dim_strides=[HEAD_DIM, 1], itemsize=4,
                packed=out.data_ptr())
    out_of_range, repeated = torch.tensor([0, 4]), torch.tensor([3, 3])
    with pytest.raises(ValueError, match=r"block_ids\[1\] = 4 is out of range: expected 0 <= id < 4"):
        _C.gather_pages(block_ids=out_of_range.data_ptr(), **args)
    with pytest.raises(ValueError, match=r"expected distinct ids for scatter, got 3 at positions \[0, 1\]"):
        _C.scatter_pages(block_ids=repeated.data_ptr(), **args)
    assert (out.view(torch.uint8) == POISON).all()


# -- torch.library integration ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", [KVLayoutKind.VLLM_FLASH_HND, KVLayoutKind.FLASHINFER, KVLayoutKind.MLA],
                         ids=lambda k: k.name)
def test_opcheck(kind, gen):
    layout = make_layout(kind, torch.float16)
    caches = make_caches(layout, 8, gen)
    ids = pick_ids(8, 3, gen)
    out = torch.empty(ops.packed_shape(layout, 3), dtype=layout.dtype)
    torch.library.opcheck(torch.ops.kvstore.gather_pages.default, (caches, ids, out, kind.value))
    src = random_bytes(ops.packed_shape(layout, 3), layout.dtype, gen)
    torch.library.opcheck(torch.ops.kvstore.scatter_pages.default, (src, ids, caches, kind.value))


def test_torch_compile_matches_eager(gen):
    layout = make_layout(KVLayoutKind.VLLM_FLASH_NHD, torch.float32)
    caches = [torch.randn(layout.cache_shape(10), generator=gen) for _ in range(LAYERS)]
    ids = pick_ids(10, 4, gen)

    def move(src_caches, dst_caches, block_ids):
        packed = torch.empty(ops.packed_shape(layout, block_ids.shape[0]), dtype=layout.dtype)
        ops.gather_pages(src_caches, block_ids, packed, layout=layout)
        ops.scatter_pages(packed * 2, block_ids, dst_caches, layout=layout)
        return packed.sum()

    eager_dst = [torch.zeros_like(c) for c in caches]
    compiled_dst = [torch.zeros_like(c) for c in caches]
    eager_sum = move(caches, eager_dst, ids)
    compiled_sum = torch.compile(move, fullgraph=True, backend="aot_eager")(caches, compiled_dst, ids)
    assert torch.equal(eager_sum, compiled_sum)
    assert all(torch.equal(a, b) for a, b in zip(eager_dst, compiled_dst, strict=True))
    assert any(d.any() for d in compiled_dst)


# -- validation -------------------------------------------------------------------------------------------------
@pytest.fixture
def setup(gen):
    layout = make_layout(KVLayoutKind.VLLM_FLASH_NHD, torch.float16)
    caches = make_caches(layout, 8, gen)
    ids = torch.tensor([1, 5, 2])
    return layout, caches, ids, poisoned_packed(layout, 3)


def assert_untouched(out: torch.Tensor) -> None:
    assert (out.view(torch.uint8) == POISON).all(), "a failed call must not copy anything"


def test_rejects_non_layout(setup):
    _, caches, ids, out = setup
    with pytest.raises(TypeError, match="layout must be a kvstore.KVLayout, got str"):
        ops.gather_pages(caches, ids, out, layout="vllm_flash_nhd")


def test_rejects_single_tensor_as_caches(setup):
    layout, caches, ids, out = setup
    with pytest.raises(TypeError, match="kv_caches must be a list of tensors"):
        ops.gather_pages(caches[0], ids, out, layout=layout)


def test_rejects_wrong_layer_count(setup):
    layout, caches, ids, out = setup
    with pytest.raises(ValueError, match=r"expected 3 layers \(layout.num_layers\), got 2"):
        ops.gather_pages(caches[:2], ids, out, layout=layout)


def test_rejects_cache_dtype_not_of_layout(setup):
    layout, caches, ids, out = setup
    with pytest.raises(TypeError, match=r"kv_caches\[0\]: expected dtype torch.float16 \(layout.dtype\), got "
                                        r"torch.bfloat16"):
        ops.gather_pages([c.view(torch.bfloat16) for c in caches], ids, out, layout=layout)
    caches[1] = caches[1].view(torch.bfloat16)
    with pytest.raises(TypeError, match=r"kv_caches\[1\]: expected the dtype of kv_caches\[0\], torch.float16, "
                                        r"got torch.bfloat16"):
        ops.gather_pages(caches, ids, out, layout=layout)
    assert_untouched(out)


def test_rejects_cache_shape_not_of_layout(setup):
    layout, caches, ids, out = setup
    with pytest.raises(ValueError, match=r"kv_caches\[0\]: expected shape \(2, 'num_blocks', 16, 2, 32\) .*"
                                         r"got \(2, 8, 16, 2, 16\)"):
        ops.gather_pages([c[..., :16] for c in caches], ids, out, layout=layout)
    caches[2] = caches[2][..., :16]
    with pytest.raises(ValueError, match=r"kv_caches\[2\]: expected the shape of kv_caches\[0\], "
                                         r"torch.Size\(\[2, 8, 16, 2, 32\]\), got torch.Size\(\[2, 8, 16, 2, 16\]\)"):
        ops.gather_pages(caches, ids, out, layout=layout)
    assert_untouched(out)


def test_op_rejects_caches_that_disagree(setup, gen):
    layout, caches, ids, out = setup
    caches[1] = alloc_cache(layout, 9, gen=gen)
    with pytest.raises(ValueError, match=r"kv_caches\[1\]: expected the shape of kv_caches\[0\]"):
        ops.gather_pages(caches, ids, out, layout=layout)
    caches[1] = alloc_cache(make_layout(KVLayoutKind.VLLM_FLASH_HND, torch.float16), 8, gen=gen)
    with pytest.raises(ValueError, match=r"kv_caches\[1\]: expected the stride of kv_caches\[0\]"):
        ops.gather_pages(caches, ids, out, layout=layout)
    assert_untouched(out)


def test_rejects_unsupported_device(setup):
    layout, _, ids, _ = setup
    caches = [torch.empty(layout.cache_shape(8), dtype=layout.dtype, device="meta") for _ in range(LAYERS)]
    out = torch.empty(ops.packed_shape(layout, 3), dtype=layout.dtype, device="meta")
    with pytest.raises(ValueError, match="expected a cpu or cuda tensor, got device meta"):
        torch.ops.kvstore.gather_pages(caches, ids.to("meta"), out, layout.kind.value)


@pytest.mark.parametrize("bad,error,message", [
    ([1, 5, 2], TypeError, "block_ids must be a torch.Tensor of int32/int64, got list"),
    (torch.tensor([1.0, 5.0, 2.0]), TypeError, "expected dtype torch.int32 or torch.int64, got torch.float32"),
    (torch.tensor([True, False, True]), TypeError, "expected dtype torch.int32 or torch.int64, got torch.bool"),
    (torch.tensor([[1, 5, 2]]), ValueError, r"expected a 1-D tensor, got shape \(1, 3\)"),
    (torch.tensor([1, 8, 2]), ValueError, r"block_ids\[1\] = 8 is out of range: expected 0 <= id < 8"),
    (torch.tensor([1, 5, -1], dtype=torch.int32), ValueError, r"block_ids\[2\] = -1 is out of range"),
], ids=["list", "float", "bool", "2d", "too-big", "negative"])
def test_rejects_bad_block_ids(setup, bad, error, message):
    layout, caches, _, out = setup
    with pytest.raises(error, match=message):
        ops.gather_pages(caches, bad, out, layout=layout)
    assert_untouched(out)


def test_scatter_rejects_repeated_ids(setup, gen):
    layout, caches, _, _ = setup
    before = [c.clone() for c in caches]
    src = random_bytes(ops.packed_shape(layout, 3), layout.dtype, gen)
    with pytest.raises(ValueError, match=r"expected distinct ids for scatter, got 5 at positions \[0, 2\]"):
        ops.scatter_pages(src, torch.tensor([5, 1, 5]), caches, layout=layout)
    assert all(torch.equal(bytes_of(a), bytes_of(b)) for a, b in zip(caches, before, strict=True))


@pytest.mark.parametrize("make_out,error,message", [
    (lambda lay: torch.empty(ops.packed_shape(lay, 2), dtype=lay.dtype), ValueError,
     r"out: expected packed shape \(3, 3, 2, 16, 2, 32\) .*got \(2, 3, 2, 16, 2, 32\)"),
    (lambda lay: torch.empty(ops.packed_shape(lay, 3), dtype=torch.float32), TypeError,
     "out: expected dtype torch.float16 .*got torch.float32"),
    (lambda lay: torch.empty(ops.packed_shape(lay, 3)[::-1], dtype=lay.dtype).permute(5, 4, 3, 2, 1, 0), ValueError,
     "out: expected a contiguous tensor"),
    (lambda lay: ops.packed_shape(lay, 3), TypeError, "out must be a torch.Tensor, got tuple"),
], ids=["shape", "dtype", "strided", "not-a-tensor"])
def test_rejects_bad_packed_buffer(setup, make_out, error, message):
    layout, caches, ids, _ = setup
    with pytest.raises(error, match=message):
        ops.gather_pages(caches, ids, make_out(layout), layout=layout)


def test_rejects_overlap_between_packed_and_cache(gen):
    layout = make_layout(KVLayoutKind.FLASHINFER, torch.float32)
    cache_numel = 8 * layout.page_nbytes // 4
    arena = torch.zeros(cache_numel * LAYERS, dtype=torch.float32)
    caches = [arena[i * cache_numel:(i + 1) * cache_numel].view(layout.cache_shape(8)) for i in range(LAYERS)]
    out = arena[cache_numel // 2:].view(-1)[: 2 * layout.block_nbytes // 4].view(ops.packed_shape(layout, 2))
    ids = torch.tensor([6, 7])
    with pytest.raises(ValueError, match=r"out overlaps kv_caches\[0\] in memory"):
        ops.gather_pages(caches, ids, out, layout=layout)
    with pytest.raises(ValueError, match=r"src overlaps kv_caches\[0\] in memory"):
        ops.scatter_pages(out, ids, caches, layout=layout)
    assert not arena.any()


def test_rejects_ids_inside_the_destination(gen):
    layout = make_layout(KVLayoutKind.MLA, torch.float32, block_size=1, head_dim=2)
    caches = make_caches(layout, 8, gen, fill=0)
    out = torch.zeros(ops.packed_shape(layout, 2), dtype=torch.float32)
    ids_in_out = out.view(-1)[:4].view(torch.int64)[:2]
    with pytest.raises(ValueError, match="block_ids overlaps out in memory"):
        ops.gather_pages(caches, ids_in_out, out, layout=layout)
    ids_in_cache = caches[1].view(-1)[:4].view(torch.int64)[:2]
    ids_in_cache.copy_(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"block_ids overlaps kv_caches\[1\] in memory"):
        ops.scatter_pages(out, ids_in_cache, caches, layout=layout)


def test_scatter_rejects_aliased_destinations(setup, gen):
    layout, caches, ids, _ = setup
    src = random_bytes(ops.packed_shape(layout, 3), layout.dtype, gen)
    with pytest.raises(ValueError, match=r"kv_caches\[0\] and kv_caches\[2\] are the same memory"):
        ops.scatter_pages(src, ids, [caches[0], caches[1], caches[0]], layout=layout)
    expanded = [torch.zeros(1, dtype=layout.dtype).expand(layout.cache_shape(8)) for _ in range(LAYERS)]
    with pytest.raises(ValueError, match="expected non-overlapping strides"):
        ops.scatter_pages(src, ids, expanded, layout=layout)


def test_packed_shape_and_nbytes():
    layout = KVLayout(kind=KVLayoutKind.VLLM_FLASH_NHD, num_layers=32, num_kv_heads=8, head_dim=128,
                      block_size=16, dtype=torch.bfloat16, model_id="llama-3-8b")
    assert ops.packed_shape(layout, 5) == (5, 32, 2, 16, 8, 128)
    assert ops.packed_nbytes(layout, 5) == 5 * 32 * 2 * 16 * 8 * 128 * 2
    mla = make_layout(KVLayoutKind.MLA, head_dim=576)
    assert ops.packed_shape(mla, 2) == (2, LAYERS, 16, 576)
    with pytest.raises(ValueError, match="num_blocks must be an int >= 0, got -1"):
        ops.packed_shape(layout, -1)


@pytest.mark.parametrize("kind,index,offset", [
    (KVLayoutKind.VLLM_FLASH_NHD, (2, 10, 0, 5, 3, 0), 2_430_336),
    (KVLayoutKind.VLLM_FLASH_HND, (2, 10, 0, 3, 5, 0), 4_863_232 // 2),
], ids=lambda v: getattr(v, "name", None))
def test_worked_example_of_docs(kind, index, offset):
    """docs/kv_layout.md: token 37 (head 3, dim 0, K, layer 10) of a request with blocks [7, 3, 12]."""
    layout = KVLayout(kind=kind, num_layers=32, num_kv_heads=8, head_dim=128, block_size=16,
                      dtype=torch.bfloat16, model_id="llama-3-8b")
    caches = [alloc_cache(layout, 13, fill=0) for _ in range(32)]
    caches[10][0, 12, 5, 3, 0] = 42.0  # logical [2, N, B, H, D] indexing for both vLLM kinds
    packed = ops.gather_pages(caches, torch.tensor([7, 3, 12]), torch.empty(ops.packed_shape(layout, 3),
                              dtype=layout.dtype), layout=layout)
    assert packed[index] == 42.0
    assert packed.view(-1)[offset] == 42.0 and packed.count_nonzero() == 1
