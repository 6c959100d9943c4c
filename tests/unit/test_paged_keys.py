"""kvstore.keys: the one paged-KV key scheme (fingerprint, dtype table, chained prefix digest, key format)
that KVHandoff and the vLLM connector both use."""

from __future__ import annotations

import pytest
import torch

from kvstore import KVLayout, KVLayoutKind
from kvstore import keys as kv_keys
from kvstore.errors import InvalidArgumentError, UnsupportedKVCacheError
from kvstore.handoff import chunk_keys
from kvstore.integrations.vllm.keys import CacheLayout

LAYOUT = KVLayout(KVLayoutKind.VLLM_HNC, num_layers=2, num_kv_heads=2, head_dim=64, block_size=4,
                  dtype=torch.bfloat16, model_id="/models/tiny")
VLLM = CacheLayout(backend="CPU_ATTN", packing="vec", cache_layout="", dtype="bfloat16", kv_cache_dtype="auto",
                   block_size=4, num_layers=2, num_kv_heads=2, head_size=64, page_shape=(2, 4, 128),
                   model="/models/tiny", revision="", tp_rank=0, tp_size=1)
TOKENS = list(range(100, 118))  # 4 full blocks of 4 and a partial one of 2


def test_unknown_dtype_is_a_typed_error_never_a_guessed_size():
    assert kv_keys.dtype_itemsize("bfloat16") == 2 and kv_keys.dtype_itemsize("uint8") == 1
    for name in ("int8", "float64", "", None):
        with pytest.raises(UnsupportedKVCacheError, match="unsupported KV dtype"):
            kv_keys.dtype_itemsize(name)  # type: ignore[arg-type]
    with pytest.raises(UnsupportedKVCacheError, match="unsupported KV dtype 'int4'"):
        _ = CacheLayout(**{**VLLM.to_dict(), "dtype": "int4", "page_shape": (2, 4, 128)}).itemsize
    with pytest.raises(UnsupportedKVCacheError):
        KVLayout(KVLayoutKind.VLLM_HNC, 2, 2, 64, 4, dtype="int8", model_id="m")


def test_the_connector_fingerprint_is_its_kv_layouts():
    kv = VLLM.kv_layout()
    assert (kv.kind, kv.num_layers, kv.num_kv_heads, kv.head_dim, kv.block_size, kv.dtype) == \
        (KVLayoutKind.VLLM_HNC, 2, 2, 64, 4, torch.bfloat16)
    assert kv.block_nbytes == VLLM.block_nbytes
    assert VLLM.fingerprint() == kv.fingerprint() == kv_keys.layout_fingerprint(kv.to_dict())
    assert kv.to_dict() == VLLM._identity()  # computed without torch: what fingerprint() hashes
    # The geometry alone is not the identity: the in-page packing, backend... are part of it.
    assert kv.engine and LAYOUT.fingerprint() != VLLM.fingerprint()


def test_one_block_chunks_are_the_connectors_block_keys():
    fp = VLLM.fingerprint()
    blocks = kv_keys.prompt_block_keys(TOKENS, fp, 4)
    assert len(blocks) == 4 and all(k.startswith(f"kvp/{fp}/") and len(k) == 4 + 32 + 1 + 32 for k in blocks)
    handoff = chunk_keys(VLLM.kv_layout(), TOKENS, 4)
    assert handoff[:4] == blocks and len(handoff) == 5  # plus the partial last block, under a key of its own
    assert handoff[4] not in blocks


def test_multi_block_chunks_name_their_last_block_and_their_size():
    fp = LAYOUT.fingerprint()
    blocks = kv_keys.prompt_block_keys(TOKENS, fp, 4)
    assert chunk_keys(LAYOUT, TOKENS, 12) == [blocks[2] + "/3", kv_keys.block_key(fp, kv_keys.block_hashes(
        TOKENS, 4, partial=True)[4], 2)]
    # A trailing chunk of one full block is that block (a hit for a per-block reader).
    assert chunk_keys(LAYOUT, TOKENS[:16], 12)[-1] == blocks[3]
    with pytest.raises(InvalidArgumentError, match="multiple of the block size 4"):
        chunk_keys(LAYOUT, TOKENS, 6)


def test_salt_and_adapter_separate_the_chain():
    fp = LAYOUT.fingerprint()
    plain = kv_keys.prompt_block_keys(TOKENS, fp, 4)
    salted = kv_keys.prompt_block_keys(TOKENS, fp, 4, cache_salt="tenant-a")
    adapted = kv_keys.prompt_block_keys(TOKENS, fp, 4, adapter="sql@/adapters/sql")
    assert not {*plain} & {*salted} and not {*plain} & {*adapted} and not {*salted} & {*adapted}
    assert kv_keys.chunk_keys(TOKENS[:16], fp, 4, 1, cache_salt="tenant-a") == salted
    assert kv_keys.prompt_root() == kv_keys.PROMPT_ROOT


def test_digests_extend_and_a_partial_block_never_takes_a_full_blocks_digest():
    full = kv_keys.block_hashes(TOKENS, 4)
    assert kv_keys.block_hashes(TOKENS, 4, start=2, previous=full[1]) == full[2:]
    with_partial = kv_keys.block_hashes(TOKENS, 4, partial=True)
    assert with_partial[:4] == full and len(with_partial) == 5
    assert kv_keys.block_hashes(TOKENS[:18] + [0, 0], 4)[4] != with_partial[4]
    with pytest.raises(ValueError, match="block_size"):
        kv_keys.block_hashes(TOKENS, 0)


def test_handoff_chunk_keys_take_the_connectors_salt_and_adapter():
    fp = VLLM.fingerprint()
    salted = kv_keys.prompt_block_keys(TOKENS, fp, 4, cache_salt="tenant-a", adapter="sql@/a")
    assert chunk_keys(VLLM.kv_layout(), TOKENS, 4, cache_salt="tenant-a", adapter="sql@/a")[:4] == salted
