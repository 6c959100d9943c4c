"""Paged-KV keys: layout fingerprints, the dtype table, chained prefix digests over token ids, store keys.

Moved here from :mod:`kvstore.layout`, :mod:`kvstore.handoff` and :mod:`kvstore.integrations.vllm.keys`
(unchanged; those modules re-export every public name). No torch import: a router can name keys without it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

# Bumped whenever the packed format or the fingerprint's encoding changes, so that old and new
# producers/consumers never match by accident.
FINGERPRINT_VERSION = 1

# Wire names of the KV dtypes a KVLayout accepts. float8 caches are moved as raw bytes.
DTYPE_NAMES = ("float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2")


def fingerprint_of(fields: Mapping[str, Any], *, version: int, person: bytes) -> str:
    """Hex blake2b-128 of ``{"version": version, **fields}`` as canonical JSON (sorted keys, ASCII)."""
    canonical = json.dumps({"version": version, **fields}, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.blake2b(canonical.encode("ascii"), digest_size=16, person=person).hexdigest()


def prefix_chunk_keys(fingerprint: str, token_ids: Sequence[int], chunk_tokens: int) -> list[str]:
    """KVHandoff's chained prefix keys of every chunk of ``token_ids`` (the last one may be partial)."""
    prev = bytes.fromhex(fingerprint)
    keys = []
    ids = np.asarray(list(token_ids), dtype=np.int64).astype("<i8")
    for start in range(0, len(ids), chunk_tokens):
        digest = hashlib.blake2b(prev + ids[start:start + chunk_tokens].tobytes(), digest_size=16,
                                 person=b"kvstore.prefix").digest()
        keys.append(f"kvp/{fingerprint[:16]}/{digest.hex()}")
        prev = digest
    return keys


# The vLLM connector's block keys.
VLLM_PERSON = b"kvstore.vllm"
VLLM_KEY_PREFIX = "vllm"


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
        previous = hashlib.blake2b(root.encode(), digest_size=16, person=VLLM_PERSON).digest()
    out: list[bytes] = []
    for first in range(start * block_size, len(token_ids) - block_size + 1, block_size):
        h = hashlib.blake2b(previous, digest_size=16, person=VLLM_PERSON)
        h.update(np.asarray(token_ids[first:first + block_size], dtype="<i8").tobytes())
        previous = h.digest()
        out.append(previous)
    return out


def block_key(fingerprint: str, digest: bytes) -> str:
    """The store key of one block: ``vllm/<layout fingerprint>/<chained digest>`` (ASCII, 72 chars)."""
    return f"{VLLM_KEY_PREFIX}/{fingerprint}/{digest.hex()}"
