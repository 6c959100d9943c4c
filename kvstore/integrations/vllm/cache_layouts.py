"""How vLLM (>= 0.32) lays out each layer's KV cache, and the :class:`~kvstore.layout.KVLayoutKind` its pages pack as.

vLLM 0.32 gives every attention backend (FlashAttention, FlashInfer, Triton, FlexAttention, the CPU backend and
the MLA backends) one cache shape: per layer a logical ``[B, H, N, C]`` view (blocks, KV heads or head slots,
tokens of a block, content) of one shared allocation, where ``C`` holds one head's K then V for one token
(``head_size + head_size_v`` elements; MLA: ``H = 1`` and ``C`` is the latent). The backend-specific part is
only the memory order, a :class:`vllm.v1.kv_cache_layout.KVCacheLayout` resolved once per engine from the
backends' ``supported_kv_cache_layouts()`` (and ``VLLM_KV_CACHE_LAYOUT``), a permutation of ``[L, B, H, N, C]``.
The ``get_kv_cache_shape`` / ``get_kv_cache_stride_order`` methods of earlier vLLM versions are gone.

kvstore packs a page in the order its memory holds it, so that a page of a block-compact layout is one copy:

| vLLM layout | memory order | kind | packed page |
|---|---|---|---|
| ``LBHNC``, ``BLHNC`` (head-major; CPU backend, FlashInfer on SM100) | H, N, C | ``VLLM_HNC`` | ``[H, N, C]`` |
| ``LHBNC``, ``BHLNC`` (heads outside the block) | H, N, C in ``H`` runs | ``VLLM_HNC`` | ``[H, N, C]`` |
| ``LBNHC``, ``BLNHC`` (token-major; vLLM's default, FlexAttention) | N, H, C | ``VLLM_NHC`` | ``[N, H, C]`` |
| any of the above, MLA spec | N, C | ``MLA`` | ``[N, C]`` |

So the packed bytes depend on the kind, never on where the layers sit: an ``LBHNC`` engine and a ``BLHNC``
engine exchange blocks. No vLLM import here: callers pass names and numbers read off vLLM's objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstore.errors import UnsupportedKVCacheError
from kvstore.keys import DTYPE_ITEMSIZE
from kvstore.layout import KVLayout, KVLayoutKind

LAYOUT_KINDS: dict[str, KVLayoutKind] = {
    "LBHNC": KVLayoutKind.VLLM_HNC, "BLHNC": KVLayoutKind.VLLM_HNC, "LHBNC": KVLayoutKind.VLLM_HNC,
    "BHLNC": KVLayoutKind.VLLM_HNC, "LBNHC": KVLayoutKind.VLLM_NHC, "BLNHC": KVLayoutKind.VLLM_NHC,
}
# vLLM's own aliases (VLLM_KV_CACHE_LAYOUT=NHD / HND).
LAYOUT_ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}
# The cache dtypes kvstore moves (kvstore.keys.DTYPE_ITEMSIZE); vLLM keeps fp8 caches ("fp8", "fp8_e4m3",
# "fp8_e5m2", "fp8_ds_mla") as uint8, moved as raw bytes.
DTYPES = tuple(DTYPE_ITEMSIZE)
PLATFORMS = ("cpu", "cuda")


@dataclass(frozen=True, slots=True)
class PageGeometry:
    """One layer's page as vLLM views it: ``heads`` (H), ``tokens`` (N), ``content`` (C, in elements)."""

    kind: KVLayoutKind
    heads: int
    tokens: int
    content: int
    dtype: str

    @property
    def page_shape(self) -> tuple[int, ...]:
        """The packed page, outermost first."""
        if self.kind is KVLayoutKind.MLA:
            return (self.tokens, self.content)
        if self.kind is KVLayoutKind.VLLM_NHC:
            return (self.tokens, self.heads, self.content)
        return (self.heads, self.tokens, self.content)

    @property
    def view_shape(self) -> tuple[int, ...]:
        """vLLM's per-layer logical view without the block dim: ``(H, N, C)``."""
        return (self.heads, self.tokens, self.content)

    def kernel_fields(self, num_layers: int, model: str) -> dict[str, Any]:
        """:meth:`kernel_layout` as :meth:`KVLayout.to_dict` writes it (no torch needed)."""
        dtype = "float8_e4m3fn" if self.dtype == "uint8" else self.dtype
        mla = self.kind is KVLayoutKind.MLA
        return {"kind": self.kind.value, "num_layers": num_layers, "num_kv_heads": 1 if mla else self.heads,
                "head_dim": self.content if mla else self.content // 2, "block_size": self.tokens, "dtype": dtype,
                "model_id": model or "vllm", "tp_rank": 0, "tp_size": 1}

    def kernel_layout(self, num_layers: int, model: str) -> KVLayout:
        """The :class:`KVLayout` the page kernels move these pages with (uint8 caches as float8 raw bytes)."""
        return KVLayout.from_dict(self.kernel_fields(num_layers, model))


def layout_name(value: Any) -> str:
    """The canonical name of a vLLM KV-cache layout (an enum member, its name or an alias)."""
    name = getattr(value, "name", value)
    name = LAYOUT_ALIASES.get(str(name).upper(), str(name).upper())
    if name not in LAYOUT_KINDS:
        raise UnsupportedKVCacheError(f"vLLM KV cache layout {value!r} is not supported by kvstore's connector; "
                                      f"expected one of {', '.join(LAYOUT_KINDS)} (or the aliases NHD, HND)")
    return name


def page_geometry(layout: Any, *, mla: bool, heads: int, tokens: int, content_bytes: int, dtype: str,
                  itemsize: int) -> PageGeometry:
    """The kind and page of a cache group: vLLM ``layout``, whether the spec is MLA, the spec's ``num_heads``,
    states per block, ``state_content_size_bytes``, dtype name and its size. UnsupportedKVCacheError names
    what was expected for anything the page kernels cannot move exactly."""
    name = layout_name(layout)
    if dtype not in DTYPES:
        raise UnsupportedKVCacheError(f"KV cache dtype {dtype} is not supported by kvstore's connector; expected "
                                      f"one of {', '.join(DTYPES)}")
    if content_bytes % itemsize:
        raise UnsupportedKVCacheError(f"KV cache content of {content_bytes} bytes per head and token is not a "
                                      f"whole number of {dtype} elements")
    content = content_bytes // itemsize
    if mla:
        if heads != 1:
            raise UnsupportedKVCacheError(f"MLA KV cache with {heads} head slots; expected 1 (one latent per token)")
        return PageGeometry(KVLayoutKind.MLA, 1, tokens, content, dtype)
    if content % 2:
        raise UnsupportedKVCacheError(f"KV cache content of {content} elements per head and token; expected an "
                                      "even number (K then V of equal width)")
    return PageGeometry(LAYOUT_KINDS[name], heads, tokens, content, dtype)


def check_platform(device_type: str) -> None:
    if device_type not in PLATFORMS:
        raise UnsupportedKVCacheError(f"kvstore's vLLM connector runs on {' and '.join(PLATFORMS)} platforms; "
                                      f"this one is {device_type!r}")


def geometry_of(layout: Any) -> PageGeometry:
    """The :class:`PageGeometry` of a :class:`~kvstore.integrations.vllm.keys.CacheLayout` (its kind and page)."""
    kind = KVLayoutKind.parse(layout.kind)
    shape = tuple(layout.page_shape)
    if kind is KVLayoutKind.MLA:
        tokens, content = shape
        return PageGeometry(kind, 1, tokens, content, layout.dtype)
    heads, tokens, content = shape if kind is KVLayoutKind.VLLM_HNC else (shape[1], shape[0], shape[2])
    return PageGeometry(kind, heads, tokens, content, layout.dtype)
