"""bench_disk runs end to end on tiny sizes: the raw-device baseline, the tier, the Zipf runs and recovery."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import child_env

pytestmark = pytest.mark.timeout(240)


def test_bench_disk_prints_its_table_with_the_raw_baseline(tmp_path):
    out = tmp_path / "disk.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_disk", "--dir", str(tmp_path), "--sizes", "1MiB",
                           "--total", "8MiB", "--repeat", "1", "--memory", "4MiB", "--requests", "60",
                           "--recovery", "8MiB", "--json", str(out)],
                          capture_output=True, text=True, env=child_env(), timeout=220)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "raw O_DIRECT" in proc.stdout and "recovery:" in proc.stdout
    result = json.loads(out.read_text())
    row = result["sizes"]["1.0 MiB"]
    assert row["raw_direct"]["write_gbps"] > 0 and row["demote_x_raw"] > 0 and row["promote_x_raw"] > 0
    assert result["zipf_disk"]["hit_rate"] >= result["zipf_memory"]["hit_rate"]
    assert result["recovery"]["objects"] == 8
