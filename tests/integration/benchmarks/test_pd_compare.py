"""The measured comparison of benchmarks/pd: admission control and request classes, fault injection and
recovery, the comparison's metrics and verdicts, energy counters, and a whole (small) ``compare`` run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from paths import TRACES

from benchmarks.pd.admission import Budgeted, Budgets, Immediate, WorkerLoad
from benchmarks.pd.compare import CompareConfig, Source
from benchmarks.pd.deployment import Arch, DeploymentConfig, run
from benchmarks.pd.energy import NOT_MEASURED, EnergyMeter, _Rapl
from benchmarks.pd.fault import FaultKind, FaultLog, FaultSpec, choose_victim, recovery_report
from benchmarks.pd.metrics import burst, interference, slo_block
from benchmarks.pd.model import MODEL_PRESETS
from benchmarks.pd.router import Router
from benchmarks.pd.scheduler import Policy
from benchmarks.pd.stepmodel import StepModel
from benchmarks.pd.trace import BuiltinWorkload, TokenRequest, TraceScaling, generate
from benchmarks.pd.verdict import verdict
from kvstore.workloads.slo import SLO

TINY = MODEL_PRESETS["tiny"]
#: prefill of n tokens takes n ms; a decode step 10 ms + 1 ms per sequence (context ignored)
STEPS = StepModel(prefill=(0.0, 0.001, 0.0), decode=(0.010, 0.001, 0.0))


def _req(rid: str, prompt: int = 100, output: int = 10, klass: str = "interactive", arrival: float = 0.0):
    return TokenRequest(rid, arrival, tuple(range(prompt)), output, prompt, output, klass=klass)


# -- admission control -----------------------------------------------------------------------------------
def test_immediate_sends_the_oldest_request_to_the_least_loaded_worker() -> None:
    a, b = WorkerLoad(0, Policy.CHUNKED), WorkerLoad(1, Policy.CHUNKED)
    a.prefill["x"] = _req("x", 500)
    queue = [_req("r1"), _req("r2")]
    assert Immediate().next_prefill(queue, [a, b], 0.0) == (queue[0], b)
    assert Immediate().next_decode([], [a, b], 0.0) is None
    assert Immediate().next_prefill(queue, [], 0.0) is None  # no live worker: the request waits


def test_prefill_queue_holds_interactive_requests_against_the_ttft_budget() -> None:
    policy = Budgeted(Budgets(ttft_s=0.5, tpot_s=0.1), STEPS)
    w = WorkerLoad(0, Policy.PREFILL_ONLY)
    first = _req("first", prompt=400)
    assert policy.next_prefill([first], [w], 0.0) == (first, w)  # empty worker: always
    w.prefill["first"] = first
    second = _req("second", prompt=200)  # 400 ms queued + 200 ms own > 500 ms budget
    assert policy.next_prefill([second], [w], 0.0) is None
    small = _req("small", prompt=50)  # 400 + 50 <= 500 -- but FIFO: it cannot overtake "second"
    assert policy.next_prefill([second, small], [w], 0.0) is None
    other = WorkerLoad(1, Policy.PREFILL_ONLY)  # bound late to whichever worker has the shortest backlog
    assert policy.next_prefill([second, small], [w, other], 0.0) == (second, other)


def test_background_requests_only_fill_slack() -> None:
    policy = Budgeted(Budgets(ttft_s=1.0, tpot_s=0.1, background_max_wait_s=30.0), STEPS)
    doc, chat = _req("doc", prompt=800, klass="background"), _req("chat", prompt=50, arrival=1.0)
    colocated = WorkerLoad(0, Policy.PREFILL_FIRST)
    assert policy.next_prefill([doc, chat], [colocated], 1.0) == (chat, colocated)  # interactive overtakes
    colocated.prefill["chat"] = chat
    assert policy.next_prefill([doc], [colocated], 1.0) is None  # a prefill is queued there
    colocated.decode["chat"] = colocated.prefill.pop("chat")
    # the worker is decoding an interactive request: 800 ms of prefill-first would stall it past the TPOT budget
    assert policy.stall_s(colocated, doc) == pytest.approx(0.8)
    assert policy.next_prefill([doc], [colocated], 1.0) is None
    chunked = WorkerLoad(1, Policy.CHUNKED)
    chunked.decode["chat2"] = _req("chat2")
    assert policy.stall_s(chunked, doc) == pytest.approx(0.256 + 0.011)  # one 256-token chunk + the decode step
    prefill_only = WorkerLoad(2, Policy.PREFILL_ONLY)
    assert policy.next_prefill([doc], [colocated, prefill_only], 1.0) == (doc, prefill_only)  # no decodes there
    assert policy.next_prefill([doc], [colocated], 31.0) == (doc, colocated)  # starved: admitted anyway


def test_decode_queue_holds_requests_against_the_tpot_budget() -> None:
    policy = Budgeted(Budgets(ttft_s=1.0, tpot_s=0.015), STEPS)  # room for 5 sequences (10 ms + 1 ms each)
    w = WorkerLoad(0, Policy.DECODE_ONLY)
    for i in range(5):
        req = _req(f"d{i}")
        assert policy.next_decode([req], [w], 0.0) == (req, w)
        w.decode[req.id] = req
    late_bg, late = _req("bg", klass="background"), _req("late", arrival=0.5)
    assert policy.next_decode([late_bg, late], [w], 1.0) is None  # a sixth would make every token slower
    w.decode.pop("d0")
    assert policy.next_decode([late_bg, late], [w], 1.0) == (late, w)  # interactive first
    assert policy.next_decode([late_bg], [WorkerLoad(1, Policy.DECODE_ONLY)], 1.0)[0] is late_bg  # empty batch


def test_budgets_validate() -> None:
    with pytest.raises(ValueError, match="ttft_s"):
        Budgets(ttft_s=0, tpot_s=0.1)
    assert Budgets(ttft_s=0.5, tpot_s=0.1).max_wait_s == 5.0


class RecordingPool:
    """Disaggregated roles; prefill hands off at once, decode finishes at once, every send recorded."""

    def __init__(self):
        self.sent: list[tuple[int, str, str]] = []
        self.outbox: list[dict] = []

    def start(self) -> list[dict]:
        return [{"worker": i, "weight_bytes": 1, "kv_cache_bytes": 1} for i in range(2)]

    def begin(self, t0: float) -> None:
        pass

    def send(self, index: int, op: str, **fields) -> None:
        r = fields["req"]
        self.sent.append((index, op, r["id"]))
        times = {"queued_s": 0.0, "admitted_s": 0.0, "prefill_start_s": 0.0, "prefill_end_s": 0.0,
                 "publish_s": 0.0, "fetch_s": 0.0, "error": None}
        done = "handed_off" if op == "add" else "finished"
        out = [3] if op == "add" else [3] * r["max_output"]
        self.outbox.append({"op": done, "worker": index, "req": {**times, "id": r["id"], "output_ids": out,
                                                                 "token_times_s": [0.0] * len(out)}})

    def pump(self, timeout: float) -> list[dict]:
        out, self.outbox = self.outbox, []
        return out

    def stop(self) -> list[dict]:
        return []

    def abort(self) -> None:
        pass


def test_router_admits_interactive_requests_ahead_of_a_background_burst() -> None:
    reqs = [_req(f"bg{i}", 500, 4, "background") for i in range(3)] + [_req(f"i{i}", 50, 4) for i in range(3)]
    trace = dataclasses.replace(generate(BuiltinWorkload.SHORT, 1), requests=tuple(reqs))
    pool = RecordingPool()
    policy = Budgeted(Budgets(ttft_s=1.0, tpot_s=0.1), STEPS)
    records, _ = Router(trace, pool, [Policy.PREFILL_ONLY, Policy.DECODE_ONLY], lambda n: n, admission=policy).run()
    assert all(r.finished for r in records)
    prefills = [rid for _, op, rid in pool.sent if op == "add"]
    assert prefills[:3] == ["i0", "i1", "i2"] and sorted(prefills[3:]) == ["bg0", "bg1", "bg2"]


# -- faults ----------------------------------------------------------------------------------------------
def test_fault_spec_parses_and_rejects() -> None:
    assert FaultSpec.parse("decode-crash@2.5") == FaultSpec(FaultKind.DECODE_CRASH, 2.5)
    assert str(FaultSpec.parse("decode-crash@3")) == "decode-crash@3"
    for bad in ("decode-crash", "prefill-crash@1", "decode-crash@-1", "decode-crash@x"):
        with pytest.raises(ValueError, match="bad fault"):
            FaultSpec.parse(bad)


def test_victim_is_the_busiest_decode_capable_worker() -> None:
    roles = {0: Policy.PREFILL_ONLY, 1: Policy.DECODE_ONLY, 2: Policy.DECODE_ONLY}
    assert choose_victim(roles, {0: 9, 1: 2, 2: 1}) == 1
    assert choose_victim({0: Policy.CHUNKED, 1: Policy.CHUNKED}, {}) == 1
    assert choose_victim({0: Policy.PREFILL_ONLY}, {0: 3}) is None


def test_recovery_report_times_the_last_interrupted_request() -> None:
    log = FaultLog(FaultSpec(FaultKind.DECODE_CRASH, 1.0), victim=1, killed_at_s=1.0, detected_at_s=1.01,
                   replacement_ready_at_s=3.0, interrupted=["a", "b"], refetched=["a"], recomputed=["b"])
    rows = [{"id": "a", "lost": False, "recomputed": 0, "token_times_s": [2.5, 2.6]},
            {"id": "b", "lost": False, "recomputed": 1, "token_times_s": [1.4, 1.5]},
            {"id": "c", "lost": False, "recomputed": 0, "token_times_s": [0.2]}]
    report = recovery_report(log, rows)
    assert report["requests_lost"] == 0 and report["requests_recomputed"] == 1 and report["requests_refetched"] == 1
    assert report["recovery_s"] == pytest.approx(1.5) and report["replacement_ready_s"] == pytest.approx(2.0)
    assert recovery_report(None, rows) is None
    assert recovery_report(FaultLog(FaultSpec(FaultKind.DECODE_CRASH, 9.0)), rows)["injected"] is False


@pytest.mark.timeout(150)
@pytest.mark.parametrize("arch", [Arch.COLOCATED, Arch.DISAGGREGATED])
def test_decode_crash_loses_nothing(tmp_path: Path, arch: Arch) -> None:
    """A decode worker SIGKILLed mid-run: its requests are re-fetched (disaggregated) or re-prefilled
    (colocated) and every output is still exactly the greedy output of an undisturbed run."""
    from test_pd_engine import greedy_reference

    from benchmarks.pd.model import LlamaModel

    base = generate(BuiltinWorkload.SHORT, 8, seed=5, vocab_size=TINY.vocab_size, rate_rps=20.0)
    trace = dataclasses.replace(base, requests=tuple(dataclasses.replace(r, output_tokens=300)
                                                     for r in base.requests))
    cfg = DeploymentConfig(arch, model=TINY, num_blocks=512, chunk_budget=64, prefill_batch_tokens=256)
    summary = run(cfg, trace, tmp_path, fault=FaultSpec(FaultKind.DECODE_CRASH, 0.4))
    fault = summary["fault"]
    assert fault["injected"] and fault["requests_lost"] == 0 and summary["requests"]["completed"] == 8
    assert fault["requests_interrupted"] > 0, fault  # 8 requests of 300 tokens: the victim was busy at 0.4 s
    if arch is Arch.DISAGGREGATED:  # the KV outlived the dead worker in the store
        assert fault["requests_refetched"] == fault["requests_interrupted"] and fault["requests_recomputed"] == 0
        assert summary["transfer"]["kv_bytes_transferred"] > sum(
            r["kv_bytes"] for r in map(json.loads, (tmp_path / "requests.jsonl").read_text().splitlines()))
    else:
        assert fault["requests_recomputed"] == fault["requests_interrupted"] and fault["requests_refetched"] == 0
    assert fault["recovery_s"] > 0 and fault["detected_after_s"] >= 0
    if arch is Arch.DISAGGREGATED:  # nothing decodes until the replacement is up
        assert fault["replacement_ready_s"] > 0 and len(summary["respawned_workers"]) == 1
        assert fault["recovery_s"] >= fault["replacement_ready_s"]
    else:  # the survivor re-prefilled them at once; the run may end before the replacement is ready
        assert fault["replacement_ready_s"] is None or fault["recovery_s"] < fault["replacement_ready_s"]
    torch.set_num_threads(1)  # the reference, alone: two threads on a busy 2-core machine are 20x slower
    model = LlamaModel(TINY)
    rows = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    for row, req in zip(rows, trace.requests, strict=True):
        assert row["output_token_ids"] == greedy_reference(model, list(req.prompt_ids), req.output_tokens)


# -- metrics and verdicts --------------------------------------------------------------------------------
def _row(rid: str, worker: int, times: list[float], klass: str = "interactive", **kw) -> dict:
    return {"id": rid, "class": klass, "decode_worker": worker, "token_times_s": times, "lost": False,
            "arrival_s": kw.get("arrival_s", 0.0), "prefill_end_s": kw.get("prefill_end_s", times[0]),
            "ttft_s": kw.get("ttft_s", 0.1), "tpot_s": kw.get("tpot_s", 0.01)}


def _step(worker: int, start: float, end: float, prefill: int) -> dict:
    return {"worker": worker, "start_s": start, "end_s": end, "prefill_tokens": prefill,
            "decode_tokens": 1, "transfer_s": 0.0}


def test_interference_counts_gaps_that_a_prefill_step_interrupted() -> None:
    rows = [_row("a", 0, [0.0, 0.01, 0.02, 0.22, 0.23]), _row("b", 1, [0.0, 0.01, 0.02])]
    timeline = [_step(0, -0.1, 0.0, 64), _step(0, 0.021, 0.21, 500), _step(1, 0.005, 0.2, 500)]
    i = interference(rows, timeline)
    # a's own prefill (it ends with a's first token) does not count; the one starting at 0.021 s does, and so
    # does worker 1's, which starts inside b's first gap
    assert (i["gaps"], i["gaps_with_prefill"]) == (6, 2)
    assert i["gap_p50_decode_only_s"] == pytest.approx(0.01)
    assert i["tpot_inflation"] > 1
    assert interference([_row("c", 2, [0.0, 0.01])], timeline)["tpot_inflation"] == 0.0


def test_burst_splits_interactive_gaps_by_the_background_window() -> None:
    rows = [_row("bg", 0, [5.0], "background", arrival_s=1.0, prefill_end_s=2.0),
            _row("in", 1, [1.5, 1.6, 1.9]), _row("out", 1, [3.0, 3.01, 3.02])]
    b = burst(rows)
    assert b["background_window_s"] == [1.0, 2.0] and b["interactive_gaps_inside"] == 2
    assert b["interactive_gap_p90_inside_s"] > b["interactive_gap_p90_outside_s"]
    assert burst([_row("x", 0, [0.0, 1.0])]) is None


def _card(met: bool, moved: int, attain: float = 1.0) -> dict:
    return {"slo": {"met": met, "attainment_interactive": attain, "goodput_rps": 1.0, "attainment": attain},
            "memory": {"model_memory_duplication": 2.0, "peak_kv_bytes": 10, "store_kv_bytes_at_end": None},
            "transfer": {"kv_bytes_transferred": moved, "handoffs": 1 if moved else 0,
                         "transfer_s": {"p50": 0.01, "p99": 0.02}, "share_of_ttft": {"p50": 0.2, "aggregate": 0.1}},
            "compute": {"cpu_s": {"workers": {"0": 1.0}, "router": 0.1}}, "requests": {"lost": 0},
            "ttft_s": {"p50": 0.1, "p90": 2.0, "p99": 3.0}, "tpot_s": {"p50": 0.01, "p90": 0.02, "p99": 0.03},
            "decode_queue_s": {"p50": 0.0, "p90": 0.0, "p99": 0.0}, "burst": None,
            "interference": {"gaps": 10, "gaps_with_prefill": 2, "share_with_prefill": 0.2,
                             "gap_p50_with_prefill_s": 0.3, "gap_p50_decode_only_s": 0.03, "tpot_inflation": 9.0}}


def test_verdict_picks_the_cheapest_architecture_that_meets_the_slos() -> None:
    slo = SLO(1.0, 0.1)
    v = verdict({"colocated": _card(False, 0, 0.5), "chunked": _card(True, 0), "disaggregated": _card(True, 1 << 20)},
                slo)
    assert v["winner"] == "chunked" and v["meets_slo"] == ["chunked", "disaggregated"]
    assert "TTFT p90 2000 ms > 1000 ms" in v["misses"]["colocated"] and "+900%" in v["text"]
    v = verdict({"colocated": _card(False, 0, 0.5), "disaggregated": _card(False, 1, 0.7)}, slo)
    assert v["winner"] is None and v["closest"] == "disaggregated" and "no architecture" in v["text"]


def test_slo_block_holds_interactive_requests_to_the_slo_and_loses_none() -> None:
    slo = SLO(1.0, 0.1, attainment=0.5)
    row = {"lost": False, "ttft_s": 0.5, "tpot_s": None, "class": "interactive"}  # one output token: no TPOT
    slow_bg = {**row, "tpot_s": 0.2, "class": "background"}
    block = slo_block([row, slow_bg], slo, duration_s=2.0)
    assert block == {"goodput_rps": 0.5, "attainment": 0.5, "attainment_interactive": 1.0, "met": True}
    assert not slo_block([row, {**row, "lost": True}], slo, duration_s=2.0)["met"]  # a lost request


# -- energy ----------------------------------------------------------------------------------------------
def test_energy_reads_rapl_counters_and_handles_wraparound(tmp_path: Path) -> None:
    for name, value in (("intel-rapl:0", "1000"), ("intel-rapl:0:0", "5"), ("intel-rapl:1", "900000")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "energy_uj").write_text(value)
        (tmp_path / name / "max_energy_range_uj").write_text("1000000")
    rapl, reason = _Rapl.find(tmp_path)
    assert reason == "" and [p.name for p in rapl.domains] == ["intel-rapl:0", "intel-rapl:1"]
    start = rapl.read()
    (tmp_path / "intel-rapl:0" / "energy_uj").write_text("3001000")  # +3 J
    (tmp_path / "intel-rapl:1" / "energy_uj").write_text("100000")  # wrapped: +0.2 J
    assert rapl.joules(start, rapl.read()) == pytest.approx(3.2)
    assert _Rapl.find(tmp_path / "absent")[0] is None


def test_energy_is_never_an_estimate() -> None:
    with EnergyMeter() as meter:
        pass
    result = meter.result()
    assert result["joules"] == NOT_MEASURED and result["reason"] or isinstance(result["joules"], float)


# -- traces and sources ----------------------------------------------------------------------------------
def test_burst_workload_is_interactive_traffic_plus_a_background_burst() -> None:
    trace = generate(BuiltinWorkload.BURST, 40, seed=1)
    bg = [r for r in trace.requests if r.klass == "background"]
    assert len(bg) == 10 and all(r.prompt_tokens >= 640 for r in bg)
    assert max(r.arrival_s for r in bg) - min(r.arrival_s for r in bg) <= 1.0
    arrivals = [r.arrival_s for r in trace.requests]
    assert arrivals == sorted(arrivals) and [r.id for r in trace.requests] == sorted(r.id for r in trace.requests)
    assert min(r.arrival_s for r in bg) > 0 and max(arrivals) > max(r.arrival_s for r in bg)


def test_trace_sources_take_explicit_per_trace_scaling(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.0,1000,10\n")
    src = Source.parse_trace(f"{path},prompt=0.1,time=2,n=5,max-prompt=64", TraceScaling(output_scale=0.5))
    assert src.scaling == TraceScaling(prompt_scale=0.1, output_scale=0.5, time_scale=2.0, max_prompt_tokens=64)
    assert src.num_requests == 5
    trace = src.build(num_requests=99, seed=0, vocab_size=64)
    assert trace.requests[0].prompt_tokens == 64 and trace.capped_requests == 1
    with pytest.raises(ValueError, match="bad trace option"):
        Source.parse_trace(f"{path},speed=2", TraceScaling())
    with pytest.raises(ValueError, match="not found"):
        Source.parse_trace(str(tmp_path / "nope.csv"), TraceScaling())
    with pytest.raises(ValueError, match="nothing to compare"):
        CompareConfig(sources=(), out_dir=tmp_path)
    with pytest.raises(ValueError, match="reruns"):
        CompareConfig(sources=(src,), out_dir=tmp_path, reruns=-1)


# -- a whole comparison ----------------------------------------------------------------------------------
METRICS = [("throughput", "prompt_tokens_per_s"), ("throughput", "output_tokens_per_s"),
           ("ttft_s", "p50"), ("ttft_s", "p90"), ("ttft_s", "p99"), ("tpot_s", "p50"), ("tpot_s", "p90"),
           ("tpot_s", "p99"), ("prefill_queue_s", "p50"), ("decode_queue_s", "p99"),
           ("transfer", "kv_bytes_transferred"), ("transfer", "transfer_s"), ("transfer", "share_of_ttft"),
           ("memory", "model_memory_duplication"), ("memory", "peak_kv_bytes"), ("energy", "joules"),
           ("slo", "goodput_rps"), ("interference", "tpot_inflation")]


@pytest.mark.timeout(170)
@pytest.mark.skipif(not TRACES.exists(), reason="sample traces not present")
def test_compare_writes_summary_and_reports_for_every_arch_and_source(tmp_path: Path) -> None:
    from benchmarks.pd.cli import main

    out = tmp_path / "cmp"
    assert main(["compare", "--workloads", "short", "--num-requests", "5", "--rate-scale", "4",
                 "--trace", f"{TRACES / 'mooncake_synthetic_trace.jsonl'},prompt=0.01,output=0.05,time=0.1",
                 "--trace", f"{TRACES / 'azure_llm_code_2023.csv'},prompt=0.02,output=0.5,time=0.05",
                 "--model", "tiny", "--num-blocks", "512", "--no-progress", "--out", str(out)]) == 0
    doc = json.loads((out / "summary.json").read_text())
    sources = ["short", "mooncake_synthetic_trace", "azure_llm_code_2023"]
    assert list(doc["results"]) == sources and list(doc["verdicts"]) == sources
    for source in sources:
        assert list(doc["results"][source]) == ["colocated", "chunked", "disaggregated"]
        for arch, card in doc["results"][source].items():
            for group, key in METRICS:
                assert key in card[group], (source, arch, group, key)
            assert card["requests"]["lost"] == 0 and card["requests"]["completed"] == 5
            assert card["compute"]["workers"] == (["prefill-only", "decode-only"] if arch == "disaggregated"
                                                  else [arch if arch == "chunked" else "prefill-first"] * 2)
            moved = card["transfer"]["kv_bytes_transferred"]
            assert (moved > 0) == (arch == "disaggregated")
            assert card["memory"]["model_memory_duplication"] == 2.0
        assert doc["verdicts"][source]["text"]
    traces = doc["setup"]["traces"]
    assert traces["mooncake_synthetic_trace"]["prompt_scale"] == 0.01
    assert traces["azure_llm_code_2023"]["time_scale"] == 0.05
    assert "2 engine worker processes x 1 torch thread" in (out / "report.md").read_text()
    md, page = (out / "report.md").read_text(), (out / "report.html").read_text()
    for png in ["cdf_short.png", "cdf_mooncake_synthetic_trace.png", "cdf_azure_llm_code_2023.png",
                "timeline_short.png"]:
        assert f"]({png})" in md and (out / png).stat().st_size > 1000
    assert page.count("data:image/png;base64,") == 4 and "<table>" in page
    assert "prompt scale" in md and "0.01" in md  # the scaling is printed
