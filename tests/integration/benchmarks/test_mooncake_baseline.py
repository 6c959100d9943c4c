"""benchmarks/mooncake_baseline.py's batch anchor for the hand-off benchmark: Mooncake's batch_put_from /
batch_get_into of a hand-off's chunks. The runs start real Mooncake processes and skip where Mooncake cannot run
(CI without the wheel or libibverbs); the geometry and the never-raise contract are checked everywhere."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest
import torch

from benchmarks import mooncake_baseline as mb
from kvstore import KVLayout, KVLayoutKind
from kvstore.handoff import KVHandoff

pytestmark = pytest.mark.timeout(180)
MiB = 1 << 20


def test_handoff_geometry_is_kvhandoffs():
    layout = KVLayout(kind=KVLayoutKind.VLLM_FLASH_NHD, num_layers=32, num_kv_heads=8, head_dim=128, block_size=16,
                      dtype=torch.bfloat16, model_id="llama-3-8b")
    assert mb.LLAMA3_8B_BLOCK_BYTES == layout.block_nbytes == 2 * MiB
    assert mb.HANDOFF_CHUNK_BLOCKS == inspect.signature(KVHandoff).parameters["chunk_blocks"].default
    assert mb.handoff_chunks(1) == [2 * MiB]
    assert mb.handoff_chunks(16) == [32 * MiB]
    assert mb.handoff_chunks(64) == [32 * MiB] * 4
    assert mb.handoff_chunks(20) == [32 * MiB, 8 * MiB]
    assert mb.handoff_chunks(5, 100, 2) == [200, 200, 100]
    for bad in ((0,), (1, 0), (1, 2 * MiB, 0), (True,), (1.5,)):
        with pytest.raises(ValueError, match="must be an int >= 1"):
            mb.handoff_chunks(*bad)


@pytest.mark.parametrize("call, reason", [
    (lambda: mb.measure_batches(0, [1]), "chunk_size must be"),
    (lambda: mb.measure_batches(4096, []), "counts must be"),
    (lambda: mb.measure_batches(4096, [1, -2]), "counts must be"),
    (lambda: mb.measure_batches(4096, [1], modes=("rdma",)), "modes ['rdma']"),
    (lambda: mb.measure_handoff_batches([]), "at least one"),
    (lambda: mb.measure_handoff_batches([4], chunk_blocks=0), "chunk_blocks must be"),
])
def test_bad_arguments_are_an_unavailable_result_not_an_exception(call, reason):
    res = call()
    assert res["available"] is False and res["rows"] == []
    assert res["reason"].startswith("bad arguments") and reason in res["reason"]


def test_without_mooncake_the_result_is_well_formed_and_says_why(monkeypatch):
    monkeypatch.setattr(mb, "detect", lambda: {"installed": False, "package": None, "master": None,
                                               "reason": "Mooncake is not installed (test)"})
    res = mb.measure_batches(4096, [1, 2])
    assert res["available"] is False and res["rows"] == [] and res["reason"] == "Mooncake is not installed (test)"
    assert res["batches"] == [{"count": 1, "size": 4096}, {"count": 2, "size": 8192}]
    assert res["total_s"] >= 0 and "loadavg_after" in res


@pytest.fixture(scope="module")
def mooncake() -> dict:
    info = mb.detect()
    if not info["installed"]:
        pytest.skip(f"Mooncake cannot run here: {info['reason']}")
    return info


def _cli(tmp_path, *args: str) -> tuple[str, dict]:
    out = tmp_path / "res.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.mooncake_baseline", *args, "--time-budget", "6",
                           "--json", str(out)], capture_output=True, text=True, timeout=150,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout, json.loads(out.read_text())


def _check_rows(res: dict, expected: list[tuple[int, int, int]]) -> None:
    """Every (count, chunk_size, size) batch has a put and a get row with positive times and checked bytes."""
    assert res["available"] is True, res["reason"]
    got = sorted((r["op"], r["count"], r["chunk_size"], r["size"]) for r in res["rows"])
    assert got == sorted((op, *e) for op in mb.BATCH_OPS for e in expected)
    for r in res["rows"]:
        assert r["path"] == "mooncake+tcp" and r["verified"] is True
        assert 0 < r["p50_us"] <= r["p99_us"] and r["gbps"] > 0 and r["n"] >= mb.MIN_ITERS


def test_cli_batch_times_both_batch_calls_and_checks_the_bytes(mooncake, tmp_path):
    stdout, res = _cli(tmp_path, "--batch", "4KiB", "--counts", "1,3")
    _check_rows(res, [(1, 4096, 4096), (3, 4096, 3 * 4096)])
    assert mb.batch_row(res, "batch_get_into", count=3)["size"] == 3 * 4096
    assert "batch_put_from" in stdout and "checked against those written: equal" in stdout


def test_handoff_batches_follow_the_chunk_geometry(mooncake, tmp_path):
    stdout, res = _cli(tmp_path, "--handoff-blocks", "1,3", "--block-bytes", "4KiB", "--chunk-blocks", "2")
    _check_rows(res, [(1, 4096, 4096), (2, 8192, 3 * 4096)])  # 3 blocks: one chunk of 2, one of 1
    assert mb.batch_row(res, "batch_put_from", blocks=3)["count"] == 2
    assert res["block_nbytes"] == 4096 and res["chunk_blocks"] == 2
    assert "blocks" in stdout.splitlines()[1]
