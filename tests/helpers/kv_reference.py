"""The pure-torch reference of paged-KV packing that the ops tests (CPU, CUDA) and the store's page tests share.

Written per layout kind on purpose (not derived from kvstore.layout's tables), so a mistake in those tables
shows up in the tests. Comparisons are bit-exact on byte views.
"""

from __future__ import annotations

import torch

from kvstore import KVLayout, KVLayoutKind, ops

KINDS = list(KVLayoutKind)
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]
LAYERS, HEADS, HEAD_DIM = 3, 2, 32
POISON = 0xA5


def make_layout(kind: KVLayoutKind, dtype=torch.bfloat16, block_size: int = 16, layers: int = LAYERS,
                heads: int = HEADS, head_dim: int = HEAD_DIM) -> KVLayout:
    if kind is KVLayoutKind.MLA:
        heads = 1
    return KVLayout(kind=kind, num_layers=layers, num_kv_heads=heads, head_dim=head_dim, block_size=block_size,
                    dtype=dtype, model_id="test-model")


def random_bytes(shape, dtype, gen: torch.Generator, device="cpu") -> torch.Tensor:
    """Random bits of any dtype (NaN/inf patterns included: the ops move raw bytes)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * itemsize), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).to(device)


def alloc_cache(layout: KVLayout, num_blocks: int, device="cpu", fill=None, gen=None) -> torch.Tensor:
    """One layer's cache as each engine allocates it (vLLM HND: an NHD-shaped view of HND memory)."""
    bs, h, d = layout.block_size, layout.num_kv_heads, layout.head_dim
    physical = {
        KVLayoutKind.VLLM_FLASH_NHD: (2, num_blocks, bs, h, d),
        KVLayoutKind.VLLM_FLASH_HND: (2, num_blocks, h, bs, d),
        KVLayoutKind.FLASHINFER: (num_blocks, 2, bs, h, d),
        KVLayoutKind.FLASHINFER_HND: (num_blocks, 2, h, bs, d),
        KVLayoutKind.MLA: (num_blocks, bs, d),
        KVLayoutKind.VLLM_HNC: (num_blocks, h, bs, 2 * d),
        KVLayoutKind.VLLM_NHC: (num_blocks, bs, h, 2 * d),  # token-major memory under the [N, H, B, C] view
    }[layout.kind]
    if fill is None:
        t = random_bytes(physical, layout.dtype, gen, device)
    else:
        raw_shape = (*physical[:-1], physical[-1] * layout.itemsize)
        t = torch.full(raw_shape, fill, dtype=torch.uint8, device=device).view(layout.dtype)
    if layout.kind is KVLayoutKind.VLLM_FLASH_HND:
        return t.transpose(2, 3)
    return t.transpose(1, 2) if layout.kind is KVLayoutKind.VLLM_NHC else t


def make_caches(layout: KVLayout, num_blocks: int, gen, device="cpu", fill=None) -> list[torch.Tensor]:
    return [alloc_cache(layout, num_blocks, device, fill, gen) for _ in range(layout.num_layers)]


def reference_block_views(kind: KVLayoutKind, cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[n, *block_shape] selection of one layer, written out per kind."""
    ids = ids.long()
    if kind is KVLayoutKind.VLLM_FLASH_NHD:
        return cache.index_select(1, ids).permute(1, 0, 2, 3, 4)
    if kind is KVLayoutKind.VLLM_FLASH_HND:
        return cache.index_select(1, ids).permute(1, 0, 3, 2, 4)
    if kind is KVLayoutKind.VLLM_NHC:  # logical [N, H, B, C], packed [B, H, C]
        return cache.index_select(0, ids).permute(0, 2, 1, 3)
    return cache.index_select(0, ids)  # FlashInfer (both), MLA and VLLM_HNC keep the block dim first


def reference_gather(kind: KVLayoutKind, caches, ids) -> torch.Tensor:
    """Expected packed bytes (compare with ``bytes_of(out)``); works on byte views, so any dtype and device."""
    return torch.stack([reference_block_views(kind, c.view(torch.uint8), ids) for c in caches], dim=1)


def reference_scatter(kind: KVLayoutKind, src: torch.Tensor, ids: torch.Tensor, caches) -> None:
    """index_copy_ per layer; pass byte views (``t.view(torch.uint8)``) to stay bit-exact for any dtype."""
    ids = ids.long()
    for layer, cache in enumerate(caches):
        blocks = src[:, layer]
        if kind is KVLayoutKind.VLLM_FLASH_NHD:
            cache.index_copy_(1, ids, blocks.permute(1, 0, 2, 3, 4))
        elif kind is KVLayoutKind.VLLM_FLASH_HND:
            cache.index_copy_(1, ids, blocks.permute(1, 0, 3, 2, 4))
        elif kind is KVLayoutKind.VLLM_NHC:
            cache.index_copy_(0, ids, blocks.permute(0, 2, 1, 3))
        else:
            cache.index_copy_(0, ids, blocks)


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern of a tensor as uint8 (the last dim scaled by the itemsize): NaN-safe, bit-exact equality."""
    return t.contiguous().view(torch.uint8)


def poisoned_packed(layout: KVLayout, n: int, device="cpu") -> torch.Tensor:
    shape = ops.packed_shape(layout, n)
    return torch.full(shape[:-1] + (shape[-1] * layout.itemsize,), POISON, dtype=torch.uint8,
                      device=device).view(layout.dtype)


def pick_ids(num_cache_blocks: int, n: int, gen, dtype=torch.int64, device="cpu") -> torch.Tensor:
    return torch.randperm(num_cache_blocks, generator=gen)[:n].to(dtype=dtype, device=device)
