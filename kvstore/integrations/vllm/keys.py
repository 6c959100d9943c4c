"""The vLLM connector's side of the paged-KV key scheme (:mod:`kvstore.keys`): what vLLM's cache layout is.

A block's key names everything that decides its bytes: the tokens up to and including it (the chained digest
of :func:`kvstore.keys.block_hashes`, rooted in the request's ``cache_salt`` and LoRA adapter), and the layout
of the cache it came from (:class:`CacheLayout`: model, dtype, block size, attention backend and its in-page
packing, geometry, TP rank and size). Two engines share a key only if they would have computed the same
bytes, so a consumer with another dtype, block size or kernel packing never gets a false hit.

The fingerprint is that of :meth:`CacheLayout.kv_layout`, a :class:`~kvstore.layout.KVLayout` that carries
the fields beyond its geometry in ``engine``; the block keys are :func:`kvstore.keys.block_key`. So a
:class:`~kvstore.handoff.KVHandoff` built with ``CacheLayout.kv_layout()`` and ``chunk_blocks=1`` publishes
blocks this connector loads, and finds the blocks it saves (``docs/keys.md``). The key functions are
re-exported here under the names the connector always had.

No vLLM import at module level: the scheduler and worker halves pass a ``VllmConfig`` in.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from kvstore.errors import UnsupportedKVCacheError
from kvstore.integrations.vllm.cache_layouts import LAYOUT_KINDS, check_platform, geometry_of, page_geometry
from kvstore.keys import (
    KEY_PREFIX,
    PROMPT_ROOT,
    SCHEME_VERSION,
    block_hashes,
    block_key,
    dtype_itemsize,
    layout_fingerprint,
    prompt_block_keys,
    prompt_root,
)
from kvstore.layout import KVLayout

#: The key scheme's version (:data:`kvstore.keys.SCHEME_VERSION`); 2 was this connector's own scheme.
KEY_VERSION = SCHEME_VERSION
#: Where the connector keeps what is not a block: ``vllm/<fingerprint>/layout``, ``vllm/layouts/...``.
META_PREFIX = "vllm"
_PERSON = b"kvstore.vllm"
#: The fields of :class:`CacheLayout` that :meth:`CacheLayout.kv_layout` maps onto KVLayout fields; every other
#: one goes into ``KVLayout.engine``.
_GEOMETRY_FIELDS = ("num_layers", "model", "tp_rank", "tp_size", "kind")
SUPPORTED_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")


@dataclasses.dataclass(frozen=True, slots=True)
class CacheLayout:
    """What two vLLM instances must agree on for one saved block to be valid in the other.

    ``packing`` is the attention kernel's in-page order of K and V (for the CPU backend its ISA: ``amx``,
    ``vec``, ``vec16``, ``neon``...); ``kind`` the :class:`~kvstore.layout.KVLayoutKind` a page is packed as
    and ``page_shape`` its shape in that order (see :mod:`~kvstore.integrations.vllm.cache_layouts`).
    """

    backend: str
    packing: str
    cache_layout: str
    dtype: str
    kv_cache_dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    page_shape: tuple[int, ...]
    model: str
    revision: str
    tp_rank: int
    tp_size: int
    pp_rank: int = 0
    lora: str = ""
    kind: str = "vllm_hnc"  # the KVLayoutKind the pages are packed as (kvstore.layout)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["page_shape"] = list(self.page_shape)
        return out

    @property
    def itemsize(self) -> int:
        """Bytes per element; UnsupportedKVCacheError for a dtype kvstore does not move."""
        return dtype_itemsize(self.dtype)

    @property
    def page_nbytes(self) -> int:
        n = self.itemsize
        for d in self.page_shape:
            n *= d
        return n

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block across all layers (what one stored object holds)."""
        return self.num_layers * self.page_nbytes

    def kv_layout(self) -> KVLayout:
        """The :class:`KVLayout` of these pages with this layout's identity: the page kernels' geometry (kind,
        layers, heads, head size, block size, dtype; uint8 caches as float8_e4m3fn raw bytes), the model, TP
        rank and size, and in ``engine`` every other field (canonical JSON). Its fingerprint is this layout's:
        a KVHandoff built with it shares blocks with this connector."""
        return KVLayout.from_dict(self._identity())

    def _identity(self) -> dict[str, Any]:
        """``self.kv_layout().to_dict()``, without torch."""
        fields = geometry_of(self).kernel_fields(self.num_layers, self.model)
        rest = {k: v for k, v in self.to_dict().items() if k not in _GEOMETRY_FIELDS}
        engine = json.dumps({"engine": "vllm", **rest}, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return {**fields, "tp_rank": self.tp_rank, "tp_size": self.tp_size, "engine": engine}

    def fingerprint(self) -> str:
        """The fingerprint of :meth:`kv_layout` (:func:`kvstore.keys.layout_fingerprint`): it changes with every
        field and with :data:`KEY_VERSION`; equal across processes and machines (no torch import)."""
        return layout_fingerprint(self._identity())


def layout_key(fingerprint: str) -> str:
    """Where a worker publishes the :class:`CacheLayout` of ``fingerprint`` (JSON, also as the object's meta)."""
    return f"{META_PREFIX}/{fingerprint}/layout"


def model_layouts_prefix(model: str) -> str:
    """Where workers list the fingerprints a model was served with: ``vllm/layouts/<model digest>/<fingerprint>``
    (each object's meta is the layout), so that an instance can say loudly which settings differ."""
    digest = hashlib.blake2b(model.encode(), digest_size=8, person=_PERSON).hexdigest()
    return f"{META_PREFIX}/layouts/{digest}/"


def layout_from_vllm_config(vllm_config: Any, kv_cache_config: Any, tp_rank: int = 0) -> CacheLayout:
    """The :class:`CacheLayout` of TP rank ``tp_rank`` for ``vllm_config`` (same answer in scheduler and
    worker, so the scheduler can look up every rank's keys).

    CPU and CUDA platforms, one attention (or MLA) cache group, any of vLLM's KV-cache layouts (see
    :mod:`~kvstore.integrations.vllm.cache_layouts`); anything else raises UnsupportedKVCacheError naming
    what was found and what is supported, before anything is registered or copied."""
    from vllm.platforms import current_platform

    check_platform(str(current_platform.device_type))
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise UnsupportedKVCacheError(f"kvstore's vLLM connector supports one KV-cache group, got {len(groups)}")
    spec = groups[0].kv_cache_spec
    _check_spec(spec)
    cache = vllm_config.cache_config
    model = vllm_config.model_config
    geometry = page_geometry(
        _resolved_layout(kv_cache_config, cache, current_platform.is_cpu()), mla=_is_mla(spec),
        heads=spec.num_heads, tokens=spec.block_size, content_bytes=spec.state_content_size_bytes,
        dtype=str(spec.dtype).removeprefix("torch."), itemsize=spec.dtype.itemsize)
    backend, packing = _backend_and_packing(vllm_config, spec, current_platform.is_cpu())
    return CacheLayout(
        backend=backend, packing=packing,
        # Not vLLM's physical layout name: pages are packed as the kind, so LBNHC and BLNHC engines share blocks.
        cache_layout="", dtype=geometry.dtype,
        kv_cache_dtype=str(cache.cache_dtype), block_size=spec.block_size, num_layers=len(groups[0].layer_names),
        num_kv_heads=spec.num_kv_heads, head_size=spec.head_size, page_shape=geometry.page_shape,
        model=str(model.model), revision=str(model.revision or ""), tp_rank=tp_rank,
        tp_size=vllm_config.parallel_config.tensor_parallel_size, pp_rank=0, kind=geometry.kind.value)


def _is_mla(spec: Any) -> bool:
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return isinstance(spec, MLAAttentionSpec)


def _check_spec(spec: Any) -> None:
    """Full attention or MLA, one state per token: what a block of tokens maps onto one to one."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    if type(spec).__name__ not in SUPPORTED_SPECS or not isinstance(spec, FullAttentionSpec):
        raise UnsupportedKVCacheError(f"kvstore's vLLM connector moves {' and '.join(SUPPORTED_SPECS)} caches; "
                                      f"this model's cache is {type(spec).__name__}")
    if spec.tokens_per_state != 1:
        raise UnsupportedKVCacheError(f"KV cache with {spec.tokens_per_state} tokens per stored state; expected 1")


def _resolved_layout(kv_cache_config: Any, cache_config: Any, on_cpu: bool) -> str:
    """The layout the engine core resolved (``KVCacheConfig.kv_cache_layout``, else ``CacheConfig``'s)."""
    name = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(cache_config, "kv_cache_layout", None)
    if name:
        return str(name)
    if on_cpu:
        return "LBHNC"  # the CPU backend's only layout
    raise UnsupportedKVCacheError("vLLM has not resolved the KV cache layout (KVCacheConfig.kv_cache_layout is "
                                  "unset); expected one of " + ", ".join(LAYOUT_KINDS))


def _backend_and_packing(vllm_config: Any, spec: Any, on_cpu: bool) -> tuple[str, str]:
    """The CPU backend keeps K and V in an ISA-specific order inside a page (``packing``); on CUDA every
    backend writes the plain ``[K | V]`` content, so only an explicitly chosen backend is recorded."""
    if on_cpu:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, _get_attn_isa

        isa = _get_attn_isa(vllm_config.model_config.dtype, spec.block_size, spec.head_size,
                            vllm_config.cache_config.cache_dtype)
        return CPUAttentionBackend.get_name(), isa
    chosen = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return f"CUDA/{getattr(chosen, 'name', chosen) or 'auto'}", "kv-content"


__all__ = ["KEY_PREFIX", "KEY_VERSION", "META_PREFIX", "PROMPT_ROOT", "SUPPORTED_SPECS", "CacheLayout", "block_hashes",
           "block_key", "layout_from_vllm_config", "layout_key", "model_layouts_prefix", "prompt_block_keys",
           "prompt_root"]
