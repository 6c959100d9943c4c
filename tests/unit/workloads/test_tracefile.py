"""The one trace-file reader (kvstore.workloads.tracefile) and the one trace model built from it (the small
engine's tokenizing of it is checked in tests/integration/benchmarks/test_pd_trace_models.py)."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest
from paths import TRACES
from trace_samples import AZURE_SAMPLE, MOONCAKE_SAMPLE

from kvstore.workloads import trace as planner_trace
from kvstore.workloads.tracefile import TraceFormat, parse_azure_timestamp, read_records

pytestmark = pytest.mark.timeout(60)

MOONCAKE = TRACES / "mooncake_synthetic_trace.jsonl"
AZURE = TRACES / "azure_llm_code_2023.csv"

def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# -- the timestamp parser -----------------------------------------------------------------------------------
def test_azure_seven_digit_fraction_is_parsed_without_fromisoformat_limits():
    # datetime.fromisoformat rejects seven fractional digits before Python 3.11; the parser must not.
    base = datetime(2023, 11, 16, 18, 17, 3).timestamp()
    assert parse_azure_timestamp("2023-11-16 18:17:03.9799600") == pytest.approx(base + 0.97996, abs=1e-7)
    assert parse_azure_timestamp(" 2023-11-16 18:17:03 ") == base
    assert parse_azure_timestamp("2023-11-16T18:17:03.5") == pytest.approx(base + 0.5)
    utc = datetime.fromisoformat("2023-11-16 18:17:03+00:00").timestamp()
    assert parse_azure_timestamp("2023-11-16 18:17:03.2500000+00:00") == pytest.approx(utc + 0.25)


@pytest.mark.parametrize("text", ["", "yesterday", "2023-11-16", "2023-13-16 18:17:03.1", "2023-11-16 18:17:03.x"])
def test_bad_azure_timestamps_raise_value_error_naming_the_text(text):
    with pytest.raises(ValueError, match="not a timestamp"):
        parse_azure_timestamp(text)


# -- records ------------------------------------------------------------------------------------------------
def test_mooncake_records_in_file_order_with_lines_and_zero_clamped(tmp_path):
    recs = list(read_records(_write(tmp_path, "m.jsonl", MOONCAKE_SAMPLE)))
    assert [r.line for r in recs] == [1, 3, 4]
    assert [r.arrival_s for r in recs] == [0.0, 1.5, 0.7505]
    assert [(r.prompt_tokens, r.output_tokens) for r in recs] == [(1030, 6), (600, 1), (10, 3)]
    assert [r.prefix_ids for r in recs] == [(0, 1, 2), (0, 7), (9,)]
    assert [r.clamped for r in recs] == [False, True, False]


def test_azure_records_with_seven_digit_fractions_and_zero_clamped(tmp_path):
    recs = list(read_records(_write(tmp_path, "a.csv", AZURE_SAMPLE)))
    assert [r.line for r in recs] == [2, 3, 4]
    assert recs[1].arrival_s - recs[0].arrival_s == pytest.approx(0.052)
    assert recs[2].arrival_s - recs[0].arrival_s == pytest.approx(2 - 0.97996)
    assert [(r.prompt_tokens, r.output_tokens, r.clamped) for r in recs] == [(4808, 10, False), (3180, 1, True),
                                                                             (1, 7, True)]


def test_hash_ids_are_optional_for_the_reader(tmp_path):
    path = _write(tmp_path, "m.jsonl", '{"timestamp": 2, "input_length": 5, "output_length": 1}\n')
    assert [r.prefix_ids for r in read_records(path)] == [()]


@pytest.mark.parametrize(("name", "text", "needle"), [
    ("m.jsonl", '{"timestamp": 0, "input_length": -3, "output_length": 2}\n', r"m.jsonl:1:.*input_length must be >= 0"),
    ("m.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 2}\n{"timestamp": 1}\n',
     r"m.jsonl:2:.*'input_length' missing"),
    ("m.jsonl", '{"timestamp": "x", "input_length": 5, "output_length": 2}\n', r"m.jsonl:1:.*'timestamp'"),
    ("m.jsonl", '{"timestamp": 0, "input_length": 2.5, "output_length": 2}\n', r"input_length must be an integer"),
    ("m.jsonl", "not json\n", r"m.jsonl:1: not a Mooncake trace record"),
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.1,5,-1\n",
     r"a.csv:2:.*GeneratedTokens must be >= 0"),
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nnoon,5,1\n", r"a.csv:2:.*not a timestamp"),
    ("a.csv", "a,b\n1,2\n", r"missing columns \['ContextTokens', 'GeneratedTokens', 'TIMESTAMP'\]"),
])
def test_bad_records_raise_value_error_with_the_location(tmp_path, name, text, needle):
    with pytest.raises(ValueError, match=needle):
        list(read_records(_write(tmp_path, name, text)))


def test_format_by_suffix():
    assert TraceFormat.from_path("x.jsonl") is TraceFormat.MOONCAKE is TraceFormat.from_path("x.JSON")
    assert TraceFormat.from_path("x.csv") is TraceFormat.AZURE
    with pytest.raises(ValueError, match="unknown format '.parquet'"):
        TraceFormat.from_path("x.parquet")


# -- the shipped traces (skipped without the shared folder) --------------------------------------------------
@pytest.mark.skipif(not AZURE.is_file(), reason=f"{AZURE} not present")
def test_shipped_azure_trace_reads():
    recs = list(read_records(AZURE))
    assert len(recs) == 8819 and recs[0].line == 2 and (recs[0].prompt_tokens, recs[0].output_tokens) == (4808, 10)
    assert recs[1].arrival_s - recs[0].arrival_s == pytest.approx(0.052)
    assert len(planner_trace.load_trace(AZURE)) == 8819


@pytest.mark.skipif(not MOONCAKE.is_file(), reason=f"{MOONCAKE} not present")
def test_shipped_mooncake_trace_reads():
    recs = list(read_records(MOONCAKE))
    assert len(recs) == 3993 and recs[0].prefix_ids[:3] == (0, 1, 2) and recs[0].prompt_tokens == 40160
    assert all(len(r.prefix_ids) * 512 >= r.prompt_tokens for r in recs)
    assert len(planner_trace.read_mooncake(MOONCAKE)) == 3993
