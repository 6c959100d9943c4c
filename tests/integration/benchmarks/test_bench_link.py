"""bench_link runs as documented (a smoke run: one rate, one small request, one repeat)."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_link
from kvstore.testing import hosts as H


def test_codec_only(tmp_path, capsys):
    out = tmp_path / "codec.json"
    assert bench_link.main(["--codec-only", "--codec-mib", "2", "--rates", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {r["data"] for r in result["codec"]} == {"random bytes", "randn bf16", "model KV bf16"}
    assert all(r["ratio"] > 0 and r["compress_gbs"] > 0 for r in result["codec"])
    assert result["needed_ratio"][0]["rate_gbit"] == 1
    assert "pays above ratio" in capsys.readouterr().out


@pytest.mark.skipif(H.unavailable_reason() is not None, reason=str(H.unavailable_reason()))
def test_one_small_handoff_across_a_link(tmp_path):
    out = tmp_path / "link.json"
    assert bench_link.main(["--no-codec", "--rates", "1", "--blocks", "2", "-n", "1", "--compression", "default,auto",
                            "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["compression"] for r in result["rows"]] == ["default", "auto"]
    assert result["paths"] == {"publisher": "shm", "default": "tcp", "auto": "tcp"}
    assert all(r["fetch_vs_raw"] > 0 for r in result["rows"])
    assert H.namespaces() == []
