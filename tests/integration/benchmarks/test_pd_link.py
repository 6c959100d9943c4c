"""``compare --engine vllm --link``: the pure parts (rates, KV geometry, the planner check's arithmetic against
the real planner, the "where disaggregation stops paying" statement), and one tiny real run across two
namespace hosts (slow; skipped where namespaces, Redis or vLLM are missing)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from paths import ROOT

from benchmarks.pd import link as L
from benchmarks.pd.trace import TokenRequest, TokenTrace, TraceScaling
from kvstore.workloads.slo import SLO

pytestmark = pytest.mark.heavy(195)


def test_rates_parse_and_bad_ones_are_refused():
    assert L.parse_rates("1,10,25") == (1.0, 10.0, 25.0)
    assert L.parse_rates("2.5") == (2.5,)
    for bad in ("", "0", "-1", "1,1", "fast", "1000"):
        with pytest.raises(ValueError, match="--link"):
            L.parse_rates(bad)
    assert L.link_label(10.0) == "disaggregated@10gbit"


def test_kv_bytes_per_token_from_the_geometry():
    shape = {"num_attention_heads": 8, "hidden_size": 512, "num_hidden_layers": 4, "num_key_value_heads": 2}
    assert L.kv_bytes_per_token(shape, "bfloat16") == 2 * 4 * 2 * 64 * 2
    assert L.kv_bytes_per_token(shape, "float32") == 2 * 4 * 2 * 64 * 4


def _row(prompt: int, ttft: float, tpot: float | None) -> dict:
    return {"prompt_tokens": prompt, "ttft_s": ttft, "tpot_s": tpot}


def test_calibration_from_probes_is_a_step_and_a_slope():
    rows = [_row(128, 0.15, 0.01), _row(128, 0.17, 0.02), _row(1024, 1.05, 0.01), _row(1024, 1.07, 0.01),
            _row(50, 9.0, None)]
    cal = L.Calibration.from_rows(rows)
    assert cal.decode_step_s == pytest.approx(0.01)
    assert cal.prefill_token_s == pytest.approx((1.06 - 0.16) / (1024 - 128))
    one = L.Calibration.from_rows([_row(100, 0.11, 0.01), _row(200, 0.21, 0.02), _row(400, 0.41, 0.01)][:1])
    assert one.prefill_token_s == pytest.approx(0.001)  # one length: (TTFT - step) / prompt
    with pytest.raises(ValueError, match="no completed request"):
        L.Calibration.from_rows([_row(10, 0.1, None)])


def test_errors_are_signed_and_relative():
    assert L.rel_error(1.25, 1.0) == pytest.approx(0.25)
    assert L.rel_error(0.5, 1.0) == pytest.approx(-0.5)
    assert L.rel_error(1.0, 0.0) is None
    check = L.check_row("x", {"ttft_p50_s": 0.12, "tpot_p50_s": 0.01},
                        {"ttft_s": {"p50": 0.1}, "tpot_s": {"p50": 0.01}})
    assert check["error"]["ttft_p50_s"] == pytest.approx(0.2) and check["error"]["tpot_p50_s"] == pytest.approx(0)
    assert L.within(check, 0.25) and not L.within(check, 0.1)
    assert not L.within(L.check_row("x", {"ttft_p50_s": 1.0}, {"ttft_s": None}), 0.25)


def _trace(prompt: int, n: int = 4, gap_s: float = 30.0) -> TokenTrace:
    reqs = tuple(TokenRequest(f"r{i}", i * gap_s, tuple(range(prompt)), 8, 0, 0) for i in range(n))
    return TokenTrace("t", "t", reqs, TraceScaling(), 0)


def test_the_planner_predicts_a_slower_first_token_on_a_narrower_link():
    cost = L.Calibration(0.01, 1e-4).cost_model(kv_bytes=1 << 20, kv_capacity_tokens=100_000)
    slo = SLO(2.0, 0.1, 0.9)
    trace = _trace(1000)
    wide = L.predict(trace, cost, "disaggregated", 4096, 25.0, slo)
    narrow = L.predict(trace, cost, "disaggregated", 4096, 1.0, slo)
    colocated = L.predict(trace, cost, "colocated", 4096, None, slo)
    # 1000 tokens x 1 MiB: ~8.4 Gbit, ~8.4 s at 1 Gbit/s, ~0.34 s at 25 (arrivals far apart: no queueing)
    assert narrow["ttft_p50_s"] - wide["ttft_p50_s"] == pytest.approx(8.39e9 / 1e9 - 8.39e9 / 25e9, rel=0.05)
    assert colocated["ttft_p50_s"] < wide["ttft_p50_s"]
    assert wide["tpot_p50_s"] == pytest.approx(0.01, rel=0.05)


def test_shifted_traces_keep_arrivals_and_lengths_but_not_tokens():
    t = _trace(10, n=2)
    s = L.shifted(t, 2, vocab=8)
    assert [r.arrival_s for r in s.requests] == [r.arrival_s for r in t.requests]
    assert [r.prompt_tokens for r in s.requests] == [10, 10]
    assert s.requests[0].prompt_ids[:3] == (2, 3, 4) and max(s.requests[0].prompt_ids) < 8
    assert L.shifted(t, 0, 8) is t
    probes = L.probe_traces(vocab=4096, max_model_len=512)
    assert [p.requests[0].prompt_tokens for p in probes] == [128, 128, 480, 480]
    assert len({p.requests[0].prompt_ids[:4] for p in probes}) == 4  # no shared prefixes


def _res(goodput: float, e2e: float | None, done: int = 3) -> dict:
    return {"slo": {"goodput_rps": goodput}, "e2e_s": None if e2e is None else {"p50": e2e},
            "requests": {"completed": done}}


def test_pays_needs_the_best_goodput_and_a_lower_e2e():
    single = [_res(1.0, 2.0), _res(0.5, 1.0)]
    assert L.pays(_res(1.0, 1.5), single)
    assert not L.pays(_res(1.0, 2.5), single)  # same goodput, slower
    assert not L.pays(_res(0.9, 0.5), single)  # faster, but fewer requests within the SLO
    assert L.pays(_res(2.0, 9.0), single) is False  # more goodput, but slower e2e than the best's
    assert not L.pays(_res(1.0, None), single)
    assert not L.pays(_res(1.0, 1.5, done=2), single)  # faster only because it shed more


def test_where_disaggregation_stops_paying_is_stated():
    s = L.stops_paying("long", 3000, {1.0: False, 10.0: True, 25.0: True})
    assert "long (prompt p50 3000 tokens)" in s and "stops paying below 10 Gbit/s" in s and "not at 1" in s
    assert "pays on every link down to 1 Gbit/s" in L.stops_paying("short", 100, {1.0: True, 25.0: True})
    assert "does not pay on any link, even at 25 Gbit/s" in L.stops_paying("x", 1, {1.0: False, 25.0: False})
    assert "no monotone threshold" in L.stops_paying("x", 1, {1.0: True, 10.0: False, 25.0: True})


def _can_run() -> str | None:
    from kvstore.testing import hosts as H

    if shutil.which("redis-server") is None:
        return "redis-server is not on PATH"
    try:
        import vllm  # noqa: F401
    except ImportError:
        return "vLLM is not installed"
    return H.unavailable_reason()


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_a_tiny_compare_across_the_link(tmp_path):
    from kvstore.testing import hosts as H

    reason = _can_run()
    if reason is not None:
        pytest.skip(reason)
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "benchmarks.pd", "compare", "--engine", "vllm", "--link", "10",
                           "--workloads", "short", "--num-requests", "2", "--archs", "colocated,disaggregated",
                           "--max-model-len", "1024", "--out", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=3000)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    doc = json.loads((out / "summary.json").read_text())
    assert doc["links"]["disaggregated@10gbit"]["measured_gbit"] > 0
    res = doc["results"]["short"]["disaggregated@10gbit"]
    assert res["requests"]["completed"] == 2, res
    routes = {k for k in res["router"] if k.startswith("kvstore_router_routes_total")}
    assert routes, res["router"]
    check = doc["planner"]["short"]["checks"][-1]
    assert check["arch"] == "disaggregated@10gbit" and None not in check["error"].values()
    assert "Where disaggregation stops paying" in (out / "report.md").read_text()
    assert H.namespaces() == []


def test_verdicts_of_a_summary_per_trace():
    doc = {"links": {"disaggregated@1gbit": {"shaped_gbit": 1.0}, "disaggregated@25gbit": {"shaped_gbit": 25.0}},
           "prompt_p50": {"long": 800},
           "results": {"long": {"colocated": _res(1.0, 2.0), "chunked": _res(0.5, 1.0),
                                "disaggregated@1gbit": _res(0.5, 3.0), "disaggregated@25gbit": _res(1.0, 1.5)}}}
    assert L.verdicts(doc) == {"long": "long (prompt p50 800 tokens): disaggregation stops paying below 25 Gbit/s "
                                       "(pays at 25, not at 1)"}


def test_the_planner_is_given_the_requests_the_router_admitted():
    rows = [{"shed": False, "arrival_s": 0.0, "prompt_tokens": 100, "target_output_tokens": 8},
            {"shed": True, "arrival_s": 0.5, "prompt_tokens": 900, "target_output_tokens": 8},
            {"shed": False, "arrival_s": 1.0, "prompt_tokens": 200, "target_output_tokens": 4}]
    t = L.admitted_trace("x", rows)
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in t.requests] == [(0.0, 100, 8), (1.0, 200, 4)]
    with pytest.raises(ValueError, match="every request was shed"):
        L.admitted_trace("x", rows[1:2])


@pytest.mark.parametrize("argv", [["--engine", "tiny", "--link", "10"],
                                  ["--engine", "vllm", "--via", "inprocess", "--link", "10"]])
def test_link_is_refused_outside_the_router_path(tmp_path, argv, capsys):
    from benchmarks.pd.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["compare", *argv, "--workloads", "short", "--out", str(tmp_path / "o")])
    assert exc.value.code == 2 and "--link needs --engine vllm --via router" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
