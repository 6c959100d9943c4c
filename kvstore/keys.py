"""Paged-KV keys: the one scheme that names a block of KV in the store, for every producer and consumer.

A stored block (or chunk of blocks) is named by two things: the layout it was packed from and the tokens it
holds the KV of. This module defines both halves once; :class:`~kvstore.handoff.KVHandoff` and the vLLM
connector (:mod:`kvstore.integrations.vllm.keys`) use them alike, so a block one of them stores is a hit for
the other when their layouts are equal.

- **Layout fingerprint** (:func:`layout_fingerprint`): blake2b-128 of the layout's identity fields as
  canonical JSON, with :data:`SCHEME_VERSION` in it. :meth:`kvstore.layout.KVLayout.fingerprint` is this
  function over :meth:`~kvstore.layout.KVLayout.to_dict`.
- **Dtype table** (:data:`DTYPE_ITEMSIZE`): the KV dtypes kvstore moves, by wire name, with their size; an
  unknown dtype is an :class:`~kvstore.errors.UnsupportedKVCacheError` (a ValueError), never a guess.
- **Chained prefix digest** (:func:`block_hashes`): ``h[-1] = blake2b(root)``, ``h[i] = blake2b(h[i-1] ||
  token ids of block i as int64 little-endian)``, so a block's digest commits to every token before it. The
  root (:func:`prompt_root`) is :data:`PROMPT_ROOT`, or names the request's ``cache_salt`` and LoRA adapter,
  whose KV is its own.
- **Store key** (:func:`block_key`): ``kvp/<fingerprint>/<digest>`` for one block; an object holding ``n > 1``
  consecutive blocks (a KVHandoff chunk) is ``kvp/<fingerprint>/<digest of its last block>/<n>``, so it can
  never be read as one block.

Nothing here depends on Python's ``hash()`` or ``PYTHONHASHSEED``: keys are equal across processes, machines
and restarts. No torch import, so that a router can name keys without it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvstore.errors import UnsupportedKVCacheError

#: Version of the whole scheme (fingerprint encoding, digest chain, key format, packed block format). Bumped
#: whenever one of them changes, so that old and new producers/consumers never match by accident. 3: one
#: scheme for KVHandoff (was 1) and the vLLM connector (was 2).
SCHEME_VERSION = 3
#: The name :mod:`kvstore.layout` always gave the version in its fingerprints.
FINGERPRINT_VERSION = SCHEME_VERSION

#: Every KV dtype kvstore moves, by wire name, and its size in bytes. float8 caches move as raw bytes; vLLM
#: keeps fp8 caches (``fp8``, ``fp8_e4m3``, ``fp8_e5m2``) as ``uint8``.
DTYPE_ITEMSIZE: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1,
                                  "uint8": 1}
#: The dtypes a :class:`~kvstore.layout.KVLayout` (and so the page kernels) takes: uint8 caches are moved as
#: float8_e4m3fn raw bytes.
DTYPE_NAMES = tuple(name for name in DTYPE_ITEMSIZE if name != "uint8")

KEY_PREFIX = "kvp"
#: The root of the digest chain of a prompt without ``cache_salt`` and LoRA adapter (the value the vLLM
#: connector always used; any constant would do, the key's fingerprint carries the scheme version).
PROMPT_ROOT = "vllm-prompt"
_PERSON = b"kvstore.keys"
_CHAIN_PERSON = b"kvstore.prefix"


def dtype_itemsize(name: str) -> int:
    """Bytes per element of the KV dtype ``name``; UnsupportedKVCacheError (a ValueError) naming the supported
    ones for anything else."""
    try:
        return DTYPE_ITEMSIZE[name]
    except (KeyError, TypeError):
        raise UnsupportedKVCacheError(f"unsupported KV dtype {name!r}; expected one of: "
                                      f"{', '.join(DTYPE_ITEMSIZE)}") from None


def layout_fingerprint(identity: Mapping[str, Any]) -> str:
    """Hex blake2b-128 of ``identity`` (str, int and list values) and :data:`SCHEME_VERSION` as canonical JSON
    (sorted keys, ASCII): equal across processes, machines and Python versions, and different for any change
    of a field."""
    canonical = json.dumps({"scheme": SCHEME_VERSION, **identity}, sort_keys=True, separators=(",", ":"),
                           ensure_ascii=True)
    return hashlib.blake2b(canonical.encode("ascii"), digest_size=16, person=_PERSON).hexdigest()


def prompt_root(cache_salt: str = "", adapter: str = "") -> str:
    """The digest chain's root of a request: the ``cache_salt`` and the LoRA adapter (``name@path``) are part of
    every block's key, so a salted request never shares blocks (or their timing) with another salt, and an
    adapter's KV is its own."""
    if not cache_salt and not adapter:
        return PROMPT_ROOT
    return f"{PROMPT_ROOT}\0salt={cache_salt}\0lora={adapter}"


def block_hashes(token_ids: Sequence[int], block_size: int, root: str = PROMPT_ROOT, *, start: int = 0,
                 previous: bytes | None = None, partial: bool = False) -> list[bytes]:
    """Chained blake2b-128 digests of the full blocks of ``token_ids`` from block ``start`` on.

    ``h[i] = blake2b(h[i-1] || int64 little-endian ids of block i)``, with ``h[-1] = blake2b(root)``; pass
    ``previous`` (the digest of block ``start - 1``) to extend an earlier result without rehashing.
    ``partial``: a last, partial block gets a digest too (over its fewer ids, so never a full block's)."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    if previous is None:
        if start != 0:
            raise ValueError("extending from block start > 0 needs the previous block's digest")
        previous = hashlib.blake2b(root.encode(), digest_size=16, person=_CHAIN_PERSON).digest()
    ids = np.asarray(token_ids[start * block_size:], dtype=np.int64).astype("<i8", copy=False)
    end = len(ids) if partial else len(ids) - len(ids) % block_size
    out: list[bytes] = []
    for first in range(0, end, block_size):
        h = hashlib.blake2b(previous, digest_size=16, person=_CHAIN_PERSON)
        h.update(ids[first:first + block_size].tobytes())
        previous = h.digest()
        out.append(previous)
    return out


def block_key(fingerprint: str, digest: bytes, num_blocks: int = 1) -> str:
    """The store key of the object holding the block whose chained digest is ``digest`` and, with
    ``num_blocks > 1``, the ``num_blocks - 1`` blocks before it: ``kvp/<fingerprint>/<digest>[/<num_blocks>]``."""
    key = f"{KEY_PREFIX}/{fingerprint}/{digest.hex()}"
    return key if num_blocks == 1 else f"{key}/{num_blocks}"


def prompt_block_keys(token_ids: Sequence[int], fingerprint: str, block_size: int, *, cache_salt: str = "",
                      adapter: str = "") -> list[str]:
    """The store keys of the full blocks of a prompt, in order, for a layout of ``fingerprint`` and
    ``block_size``: what the vLLM connector saves and looks up, what a KVHandoff with ``chunk_blocks=1``
    publishes, and what a router asks the store (``batch_exists``) to learn how much of a prompt is held."""
    digests = block_hashes(token_ids, block_size, prompt_root(cache_salt, adapter))
    return [block_key(fingerprint, d) for d in digests]


def chunk_keys(token_ids: Sequence[int], fingerprint: str, block_size: int, chunk_blocks: int, *,
               cache_salt: str = "", adapter: str = "") -> list[str]:
    """The keys of consecutive chunks of ``chunk_blocks`` blocks covering ``token_ids`` (the last chunk, and its
    last block, may be partial), as KVHandoff stores them: each is the :func:`block_key` of the chunk's last
    block with the chunk's block count. With ``chunk_blocks=1`` the full blocks' keys are those of
    :func:`prompt_block_keys`."""
    if isinstance(chunk_blocks, bool) or not isinstance(chunk_blocks, int) or chunk_blocks < 1:
        raise ValueError(f"chunk_blocks must be an int >= 1, got {chunk_blocks!r}")
    digests = block_hashes(token_ids, block_size, prompt_root(cache_salt, adapter), partial=True)
    return [block_key(fingerprint, digests[min(first + chunk_blocks, len(digests)) - 1],
                      min(chunk_blocks, len(digests) - first))
            for first in range(0, len(digests), chunk_blocks)]


__all__ = ["DTYPE_ITEMSIZE", "DTYPE_NAMES", "FINGERPRINT_VERSION", "KEY_PREFIX", "PROMPT_ROOT", "SCHEME_VERSION",
           "block_hashes", "block_key", "chunk_keys", "dtype_itemsize", "layout_fingerprint", "prompt_block_keys",
           "prompt_root"]
