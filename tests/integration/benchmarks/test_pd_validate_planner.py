"""``python -m benchmarks.pd validate-planner``: the planner's replay checked against engine runs."""

from __future__ import annotations

import json

import pytest
from planner_runs import write_synthetic_runs

from benchmarks.pd.cli import main as pd_main

pytestmark = pytest.mark.timeout(60)


def test_validate_planner_command_reports_the_comparison(tmp_path, capsys):
    """The validation against the small engine is a benchmark command (timing-dependent, so not asserted
    here): on runs made under known coefficients its arithmetic reports the replay within tolerance, as a
    table and as JSON."""
    runs = [str(d) for d in write_synthetic_runs(tmp_path / "runs")]
    out = tmp_path / "validation.json"
    assert pd_main(["validate-planner", "--runs", *runs, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for arch in ("colocated", "chunked", "disaggregated"):
        assert arch in text
    assert "NO" not in text
    doc = json.loads(out.read_text())
    assert [d["arch"] for d in doc] == ["colocated", "chunked", "disaggregated"]
    assert all(abs(d["ttft_error"]) < 0.25 and abs(d["tpot_error"]) < 0.25 for d in doc)
    assert pd_main(["validate-planner", "--runs", *runs, "--tolerance", "1e-9"]) == 1
