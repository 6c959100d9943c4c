"""The layout mapping for vLLM 0.32's attention backends, computed from vLLM's own code: each backend's
``supported_kv_cache_layouts()`` (every layout where it declares none), caches allocated by vLLM's
``compute_layout_strides`` / ``create_kv_cache_views`` (what ``register_kv_caches`` receives), K and V read as
FlashAttention reads them. Backends whose module needs a CUDA build to import (FlashInfer, Cutlass MLA,
FlashAttention MLA, FlashInfer MLA) are covered by the layouts they can be given, which this test runs all of."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    SlidingWindowSpec,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvstore import ops  # noqa: E402
from kvstore.errors import UnsupportedKVCacheError  # noqa: E402
from kvstore.integrations.vllm import cache_layouts, keys  # noqa: E402
from kvstore.integrations.vllm.block_io import BlockIO  # noqa: E402
from kvstore.layout import KVLayoutKind  # noqa: E402

L, NB, BS, H, D = 3, 10, 16, 2, 64
BACKENDS = {  # module under vllm.v1.attention.backends -> class; importable on a CPU build of vLLM
    "flash_attn": "FlashAttentionBackend", "triton_attn": "TritonAttentionBackend",
    "flex_attention": "FlexAttentionBackend", "cpu_attn": "CPUAttentionBackend",
    "mla.flashmla": "FlashMLABackend", "mla.triton_mla": "TritonMLABackend",
}


def backend_cases() -> list[tuple[str, str]]:
    cases = []
    for module, cls in BACKENDS.items():
        backend = getattr(importlib.import_module(f"vllm.v1.attention.backends.{module}"), cls)
        layouts = backend.supported_kv_cache_layouts() or list(KVCacheLayout)
        cases += [(module, layout.name) for layout in layouts]
    return cases


def spec_of(module: str):
    if module.startswith("mla."):
        return MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    return FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.bfloat16)


def vllm_views(spec, layout_name: str, seed: int) -> list[torch.Tensor]:
    """The per-layer caches exactly as vLLM 0.32 allocates them for ``layout_name``."""
    layout = KVCacheLayout[layout_name]
    layer_stride, block_stride, *_ = compute_layout_strides(spec, NB, L, layout)
    size = NB * L * spec.page_size_bytes
    raw = torch.randint(-128, 127, (size,), dtype=torch.int8, generator=torch.Generator().manual_seed(seed))
    tensor = KVCacheTensor(size=size, layers=[f"l{i}" for i in range(L)], layer_stride=layer_stride,
                           block_stride=block_stride)
    return create_kv_cache_views(raw, spec, NB, layout, tensor)


def cache_layout(spec, layout_name: str) -> keys.CacheLayout:
    geometry = cache_layouts.page_geometry(
        layout_name, mla=isinstance(spec, MLAAttentionSpec), heads=spec.num_heads, tokens=spec.block_size,
        content_bytes=spec.state_content_size_bytes, dtype="bfloat16", itemsize=2)
    return keys.CacheLayout(backend="CUDA/auto", packing="kv-content", cache_layout=layout_name, dtype="bfloat16",
                            kv_cache_dtype="auto", block_size=BS, num_layers=L, num_kv_heads=spec.num_kv_heads,
                            head_size=spec.head_size, page_shape=geometry.page_shape, model="m", revision="",
                            tp_rank=0, tp_size=1, kind=geometry.kind.value)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact (the caches hold random bits, NaN patterns included)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def gather(io: BlockIO, block_ids: list[int]) -> torch.Tensor:
    """Blocks ``block_ids`` of every layer, in the kind's packed order (what a save writes into the store)."""
    packed = torch.empty(ops.packed_shape(io._kernel_layout, len(block_ids)), dtype=io._kernel_layout.dtype)
    return ops.gather_pages(io._pages, io._ids(block_ids), packed, layout=io._kernel_layout)


def k_and_v(view: torch.Tensor, block: int, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's K and V as vLLM's FlashAttention backend reads them: [N, H, D] each."""
    key, value = view[block:block + 1].transpose(1, 2).split(head_size, dim=-1)
    return key[0], value[0]


@pytest.mark.parametrize("module,layout_name", backend_cases())
def test_every_backend_layout_maps_to_a_kind_that_moves_its_blocks_exactly(module, layout_name):
    spec = spec_of(module)
    layout = cache_layout(spec, layout_name)
    mla = isinstance(spec, MLAAttentionSpec)
    expected_kind = KVLayoutKind.MLA if mla else cache_layouts.LAYOUT_KINDS[layout_name]
    assert layout.kind == expected_kind.value
    src = vllm_views(spec, layout_name, 1)
    packed = gather(BlockIO(src, layout), [7, 2])
    assert packed.numel() * packed.element_size() == 2 * layout.block_nbytes
    page = packed[0, 1].contiguous()  # block 7, layer 1, in the kind's packed order
    expected = src[1][7] if mla or expected_kind is KVLayoutKind.VLLM_HNC else src[1][7].transpose(0, 1)
    assert same(page.reshape(-1), expected.reshape(-1) if not mla else expected[0].reshape(-1))
    # Scatter into another engine that resolved another layout of the same kind: K and V arrive intact.
    peers = [n for n, kind in cache_layouts.LAYOUT_KINDS.items() if mla or kind is expected_kind]
    peer = peers[-1] if peers[-1] != layout_name else peers[0]
    dst = vllm_views(spec, peer, 2)
    io = BlockIO(dst, cache_layout(spec, peer))
    io._scatter(packed, [("a", 4), ("b", 9)], [0, 1])
    for s_block, d_block in ((7, 4), (2, 9)):
        for layer in range(L):
            if mla:
                assert same(dst[layer][d_block], src[layer][s_block])
            else:
                for a, b in zip(k_and_v(dst[layer], d_block, D), k_and_v(src[layer], s_block, D), strict=True):
                    assert same(a, b)


@pytest.mark.parametrize("name,kind", [("NHD", "vllm_nhc"), ("HND", "vllm_hnc"), ("lbnhc", "vllm_nhc")])
def test_vllm_layout_aliases(name, kind):
    geometry = cache_layouts.page_geometry(name, mla=False, heads=H, tokens=BS, content_bytes=4 * D, dtype="float16",
                                           itemsize=2)
    assert geometry.kind.value == kind


def test_unsupported_layout_and_dtype_name_what_was_expected():
    with pytest.raises(UnsupportedKVCacheError, match=r"layout 'XYZ' .* expected one of LBHNC, BLHNC"):
        cache_layouts.page_geometry("XYZ", mla=False, heads=H, tokens=BS, content_bytes=256, dtype="float16",
                                    itemsize=2)
    with pytest.raises(UnsupportedKVCacheError, match="dtype int32 .* expected one of float16, bfloat16"):
        cache_layouts.page_geometry("LBHNC", mla=False, heads=H, tokens=BS, content_bytes=256, dtype="int32",
                                    itemsize=4)
    with pytest.raises(UnsupportedKVCacheError, match="runs on cpu and cuda platforms; this one is 'xpu'"):
        cache_layouts.check_platform("xpu")


def _configs(spec, layout_name: str | None = "LBNHC"):
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(cache_dtype="auto", kv_cache_layout=None),
        model_config=SimpleNamespace(model="/models/m", revision=None, dtype=torch.bfloat16),
        parallel_config=SimpleNamespace(tensor_parallel_size=2), attention_config=SimpleNamespace(backend=None))
    group = SimpleNamespace(kv_cache_spec=spec, layer_names=[f"l{i}" for i in range(L)])
    return vllm_config, SimpleNamespace(kv_cache_groups=[group], kv_cache_layout=layout_name)


@pytest.fixture
def cuda_platform(monkeypatch):
    """vLLM's platform object as a CUDA build reports it (the CPU build cannot construct CudaPlatform)."""
    import vllm.platforms

    fake = SimpleNamespace(device_type="cuda", is_cpu=lambda: False)
    monkeypatch.setattr(vllm.platforms, "current_platform", fake)
    return fake


def test_layout_from_vllm_config_accepts_cuda_platforms(cuda_platform):
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
    layout = keys.layout_from_vllm_config(*_configs(spec), tp_rank=1)
    assert (layout.kind, layout.page_shape, layout.backend, layout.tp_rank) == ("vllm_nhc", (BS, H, 2 * D),
                                                                                "CUDA/auto", 1)
    assert layout.block_nbytes == L * BS * H * 2 * D * 2
    mla = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=576, dtype=torch.uint8)  # fp8 cache
    layout = keys.layout_from_vllm_config(*_configs(mla, "BLHNC"))
    assert (layout.kind, layout.page_shape, layout.dtype) == ("mla", (BS, 576), "uint8")
    nhc = keys.layout_from_vllm_config(*_configs(spec, "BLNHC"))  # same packed kind: blocks are shared
    hnc = keys.layout_from_vllm_config(*_configs(spec, "LBHNC"))
    assert nhc.kind == "vllm_nhc" and hnc.kind == "vllm_hnc" and nhc.fingerprint() != hnc.fingerprint()
    assert nhc.fingerprint() == keys.layout_from_vllm_config(*_configs(spec, "LBNHC")).fingerprint()


def test_unsupported_caches_are_refused_before_anything_is_registered(cuda_platform):
    window = SlidingWindowSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.bfloat16, sliding_window=64)
    with pytest.raises(UnsupportedKVCacheError, match="moves FullAttentionSpec and MLAAttentionSpec caches; this "
                                                      "model's cache is SlidingWindowSpec"):
        keys.layout_from_vllm_config(*_configs(window))
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.float64)
    with pytest.raises(UnsupportedKVCacheError, match="dtype float64"):
        keys.layout_from_vllm_config(*_configs(spec))
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedKVCacheError, match="has not resolved the KV cache layout"):
        keys.layout_from_vllm_config(*_configs(spec, None))
    cuda_platform.device_type = "xpu"
    with pytest.raises(UnsupportedKVCacheError, match="this one is 'xpu'"):
        keys.layout_from_vllm_config(*_configs(spec))
