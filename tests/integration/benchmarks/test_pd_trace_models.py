"""The small engine's token traces (benchmarks.pd.trace) are the library's trace model (kvstore.workloads.trace)
tokenized: the same records, read with the same policy through the one reader (kvstore.workloads.tracefile)."""

from __future__ import annotations

from pathlib import Path

import pytest
from paths import TRACES
from trace_samples import AZURE_SAMPLE, MOONCAKE_SAMPLE

from benchmarks.pd import trace as pd_trace
from kvstore.workloads import trace as planner_trace
from kvstore.workloads.tracefile import read_records

pytestmark = pytest.mark.timeout(60)

MOONCAKE = TRACES / "mooncake_synthetic_trace.jsonl"
AZURE = TRACES / "azure_llm_code_2023.csv"


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# -- both models read the same records with the same policy -------------------------------------------------
def test_planner_and_engine_models_agree_on_the_inline_samples(tmp_path):
    for name, text in (("m.jsonl", MOONCAKE_SAMPLE), ("a.csv", AZURE_SAMPLE)):
        path = _write(tmp_path, name, text)
        planner = planner_trace.load_trace(path)
        engine = pd_trace.load_token_trace(path, vocab_size=64)
        recs = sorted(read_records(path), key=lambda r: r.arrival_s)
        t0 = recs[0].arrival_s
        assert [(r.prompt_tokens, r.output_tokens) for r in planner.requests] == \
            [(r.prompt_tokens, r.output_tokens) for r in recs]
        assert [r.arrival_s for r in planner.requests] == pytest.approx([r.arrival_s - t0 for r in recs])
        by_arrival = sorted(engine.requests, key=lambda r: r.arrival_s)
        assert [(r.source_prompt_tokens, r.source_output_tokens) for r in by_arrival] == \
            [(r.prompt_tokens, r.output_tokens) for r in recs]
        assert [r.arrival_s for r in by_arrival] == pytest.approx([r.arrival_s - t0 for r in recs])


def test_engine_model_keeps_seeds_scaling_and_shared_prefixes(tmp_path):
    path = _write(tmp_path, "m.jsonl", MOONCAKE_SAMPLE)
    scaling = pd_trace.TraceScaling(prompt_scale=0.01, time_scale=2.0)
    a = pd_trace.load_token_trace(path, seed=3, vocab_size=64, scaling=scaling)
    assert a == pd_trace.load_token_trace(path, seed=3, vocab_size=64, scaling=scaling)
    # ids number the requests in arrival order, as the library's trace does (the sample's lines are not)
    first, second = (r for r in a.requests if r.id in ("r00000", "r00002"))
    assert first.prompt_tokens == round(1030 * 0.01) and second.arrival_s == 3.0
    assert first.prompt_ids[:6] == second.prompt_ids[:6]  # hash id 0 -> the same ceil(512 * 0.01) tokens
    assert len(pd_trace.load_token_trace(path, num_requests=2).requests) == 2


@pytest.mark.skipif(not AZURE.is_file(), reason=f"{AZURE} not present")
def test_shipped_azure_trace_reads_in_the_engine_model():
    engine = pd_trace.load_token_trace(AZURE, scaling=pd_trace.TraceScaling(prompt_scale=0.01), vocab_size=64)
    assert len(engine.requests) == 8819 and 3000 < engine.describe()["duration_s"] < 3600


@pytest.mark.skipif(not MOONCAKE.is_file(), reason=f"{MOONCAKE} not present")
def test_shipped_mooncake_trace_reads_in_the_engine_model():
    engine = pd_trace.load_token_trace(MOONCAKE, num_requests=20, scaling=pd_trace.TraceScaling(prompt_scale=0.01))
    assert [r.source_prompt_tokens for r in engine.requests[:1]] == [40160]


def test_token_traces_are_the_library_trace_tokenized(tmp_path):
    path = _write(tmp_path, "m.jsonl", MOONCAKE_SAMPLE)
    scaling = pd_trace.TraceScaling(prompt_scale=0.01)
    library = planner_trace.load_trace(path)
    tokens = pd_trace.tokenize(library, seed=1, vocab_size=64, scaling=scaling, source=str(path))
    assert tokens == pd_trace.load_token_trace(path, seed=1, vocab_size=64, scaling=scaling)
    assert [r.id for r in tokens.requests] == [f"r{r.id:05d}" for r in library.requests]
    background = planner_trace.Trace("bg", (planner_trace.TraceRequest(0, 0.0, 5, 2, klass="background"),))
    assert [r.klass for r in pd_trace.tokenize(background).requests] == ["background"]
    burst = pd_trace.generate(pd_trace.BuiltinWorkload.BURST, 12, seed=2)
    assert {r.klass for r in burst.requests} == {"interactive", "background"}
