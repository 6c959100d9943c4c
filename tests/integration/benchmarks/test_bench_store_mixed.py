"""bench_store --workload mixed runs end to end on a small daemon and reports the fill at the first eviction,
with relocation and without."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import child_env

pytestmark = pytest.mark.timeout(240)


def test_mixed_workload_reports_first_eviction_fill_beside_the_baseline(tmp_path):
    out = tmp_path / "mixed.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_store", "--workload", "mixed", "--runs", "1",
                           "--capacity", "32MiB", "--largest", "1MiB", "--steady", "0.5", "--json", str(out)],
                          capture_output=True, text=True, env=child_env(), timeout=220)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "first fill p10" in proc.stdout and "no-relocate" in proc.stdout
    result = json.loads(out.read_text())
    for kind in ("relocate", "no-relocate"):
        first = result["summary"][kind]["first_fill"]
        assert first is not None and 0.5 < first["p50"] <= 1.0
    assert result["summary"]["no-relocate"]["relocated_per_put_byte_p50"] == 0
