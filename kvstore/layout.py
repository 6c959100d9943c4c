"""KV-cache geometry shared by a producer and a consumer: :class:`KVLayoutKind` and :class:`KVLayout`.

A layout says how one engine keeps its paged KV cache (one tensor per layer) and therefore what the
packed, block-major bytes that kvstore moves look like. ``docs/kv_layout.md`` documents every kind once,
with shapes and a worked example.

torch is imported on first use (dtype conversion), never at import time.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Any

from kvstore.errors import UnsupportedKVCacheError
from kvstore.keys import DTYPE_NAMES, FINGERPRINT_VERSION, layout_fingerprint

__all__ = ["FINGERPRINT_VERSION", "KVLayout", "KVLayoutKind", "dtype_from_name", "dtype_name"]

# Dimension names used to describe tensors: "kv" (0 = K, 1 = V), "block", "token" (slot within a block),
# "head", "dim" (within a head), "latent" (MLA's compressed per-token vector) and "content" (vLLM >= 0.32: one
# head's K then V for one token, 2 * head_dim elements).
_FLASH_DIMS = ("kv", "block", "token", "head", "dim")
_FLASHINFER_NHD_DIMS = ("block", "kv", "token", "head", "dim")
_FLASHINFER_HND_DIMS = ("block", "kv", "head", "token", "dim")
_NHD_BLOCK = ("kv", "token", "head", "dim")
_HND_BLOCK = ("kv", "head", "token", "dim")
_VLLM_PAGE_DIMS = ("block", "head", "token", "content")


class KVLayoutKind(enum.Enum):
    """How an engine shapes its per-layer paged KV cache.

    Each member's value is its stable wire name. ``cache_dims`` names the per-layer tensor's logical
    dimensions; ``block_dims`` names the dimensions of one block of one layer in the packed format.
    """

    #: vLLM flash-attention, tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, NHD memory order.
    VLLM_FLASH_NHD = "vllm_flash_nhd"
    #: vLLM flash-attention, same logical shape, memory order ``[2, num_blocks, num_kv_heads, block_size, head_dim]``.
    VLLM_FLASH_HND = "vllm_flash_hnd"
    #: FlashInfer NHD, tensor ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``.
    FLASHINFER = "flashinfer"
    #: FlashInfer HND, tensor ``[num_blocks, 2, num_kv_heads, block_size, head_dim]``.
    FLASHINFER_HND = "flashinfer_hnd"
    #: Multi-head latent attention, tensor ``[num_blocks, block_size, latent_dim]`` (one latent per token).
    MLA = "mla"
    #: vLLM >= 0.32 attention (every backend), tensor ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``
    #: (K then V in the last dim), head-major memory (vLLM's ``LBHNC``, ``BLHNC``, ``LHBNC``, ``BHLNC``).
    VLLM_HNC = "vllm_hnc"
    #: The same logical tensor in token-major memory (vLLM's ``LBNHC``, ``BLNHC``): pages packed ``[B, H, 2D]``.
    VLLM_NHC = "vllm_nhc"

    @classmethod
    def parse(cls, value: KVLayoutKind | str) -> KVLayoutKind:
        """Return the member for a member, its value (``"vllm_flash_nhd"``) or its name (``"VLLM_FLASH_NHD"``)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            for member in cls:
                if value in (member.value, member.name):
                    return member
        names = ", ".join(m.value for m in cls)
        raise ValueError(f"unknown KV layout kind {value!r}; expected one of: {names}")

    @property
    def cache_dims(self) -> tuple[str, ...]:
        """Logical dimensions of one layer's cache tensor, in shape order."""
        return _CACHE_DIMS[self]

    @property
    def block_dims(self) -> tuple[str, ...]:
        """Dimensions of one block of one layer in the packed format, outermost first."""
        return _BLOCK_DIMS[self]


_CACHE_DIMS = {
    KVLayoutKind.VLLM_FLASH_NHD: _FLASH_DIMS,
    KVLayoutKind.VLLM_FLASH_HND: _FLASH_DIMS,
    KVLayoutKind.FLASHINFER: _FLASHINFER_NHD_DIMS,
    KVLayoutKind.FLASHINFER_HND: _FLASHINFER_HND_DIMS,
    KVLayoutKind.MLA: ("block", "token", "latent"),
    KVLayoutKind.VLLM_HNC: _VLLM_PAGE_DIMS,
    KVLayoutKind.VLLM_NHC: _VLLM_PAGE_DIMS,
}
# The packed order of a block is the memory order the layout is designed around, so that a block of a
# cache in that order is one contiguous run per K/V (or one run in all) and packs with plain memcpy.
_BLOCK_DIMS = {
    KVLayoutKind.VLLM_FLASH_NHD: _NHD_BLOCK,
    KVLayoutKind.VLLM_FLASH_HND: _HND_BLOCK,
    KVLayoutKind.FLASHINFER: _NHD_BLOCK,
    KVLayoutKind.FLASHINFER_HND: _HND_BLOCK,
    KVLayoutKind.MLA: ("token", "latent"),
    KVLayoutKind.VLLM_HNC: ("head", "token", "content"),
    KVLayoutKind.VLLM_NHC: ("token", "head", "content"),
}

_DTYPE_NAMES = DTYPE_NAMES  # wire name -> torch dtype attribute (kvstore.keys)


@functools.cache
def _dtype_table() -> dict[str, Any]:
    import torch

    return {name: getattr(torch, name) for name in _DTYPE_NAMES if hasattr(torch, name)}


def dtype_name(dtype: Any) -> str:
    """Wire name of a supported torch dtype (``torch.bfloat16`` -> ``"bfloat16"``); UnsupportedKVCacheError (a
    ValueError) otherwise."""
    for name, value in _dtype_table().items():
        if value == dtype:
            return name
    raise UnsupportedKVCacheError(f"unsupported KV dtype {dtype!r}; expected one of: {', '.join(_dtype_table())}")


def dtype_from_name(name: str) -> Any:
    """torch dtype for a wire name (``"bfloat16"`` -> ``torch.bfloat16``); UnsupportedKVCacheError (a ValueError)
    for an unknown name."""
    try:
        return _dtype_table()[name]
    except (KeyError, TypeError):
        raise UnsupportedKVCacheError(f"unsupported KV dtype {name!r}; expected one of: "
                                      f"{', '.join(_dtype_table())}") from None


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"KVLayout.{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"KVLayout.{name} must be >= {minimum}, got {value}")


@dataclasses.dataclass(frozen=True, slots=True)
class KVLayout:
    """The geometry of one engine's paged KV cache: what a producer and a consumer must agree on.

    ``kind`` accepts a :class:`KVLayoutKind` or its wire name; ``dtype`` a torch dtype or its wire name
    (``"bfloat16"``); both are stored normalised. ``tp_rank``/``tp_size`` identify which tensor-parallel
    shard of the heads this cache holds (``num_kv_heads`` counts the heads of this shard).

    ``engine`` names whatever else decides a page's bytes beyond this geometry (for a vLLM engine: its attention
    backend and in-page packing, cache dtype, model revision, pipeline rank; see
    ``kvstore.integrations.vllm.keys.CacheLayout.kv_layout``); compared as a whole, empty by default. It is part
    of the fingerprint, so a hand-off producer built with an engine's layout shares keys with that engine's
    connector (``docs/keys.md``).

    MLA: there is one latent vector per token and no K/V split, so ``num_kv_heads`` must be 1 and
    ``head_dim`` is the latent width (``kv_lora_rank + qk_rope_head_dim``, e.g. 512 + 64 = 576 for
    DeepSeek-V3); :attr:`latent_dim` returns it.

    Raises ValueError / TypeError naming the field and the offending value.
    """

    kind: KVLayoutKind
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: Any
    model_id: str
    tp_rank: int = 0
    tp_size: int = 1
    engine: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", KVLayoutKind.parse(self.kind))
        dtype = dtype_from_name(self.dtype) if isinstance(self.dtype, str) else self.dtype
        dtype_name(dtype)  # validates
        object.__setattr__(self, "dtype", dtype)
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "tp_size"):
            _check_int(name, getattr(self, name), 1)
        _check_int("tp_rank", self.tp_rank, 0)
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"KVLayout.tp_rank must be < tp_size={self.tp_size}, got {self.tp_rank}")
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ValueError(f"KVLayout.model_id must be a non-empty str, got {self.model_id!r}")
        if not isinstance(self.engine, str):
            raise TypeError(f"KVLayout.engine must be a str, got {type(self.engine).__name__}")
        if self.kind is KVLayoutKind.MLA and self.num_kv_heads != 1:
            raise ValueError(f"KVLayout.num_kv_heads must be 1 for MLA (head_dim is the latent width), "
                             f"got {self.num_kv_heads}")

    # -- geometry ---------------------------------------------------------------------------------------
    @property
    def latent_dim(self) -> int:
        """MLA's per-token latent width (equal to ``head_dim``); ValueError for other kinds."""
        if self.kind is not KVLayoutKind.MLA:
            raise ValueError(f"latent_dim is defined for MLA only, this layout is {self.kind.name}")
        return self.head_dim

    def dim_sizes(self, num_blocks: int) -> dict[str, int]:
        """Size of every named dimension for a cache of ``num_blocks`` blocks."""
        return {"kv": 2, "block": num_blocks, "token": self.block_size, "head": self.num_kv_heads,
                "dim": self.head_dim, "latent": self.head_dim, "content": 2 * self.head_dim}

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's cache tensor holding ``num_blocks`` blocks."""
        sizes = self.dim_sizes(num_blocks)
        return tuple(sizes[d] for d in self.kind.cache_dims)

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Packed shape of one block of one layer (see ``docs/kv_layout.md``)."""
        sizes = self.dim_sizes(1)
        return tuple(sizes[d] for d in self.kind.block_dims)

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return int(self.dtype.itemsize)

    @property
    def page_nbytes(self) -> int:
        """Bytes of one block of one layer (one "page")."""
        return _prod(self.block_shape) * self.itemsize

    @property
    def block_nbytes(self) -> int:
        """Packed bytes of one block across all layers."""
        return self.num_layers * self.page_nbytes

    # -- identity and wire form --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """msgpack-safe form: only str and int values (kind and dtype by wire name); ``engine`` only when set."""
        out = {"kind": self.kind.value, "num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "block_size": self.block_size, "dtype": dtype_name(self.dtype),
                "model_id": self.model_id, "tp_rank": self.tp_rank, "tp_size": self.tp_size}
        if self.engine:
            out["engine"] = self.engine
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVLayout:
        """Inverse of :meth:`to_dict`; ValueError on missing or unknown keys, or invalid values."""
        if not isinstance(data, dict):
            raise TypeError(f"KVLayout.from_dict expects a dict, got {type(data).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        unknown, missing = set(data) - fields, required - set(data)
        if unknown or missing:
            raise ValueError(f"KVLayout.from_dict: missing keys {sorted(missing)}, unknown keys "
                             f"{sorted(map(str, unknown))}")
        return cls(**data)

    def fingerprint(self) -> str:
        """Stable hex digest (blake2b-128) of everything producer and consumer must agree on.

        Equal across processes, machines and Python versions; it changes with any field of
        :meth:`to_dict` and with :data:`FINGERPRINT_VERSION` (:func:`kvstore.keys.layout_fingerprint`, the one
        fingerprint of the paged-KV key scheme, also the vLLM connector's).
        """
        return _fingerprint(self)


@functools.lru_cache(maxsize=256)
def _fingerprint(layout: KVLayout) -> str:
    return layout_fingerprint(layout.to_dict())


def _prod(values: tuple[int, ...]) -> int:
    result = 1
    for v in values:
        result *= v
    return result
