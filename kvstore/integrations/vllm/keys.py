"""Stable block keys for vLLM's paged KV cache: the layout fingerprint and the chained content hash.

A block's key names everything that decides its bytes: the tokens up to and including it (a chained
blake2b over their ids, so a block's key also commits to every block before it), and the layout of the
cache it came from (:class:`CacheLayout`: model, dtype, block size, attention backend and its in-page
packing, geometry, TP rank and size). Two engines share a key only if they would have computed the same
bytes, so a consumer with another dtype, block size or kernel packing never gets a false hit. Nothing
here depends on Python's ``hash()`` or on ``PYTHONHASHSEED``: keys are equal across processes, machines
and restarts.

No vLLM import at module level: the scheduler and worker halves pass a ``VllmConfig`` in.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstore.errors import UnsupportedKVCacheError
from kvstore.integrations.vllm.cache_layouts import LAYOUT_KINDS, check_platform, page_geometry

# Bumped whenever the packed block format or the key derivation changes.
KEY_VERSION = 2  # 2: the packed kind (KVLayoutKind) joined the layout
KEY_PREFIX = "vllm"
_PERSON = b"kvstore.vllm"
#: The digest chain's root of a prompt without ``cache_salt`` and LoRA adapter (see :func:`prompt_root`).
PROMPT_ROOT = "vllm-prompt"
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
        return {"float32": 4, "float16": 2, "bfloat16": 2}.get(self.dtype, 1)  # float8 and uint8: 1

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

    def fingerprint(self) -> str:
        """Hex blake2b-128 of every field and :data:`KEY_VERSION`; equal across processes and machines."""
        canonical = json.dumps({"version": KEY_VERSION, **self.to_dict()}, sort_keys=True,
                               separators=(",", ":"), ensure_ascii=True)
        return hashlib.blake2b(canonical.encode("ascii"), digest_size=16, person=_PERSON).hexdigest()


def block_hashes(token_ids: Sequence[int], block_size: int, root: str, *, start: int = 0,
                 previous: bytes | None = None) -> list[bytes]:
    """Chained blake2b-128 digests of the full blocks of ``token_ids`` from block ``start`` on.

    ``h[i] = blake2b(h[i-1] || int64 little-endian ids of block i)``, with ``h[-1] = blake2b(root)``; pass
    ``previous`` (the digest of block ``start - 1``) to extend an earlier result without rehashing."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if previous is None:
        if start != 0:
            raise ValueError("extending from block start > 0 needs the previous block's digest")
        previous = hashlib.blake2b(root.encode(), digest_size=16, person=_PERSON).digest()
    out: list[bytes] = []
    for first in range(start * block_size, len(token_ids) - block_size + 1, block_size):
        h = hashlib.blake2b(previous, digest_size=16, person=_PERSON)
        h.update(np.asarray(token_ids[first:first + block_size], dtype="<i8").tobytes())
        previous = h.digest()
        out.append(previous)
    return out


def prompt_root(cache_salt: str = "", adapter: str = "") -> str:
    """The digest chain's root of a request: the ``cache_salt`` and the LoRA adapter (``name@path``) are part of
    every block's key, so a salted request never shares blocks (or their timing) with another salt, and an
    adapter's KV is its own."""
    if not cache_salt and not adapter:
        return PROMPT_ROOT
    return f"{PROMPT_ROOT}\0salt={cache_salt}\0lora={adapter}"


def prompt_block_keys(token_ids: Sequence[int], fingerprint: str, block_size: int, *,
                      cache_salt: str = "", adapter: str = "") -> list[str]:
    """The store keys of the full blocks of a prompt, in order, as an instance with layout ``fingerprint`` saves
    and looks them up: what a router asks the store (``batch_exists``) to learn how much of a prompt is held."""
    digests = block_hashes(token_ids, block_size, prompt_root(cache_salt, adapter))
    return [block_key(fingerprint, d) for d in digests]


def block_key(fingerprint: str, digest: bytes) -> str:
    """The store key of one block: ``vllm/<layout fingerprint>/<chained digest>`` (ASCII, 72 chars)."""
    return f"{KEY_PREFIX}/{fingerprint}/{digest.hex()}"


def layout_key(fingerprint: str) -> str:
    """Where a worker publishes the :class:`CacheLayout` of ``fingerprint`` (JSON, also as the object's meta)."""
    return f"{KEY_PREFIX}/{fingerprint}/layout"


def model_layouts_prefix(model: str) -> str:
    """Where workers list the fingerprints a model was served with: ``vllm/layouts/<model digest>/<fingerprint>``
    (each object's meta is the layout), so that an instance can say loudly which settings differ."""
    digest = hashlib.blake2b(model.encode(), digest_size=8, person=_PERSON).hexdigest()
    return f"{KEY_PREFIX}/layouts/{digest}/"


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
