"""Tests of the planner (``kvstore plan``): cost model, presets, traces, simulator, validation against
published findings, calibration, and the CLI. No GPU, no torch; the whole file runs in a few seconds."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest
from paths import TRACES
from planner_runs import TRUE_COST, TRUE_LINK, write_synthetic_runs

from kvstore.planner import presets
from kvstore.planner.calibrate import calibrate, compare_run, decode_samples, prefill_samples
from kvstore.planner.cli import main
from kvstore.planner.costmodel import CostModel, TransferModel, decode_span_s, from_specs, min_tp, steps_to_cover
from kvstore.planner.crossover import bandwidth_crossover, prompt_crossover
from kvstore.planner.deployment import Arch, Deployment
from kvstore.planner.metrics import summarize
from kvstore.planner.plan import PlanConfig, Planner
from kvstore.planner.simulator import Simulator
from kvstore.planner.verdict import decide
from kvstore.workloads.runlog import read_run
from kvstore.workloads.slo import SLO
from kvstore.workloads.trace import (
    Trace,
    TraceRequest,
    Workload,
    get_workload,
    load_trace,
    poisson,
    read_azure,
    read_mooncake,
)

pytestmark = pytest.mark.timeout(60)

MOONCAKE = TRACES / "mooncake_synthetic_trace.jsonl"
AZURE = TRACES / "azure_llm_code_2023.csv"

LLAMA8 = presets.get_model("llama-3-8b")
H100 = presets.get_gpu("h100")


def _cost(**overrides) -> CostModel:
    return replace(presets.cost_model_for(LLAMA8, H100), **overrides)


# -- cost model and presets ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name, expected", [
    ("llama-3-8b", 32 * 2 * 8 * 128 * 2),
    ("llama-3-70b", 80 * 2 * 8 * 128 * 2),
    ("qwen2.5-7b", 28 * 2 * 4 * 128 * 2),
    ("deepseek-v3", 61 * (512 + 64) * 2),  # MLA: one latent + one RoPE key per layer
])
def test_kv_bytes_per_token_from_geometry(name, expected):
    assert presets.get_model(name).kv_bytes_per_token == expected


@pytest.mark.parametrize("name", ["llama-3-8b", "llama-3-70b", "qwen2.5-7b", "pd-tiny"])
def test_dense_param_counts_match_their_geometry(name):
    m = presets.get_model(name)
    q = m.hidden * m.heads * m.head_dim
    kv = 2 * m.hidden * m.kv_heads * m.head_dim
    per_layer = 2 * q + kv + 3 * m.hidden * m.ffn_dim
    total = m.layers * per_layer + 2 * m.vocab * m.hidden  # untied embeddings and LM head
    assert total == pytest.approx(m.params, rel=0.01)


def test_deepseek_active_params_match_its_routing():
    m = presets.get_model("deepseek-v3")
    dense = m.params - m.expert_params
    assert dense + m.expert_params * m.experts_per_token / m.experts == pytest.approx(m.active_params, rel=0.03)


def test_cost_model_shapes():
    cost = from_specs(LLAMA8, H100)
    # prefill is superlinear in the prompt (attention), decode grows with batch and context
    assert cost.prefill_s(8192) > 4 * cost.prefill_s(2048) > 0
    assert cost.decode_s(64, 64 * 1024) > cost.decode_s(1, 1024) > 0
    # a small decode step on H100 is weight-bandwidth bound: ~16 GB / 3.35 TB/s
    assert 4e-3 < cost.decode_s(1, 1024) < 10e-3
    assert TransferModel("x", 1e-3, 1e9).time_s(2e9) == pytest.approx(2.001)


def test_moe_decode_reads_more_experts_with_bigger_batches():
    ds = presets.get_model("deepseek-v3")
    cost = from_specs(ds, presets.get_gpu("h200"), tp=8)
    assert cost.decode_s(1, 0) < cost.decode_s(32, 0) < cost.decode_s(256, 0)


def test_min_tp_and_weights_that_do_not_fit():
    assert min_tp(LLAMA8, H100, 32768) == 1
    assert min_tp(presets.get_model("llama-3-70b"), H100, 32768) == 4
    with pytest.raises(ValueError, match="do not fit"):
        from_specs(presets.get_model("llama-3-70b"), H100, tp=1)


@pytest.mark.parametrize("a, c, ctx0, batch", [(5e-3, 1e-8, 1000, 4), (1e-3, 0.0, 0, 1), (2e-3, 3e-7, 50, 32)])
def test_decode_span_arithmetic_matches_step_by_step(a, c, ctx0, batch):
    steps = [a + c * (ctx0 + i * batch) for i in range(50)]
    for k in (1, 7, 50):
        assert decode_span_s(a, c, ctx0, batch, k) == pytest.approx(sum(steps[:k]))
    for dt in (0.0, 1e-4, steps[0], sum(steps[:13]) + 1e-12, sum(steps[:30]) - 1e-9):
        k = steps_to_cover(a, c, ctx0, batch, dt)
        assert decode_span_s(a, c, ctx0, batch, k) >= dt
        assert k == 1 or decode_span_s(a, c, ctx0, batch, k - 1) < dt


def test_unknown_presets_name_the_bad_value():
    for getter in (presets.get_model, presets.get_gpu, presets.get_link):
        with pytest.raises(ValueError, match="'nope'"):
            getter("nope")
    with pytest.raises(TypeError):
        presets.get_model(3)


def test_every_preset_carries_a_source():
    for table in (presets.MODELS, presets.GPUS, presets.LINKS):
        for spec in table.values():
            assert spec.source, spec.name


# -- traces -------------------------------------------------------------------------------------------------
def test_poisson_is_seeded_and_scaling_is_recorded():
    w = get_workload("mixed")
    a, b = poisson(w, 2.0, 200, seed=7), poisson(w, 2.0, 200, seed=7)
    assert a == b
    assert a.duration_s == pytest.approx(200 / 2.0, rel=0.25)
    s = a.scaled(time=0.5, prompt=2.0)
    assert s.duration_s == pytest.approx(a.duration_s * 0.5)
    assert s.requests[3].prompt_tokens == round(a.requests[3].prompt_tokens * 2)
    assert (s.time_scale, s.prompt_scale) == (0.5, 2.0)
    h = a.head(10)
    assert len(h) == 10 and h.source_requests == 200 and "first 10 of 200" in h.describe()
    with pytest.raises(ValueError, match="workload 'huge'"):
        get_workload("huge")


@pytest.mark.skipif(not MOONCAKE.is_file(), reason=f"{MOONCAKE} not present")
def test_mooncake_sample_parses():
    t = read_mooncake(MOONCAKE)
    assert len(t) == 3993
    assert t.mean_prompt == pytest.approx(15325, rel=0.01)
    assert t.mean_output == pytest.approx(149, rel=0.01)
    assert t.duration_s == pytest.approx(1022, rel=0.01)
    assert all(len(r.prefix_ids) * 512 >= r.prompt_tokens for r in t.requests[:100])


@pytest.mark.skipif(not AZURE.is_file(), reason=f"{AZURE} not present")
def test_azure_sample_parses():
    t = load_trace(AZURE)
    assert len(t) == 8819
    assert t.mean_prompt == pytest.approx(2048, rel=0.01)
    assert t.mean_output == pytest.approx(28, rel=0.01)
    assert 3000 < t.duration_s < 3600


def test_bad_trace_files_raise_with_the_location(tmp_path):
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 2}\n{"timestamp": 1}\n')
    with pytest.raises(ValueError, match=":2:"):
        read_mooncake(bad)
    csv = tmp_path / "t.csv"
    csv.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="missing columns"):
        read_azure(csv)
    other = tmp_path / "t.txt"
    other.write_text("x")
    with pytest.raises(ValueError, match="unknown format"):
        load_trace(other)


# -- simulator ----------------------------------------------------------------------------------------------
def _one(prompt=1000, output=20, prefix=()) -> Trace:
    return Trace("one", (TraceRequest(0, 0.0, prompt, output, prefix),))


def test_single_request_latencies_are_exact():
    cost = _cost()
    res = Simulator(cost, Deployment(Arch.COLOCATED, 1), record_tokens=True).run(_one())
    r = res.requests[0]
    assert r.ttft_s == pytest.approx(cost.prefill_s(1000))
    decode = sum(cost.decode_s(1, 1000 + i) for i in range(1, 20))
    assert r.tpot_s == pytest.approx(decode / 19, rel=1e-3)
    assert len(r.token_times_s) == 20
    link = TransferModel("x", 1e-3, 1e9)
    d = Simulator(cost, Deployment(Arch.DISAGGREGATED, 2, prefill_workers=1), link).run(_one()).requests[0]
    assert d.transfer_s == pytest.approx(link.time_s(1000 * cost.kv_bytes_per_token))
    assert d.ttft_s == pytest.approx(cost.prefill_s(1000) + d.transfer_s)


@pytest.mark.parametrize("arch", list(Arch))
def test_every_request_finishes_once_and_memory_is_bounded(arch):
    cost = _cost(kv_capacity_tokens=60_000)
    trace = poisson(get_workload("mixed"), 20.0, 300, seed=3)
    dep = Deployment(arch, 2, prefill_workers=1 if arch is Arch.DISAGGREGATED else 0)
    res = Simulator(cost, dep, TransferModel("x", 1e-4, 50e9), record_tokens=True).run(trace)
    for r in res.requests:
        assert not r.rejected
        assert len(r.token_times_s) == r.output_tokens
        assert r.prefill_queue_s >= 0 and r.decode_queue_s >= 0
        assert r.ttft_s >= r.prefill_end_s - r.prefill_start_s - 1e-12
    assert 0 < res.peak_kv_tokens <= 2 * cost.kv_capacity_tokens


def test_requests_larger_than_a_worker_are_rejected_not_truncated():
    res = Simulator(_cost(kv_capacity_tokens=500), Deployment(Arch.COLOCATED, 1)).run(_one(prompt=1000))
    assert res.requests[0].rejected
    m = summarize(res, SLO())
    assert m.rejected == 1 and m.slo_attainment == 0


def test_prefix_cache_skips_shared_prefixes():
    shared = tuple(range(8))
    reqs = tuple(TraceRequest(i, i * 1.0, 4096, 4, shared) for i in range(6))
    trace = Trace("shared", reqs, block_tokens=512)
    cost = _cost()
    plain = Simulator(cost, Deployment(Arch.COLOCATED, 1)).run(trace)
    cached = Simulator(cost, Deployment(Arch.COLOCATED, 1, prefix_cache_tokens=100_000)).run(trace)
    assert [r.cached_tokens for r in cached.requests] == [0] + [4095] * 5
    assert cached.requests[-1].ttft_s < plain.requests[-1].ttft_s / 10


def test_deployment_validation_names_the_value():
    with pytest.raises(ValueError, match="prefill_workers"):
        Deployment(Arch.DISAGGREGATED, 2, prefill_workers=2)
    with pytest.raises(ValueError, match="multiple of tp"):
        Deployment(Arch.COLOCATED, 3, tp=2)
    with pytest.raises(ValueError, match="'ring'"):
        Arch.parse("ring")
    with pytest.raises(ValueError, match="tpot_s"):
        SLO(tpot_s=-1)


# -- validation: the direction of published findings ---------------------------------------------------------
# Long prompts (4k) and 256-token outputs at 5 req/s on 2 x H100 with Llama-3-8B: prefills interfere.
INTERFERENCE_TRACE = poisson(Workload("long-prompts", prompt_mean=4096, output_mean=256), 5.0, 300, seed=1)
TIGHT_SLO = SLO(ttft_s=1.5, tpot_s=0.012)


def _evaluate(link: str):
    config = PlanConfig(LLAMA8, H100, presets.get_link(link), gpus=2, slo=TIGHT_SLO, prefill_workers=1)
    planner = Planner(config, INTERFERENCE_TRACE)
    return planner, planner.evaluate().metrics


def test_disaggregation_cuts_the_tpot_tail_under_long_prompt_interference():
    """DistServe (OSDI'24): separating prefill from decode removes prefill-decode interference."""
    _, m = _evaluate("nvlink-4")
    colocated, disagg = m[Arch.COLOCATED], m[Arch.DISAGGREGATED]
    assert disagg.tpot_p99 < 0.7 * colocated.tpot_p99
    assert disagg.itl_p99 < 0.25 * colocated.itl_p99
    assert colocated.interference_share_of_tpot > 0.2 and disagg.interference_share_of_tpot == 0


def test_chunked_prefill_recovers_most_of_it_on_one_node():
    """Sarathi-Serve (OSDI'24): bounded chunks piggybacking decodes avoid generation stalls."""
    _, m = _evaluate("nvlink-4")
    c, ch, d = m[Arch.COLOCATED], m[Arch.CHUNKED], m[Arch.DISAGGREGATED]
    assert (c.tpot_p99 - ch.tpot_p99) >= 0.5 * (c.tpot_p99 - d.tpot_p99)
    assert (c.itl_p99 - ch.itl_p99) >= 0.8 * (c.itl_p99 - d.itl_p99)
    assert ch.kv_bytes_transferred == 0 < d.kv_bytes_transferred


def test_disaggregation_loses_on_a_slow_link_with_long_contexts():
    planner, m = _evaluate("10gbe")
    disagg, chunked = m[Arch.DISAGGREGATED], m[Arch.CHUNKED]
    assert disagg.goodput_rps < 0.5 * chunked.goodput_rps
    assert disagg.transfer_share_of_ttft > 0.5
    ev = planner.evaluate()
    assert ev.best() is Arch.CHUNKED
    verdict = decide(planner, ev)
    assert verdict.fewest_gpus[Arch.DISAGGREGATED] is None
    # the shared verdict core says why it misses, in the measured comparison's words
    assert verdict.misses[Arch.DISAGGREGATED].startswith("TTFT p90 ")
    assert verdict.to_dict()["misses"]["disaggregated"] == verdict.misses[Arch.DISAGGREGATED]
    # the shared aggregate's hand-off bytes and duration are the simulator's own counters
    res = ev.results[Arch.DISAGGREGATED]
    assert disagg.kv_bytes_transferred == res.kv_bytes_transferred > 0
    assert disagg.duration_s == res.makespan_s


def test_bandwidth_crossover_lies_between_10gbe_and_rdma_400g():
    planner, _ = _evaluate("nvlink-4")
    x = bandwidth_crossover(planner, prefill_workers=1)
    assert x.pays_above and 10e9 / 8 < x.threshold < 400e9 / 8
    assert all(p.pays == (p.x >= x.threshold) for p in x.points)
    prompts = prompt_crossover(planner, 1, scales=(0.25, 1.0))
    assert [p.x for p in prompts.points] == [0.25, 1.0] and prompts.summary


@pytest.mark.parametrize("model", ["llama-3-8b", "llama-3-70b", "qwen2.5-7b", "deepseek-v3"])
@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_every_model_and_gpu_preset_plans(model, gpu):
    m, g = presets.get_model(model), presets.get_gpu(gpu)
    trace = poisson(get_workload("mixed"), 2.0, 40, seed=0)
    tp = min_tp(m, g, 32768)
    planner = Planner(PlanConfig(m, g, presets.get_link("rdma-400g"), gpus=2 * tp), trace)
    ev = planner.evaluate()
    assert set(ev.metrics) == set(Arch)
    assert all(x.completed == 40 for x in ev.metrics.values())
    assert decide(planner, ev).headline


@pytest.mark.parametrize("link", sorted(presets.LINKS))
def test_every_link_preset_plans(link):
    trace = poisson(get_workload("short"), 2.0, 30, seed=0)
    planner = Planner(PlanConfig(LLAMA8, H100, presets.get_link(link), gpus=2), trace)
    assert planner.evaluate().metrics[Arch.DISAGGREGATED].kv_bytes_transferred > 0


def test_small_engine_preset_plans():
    trace = poisson(get_workload("short"), 1.0, 30, seed=0)
    config = PlanConfig(presets.get_model("pd-tiny"), presets.get_gpu("cpu-2core"), presets.get_link("shm"), 2)
    assert Planner(config, trace).evaluate().metrics[Arch.CHUNKED].completed == 30


# -- calibration ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def synthetic_runs(tmp_path_factory):
    """Runs in the engine's format, made by the simulator under known coefficients."""
    return write_synthetic_runs(tmp_path_factory.mktemp("runs"))


def test_calibration_recovers_known_parameters(synthetic_runs):
    runs = [read_run(d) for d in synthetic_runs]
    assert prefill_samples(runs[1]) == []  # chunked prompts span steps: no clean prefill samples
    assert all(len(decode_samples(r)) > 100 for r in runs)
    fit = calibrate(runs, presets.CALIBRATED[("pd-tiny", "cpu-2core")])
    c = fit.cost
    assert c.overlap == 0 and c.weight_s == 0  # no overlap: weight reads and fixed cost are one term
    assert c.base_s + c.weight_s == pytest.approx(TRUE_COST.base_s + TRUE_COST.weight_s, rel=0.02)
    for name in ("token_s", "seq_s", "pair_s", "ctx_s"):
        assert getattr(c, name) == pytest.approx(getattr(TRUE_COST, name), rel=0.02), name
    assert fit.prefill_error < 0.01 and fit.decode_error < 0.01
    assert fit.transfer.latency_s == pytest.approx(TRUE_LINK.latency_s, rel=0.05)
    assert fit.transfer.bytes_per_s == pytest.approx(TRUE_LINK.bytes_per_s, rel=0.05)


def test_calibrated_model_replays_runs_within_25_percent(synthetic_runs):
    runs = [read_run(d) for d in synthetic_runs]
    fit = calibrate(runs, presets.CALIBRATED[("pd-tiny", "cpu-2core")])
    for run in runs:
        cmp = compare_run(run, fit.cost, fit.transfer)
        assert abs(cmp.ttft_error) < 0.25 and abs(cmp.tpot_error) < 0.25, cmp


def test_relative_run_times_are_normalised(tmp_path):
    rec = {"id": "a", "arrival_s": 10.0, "prompt_tokens": 8, "output_tokens": 3, "prefill_queue_s": 0.5,
           "prefill_start_s": 0.5, "prefill_end_s": 0.7, "ttft_s": 0.7, "token_times_s": [0.7, 0.8, 0.9]}
    (tmp_path / "requests.jsonl").write_text(json.dumps(rec) + "\n")
    r = read_run(tmp_path).requests[0]
    assert (r.prefill_start_s, r.prefill_end_s) == pytest.approx((10.5, 10.7))
    assert r.token_times_s == pytest.approx((10.7, 10.8, 10.9))


# -- CLI ----------------------------------------------------------------------------------------------------
def test_cli_lists_presets(capsys):
    assert main(["--list-presets"]) == 0
    out = capsys.readouterr().out
    for name in list(presets.MODELS) + list(presets.GPUS) + list(presets.LINKS):
        assert name in out


def test_cli_plan_prints_table_verdict_and_crossover(tmp_path, capsys):
    path = tmp_path / "plan.json"
    argv = ["--model", "llama-3-8b", "--gpus", "2", "--link", "10gbe", "--workload", "long", "--rate", "3",
            "--num-requests", "60", "--slo-ttft", "2", "--slo-tpot", "0.05", "--json", str(path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "TTFT p50 / p90 / p99" in out and "verdict:" in out and "crossover (link bandwidth)" in out
    doc = json.loads(path.read_text())
    assert set(doc["metrics"]) == {"colocated", "chunked", "disaggregated"}
    assert len(doc["requests"]["chunked"]) == 60 and doc["verdict"]["headline"]


def test_cli_calibrate_save_then_plan_with_it(synthetic_runs, tmp_path, capsys):
    saved = tmp_path / "cost.json"
    assert main(["--calibrate", *map(str, synthetic_runs), "--save", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "fit error" in out and "replay" in out and "own" in out
    assert main(["--cost-model", str(saved), "--gpus", "2", "--workload", "short", "--rate", "1",
                 "--num-requests", "20", "--no-crossover"]) == 0
    assert "calibrated" in capsys.readouterr().out


@pytest.mark.parametrize("argv, needle", [
    (["--model", "gpt-9", "--workload", "short"], "'gpt-9'"),
    (["--link", "carrier-pigeon", "--workload", "short"], "'carrier-pigeon'"),
    (["--workload", "short", "--gpus", "0"], "gpus"),
    (["--trace", "/no/such/file.jsonl"], "/no/such/file.jsonl"),
    ([], "--trace"),
])
def test_cli_bad_input_is_a_typed_error_naming_the_value(argv, needle, capsys):
    assert main(argv + ["--num-requests", "5", "--no-crossover"]) == 2
    assert needle in capsys.readouterr().err


def test_planner_imports_neither_torch_nor_benchmarks():
    code = ("import sys, kvstore.planner.cli; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'benchmarks'))]; "
            "print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_module_entry_point_runs():
    done = subprocess.run([sys.executable, "-m", "kvstore.planner", "--list-presets"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and "deepseek-v3" in done.stdout
