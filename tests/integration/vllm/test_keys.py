"""Block keys: stable across processes and hash seeds, chained over the prefix, and separated by every
field of the layout fingerprint. No vLLM needed."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from kvstore.integrations.vllm.keys import CacheLayout, block_hashes, block_key, layout_key

LAYOUT = CacheLayout(backend="CPU_ATTN", packing="vec", cache_layout="LBHNC", dtype="bfloat16",
                     kv_cache_dtype="auto", block_size=4, num_layers=2, num_kv_heads=2, head_size=64,
                     page_shape=(2, 4, 128), model="/models/tiny", revision="", tp_rank=0, tp_size=1)

SCRIPT = """
from kvstore.integrations.vllm.keys import CacheLayout, block_hashes, block_key
layout = CacheLayout(backend="CPU_ATTN", packing="vec", cache_layout="LBHNC", dtype="bfloat16",
                     kv_cache_dtype="auto", block_size=4, num_layers=2, num_kv_heads=2, head_size=64,
                     page_shape=(2, 4, 128), model="/models/tiny", revision="", tp_rank=0, tp_size=1)
print(block_key(layout.fingerprint(), block_hashes(list(range(10)), 4, "vllm-prompt")[-1]))
"""


def key_in_child(seed: str) -> str:
    env = dict(os.environ, PYTHONHASHSEED=seed)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_keys_are_equal_across_processes_and_hash_seeds():
    keys = {key_in_child(seed) for seed in ("0", "1", "12345", "random")}
    here = block_key(LAYOUT.fingerprint(), block_hashes(list(range(10)), 4, "vllm-prompt")[-1])
    assert keys == {here}
    assert here.startswith(f"kvp/{LAYOUT.fingerprint()}/") and len(here) == 4 + 32 + 1 + 32


@pytest.mark.parametrize("field, value", [
    ("backend", "TORCH_SDPA"), ("packing", "amx"), ("cache_layout", "NHD"), ("dtype", "float32"),
    ("kv_cache_dtype", "fp8"), ("block_size", 8), ("num_layers", 3), ("num_kv_heads", 4), ("head_size", 128),
    ("page_shape", (2, 4, 256)), ("model", "/models/other"), ("revision", "abc"), ("tp_rank", 1),
    ("tp_size", 2), ("pp_rank", 1), ("lora", "adapter")])
def test_every_layout_field_changes_the_fingerprint(field, value):
    changed = dataclasses.replace(LAYOUT, **{field: value})
    assert changed.fingerprint() != LAYOUT.fingerprint()


def test_chained_digests_commit_to_the_whole_prefix():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, "r")
    b = block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4, "r")
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # same second block, other first block
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, "r") == a  # a partial block has no digest
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, "other root") != a
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, "r", start=1, previous=a[0]) == a[1:]


def test_token_ids_are_hashed_as_64_bit_values():
    assert block_hashes([2**40, 1], 2, "r") != block_hashes([0, 1], 2, "r")


def test_layout_key_lives_next_to_the_blocks():
    fp = LAYOUT.fingerprint()
    assert layout_key(fp) == f"vllm/{fp}/layout"
    assert LAYOUT.block_nbytes == 2 * 2 * 4 * 128 * 2


def test_prompt_block_keys_are_the_chain_under_the_requests_root():
    """What a router asks the store for a prompt: the full blocks' keys, rooted like the scheduler's (the salt
    and the adapter separate them), the partial last block left out."""
    from kvstore.integrations.vllm.keys import PROMPT_ROOT, prompt_block_keys, prompt_root

    fp, ids = LAYOUT.fingerprint(), list(range(3, 14))
    keys = prompt_block_keys(ids, fp, 4)
    assert keys == [block_key(fp, d) for d in block_hashes(ids, 4, PROMPT_ROOT)] and len(keys) == 2
    assert prompt_root() == PROMPT_ROOT
    salted = prompt_block_keys(ids, fp, 4, cache_salt="s")
    adapted = prompt_block_keys(ids, fp, 4, adapter="a@/p")
    assert len({keys[0], salted[0], adapted[0]}) == 3
    assert salted == [block_key(fp, d) for d in block_hashes(ids, 4, prompt_root("s", ""))]
