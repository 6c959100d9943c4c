"""kvstore.layout: KVLayoutKind, KVLayout validation, geometry, wire form and the stable fingerprint."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import msgpack
import pytest
import torch

from kvstore import KVLayout, KVLayoutKind

LLAMA = dict(kind=KVLayoutKind.VLLM_FLASH_NHD, num_layers=32, num_kv_heads=8, head_dim=128, block_size=16,
             dtype=torch.bfloat16, model_id="llama-3-8b")
# Golden value: the fingerprint is part of the wire contract, so it must never change by accident (bump
# FINGERPRINT_VERSION and this value together when the packed format changes). 3: kvstore.keys's one scheme.
LLAMA_FINGERPRINT = "a7a27b9fab3b02155497785e0844e1eb"


def llama(**changes) -> KVLayout:
    return KVLayout(**{**LLAMA, **changes})


def test_required_kinds_exist():
    for name in ("VLLM_FLASH_NHD", "VLLM_FLASH_HND", "FLASHINFER", "MLA"):
        assert isinstance(KVLayoutKind[name], KVLayoutKind)


@pytest.mark.parametrize("text", ["vllm_flash_hnd", "VLLM_FLASH_HND"])
def test_kind_and_dtype_accept_wire_names(text):
    layout = llama(kind=text, dtype="float16")
    assert layout.kind is KVLayoutKind.VLLM_FLASH_HND
    assert layout.dtype is torch.float16


def test_unknown_kind_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown KV layout kind 'paged'; expected one of: vllm_flash_nhd, "):
        llama(kind="paged")


@pytest.mark.parametrize("dtype", [torch.int8, "int8", torch.float64])
def test_unsupported_dtype(dtype):
    with pytest.raises(ValueError, match="unsupported KV dtype .*expected one of: float16, bfloat16, float32"):
        llama(dtype=dtype)


@pytest.mark.parametrize("field,value,error,message", [
    ("num_layers", 0, ValueError, "num_layers must be >= 1, got 0"),
    ("head_dim", -4, ValueError, "head_dim must be >= 1, got -4"),
    ("block_size", 16.0, TypeError, "block_size must be an int, got float 16.0"),
    ("num_kv_heads", True, TypeError, "num_kv_heads must be an int, got bool"),
    ("tp_rank", 2, ValueError, "tp_rank must be < tp_size=1, got 2"),
    ("tp_size", 0, ValueError, "tp_size must be >= 1, got 0"),
    ("model_id", "", ValueError, "model_id must be a non-empty str"),
])
def test_invalid_fields(field, value, error, message):
    with pytest.raises(error, match=message):
        llama(**{field: value})


def test_mla_has_one_latent_per_token():
    mla = llama(kind=KVLayoutKind.MLA, num_kv_heads=1, head_dim=576, model_id="deepseek-v3")
    assert mla.latent_dim == 576
    assert mla.cache_shape(100) == (100, 16, 576)
    assert mla.block_shape == (16, 576)
    assert mla.block_nbytes == 32 * 16 * 576 * 2
    with pytest.raises(ValueError, match="num_kv_heads must be 1 for MLA"):
        llama(kind=KVLayoutKind.MLA, num_kv_heads=8)
    with pytest.raises(ValueError, match="latent_dim is defined for MLA only"):
        _ = llama().latent_dim


@pytest.mark.parametrize("kind,cache_shape,block_shape", [
    (KVLayoutKind.VLLM_FLASH_NHD, (2, 100, 16, 8, 128), (2, 16, 8, 128)),
    (KVLayoutKind.VLLM_FLASH_HND, (2, 100, 16, 8, 128), (2, 8, 16, 128)),
    (KVLayoutKind.FLASHINFER, (100, 2, 16, 8, 128), (2, 16, 8, 128)),
    (KVLayoutKind.FLASHINFER_HND, (100, 2, 8, 16, 128), (2, 8, 16, 128)),
], ids=lambda v: getattr(v, "name", None))
def test_documented_shapes(kind, cache_shape, block_shape):
    layout = llama(kind=kind)
    assert layout.cache_shape(100) == cache_shape
    assert layout.block_shape == block_shape
    assert layout.page_nbytes == 2 * 16 * 8 * 128 * 2 == 64 * 1024
    assert layout.block_nbytes == 32 * 64 * 1024


def test_frozen_and_hashable():
    layout = llama()
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.num_layers = 2
    assert {layout: 1}[llama()] == 1


def test_to_dict_is_msgpack_safe_and_round_trips():
    layout = llama(kind=KVLayoutKind.FLASHINFER, dtype=torch.float8_e4m3fn, tp_rank=1, tp_size=4)
    wire = msgpack.unpackb(msgpack.packb(layout.to_dict()))
    assert wire["dtype"] == "float8_e4m3fn" and wire["kind"] == "flashinfer"
    assert KVLayout.from_dict(wire) == layout
    assert KVLayout.from_dict(wire).fingerprint() == layout.fingerprint()


def test_from_dict_names_missing_and_unknown_keys():
    data = llama().to_dict()
    del data["head_dim"]
    data["colour"] = "blue"
    with pytest.raises(ValueError, match=r"missing keys \['head_dim'\], unknown keys \['colour'\]"):
        KVLayout.from_dict(data)
    with pytest.raises(TypeError, match="expects a dict, got list"):
        KVLayout.from_dict([1, 2])


def test_engine_is_on_the_wire_only_when_set():
    assert "engine" not in llama().to_dict()
    layout = llama(engine='{"backend":"CPU_ATTN"}')
    assert KVLayout.from_dict(layout.to_dict()) == layout
    with pytest.raises(TypeError, match="engine must be a str"):
        llama(engine=3)


def test_fingerprint_is_a_golden_value():
    assert llama().fingerprint() == LLAMA_FINGERPRINT


def test_fingerprint_is_stable_across_processes():
    code = ("import torch; from kvstore import KVLayout; "
            "print(KVLayout(kind='vllm_flash_nhd', num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, "
            "dtype=torch.bfloat16, model_id='llama-3-8b').fingerprint())")
    digests = set()
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        digests.add(result.stdout.strip())
    assert digests == {llama().fingerprint()}


@pytest.mark.parametrize("change", [
    dict(kind=KVLayoutKind.VLLM_FLASH_HND), dict(num_layers=31), dict(num_kv_heads=4), dict(head_dim=64),
    dict(block_size=32), dict(dtype=torch.float16), dict(model_id="llama-3-8b-instruct"), dict(tp_rank=1, tp_size=2),
    dict(tp_size=2), dict(engine="vllm backend X"),
], ids=lambda c: ",".join(c))
def test_fingerprint_covers_every_field(change):
    assert llama(**change).fingerprint() != llama().fingerprint()


def test_import_kvstore_does_not_import_torch():
    code = "import sys, kvstore; kvstore.__version__; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
