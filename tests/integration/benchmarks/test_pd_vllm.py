"""``compare --engine vllm``: the three architectures on a real vLLM (CPU) and a tiny random Llama, a handful of
requests; the same greedy tokens everywhere, every metric in summary.json, the report written. Skipped when
vLLM is not importable. Also the configuration errors of the vLLM path (no vLLM needed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import child_env

from benchmarks.pd.make_model import LlamaShape, read_shape
from benchmarks.pd.vllm_deployment import VllmConfig
from benchmarks.pd.vllm_engine import InstanceSpec

pytestmark = pytest.mark.heavy(255)

ARCHS = ("colocated", "chunked", "disaggregated")
CARD_KEYS = ("requests", "throughput", "ttft_s", "tpot_s", "prefill_queue_s", "decode_queue_s", "transfer",
             "memory", "energy", "slo", "by_class", "interference", "compute", "connector")
TINY = LlamaShape(layers=2, hidden=256, heads=4, kv_heads=2, intermediate=512, vocab=1024, max_position=4096)


# -- configuration errors (no vLLM needed) -------------------------------------------------------------------
def test_model_shape_refuses_heads_that_do_not_divide() -> None:
    with pytest.raises(ValueError, match="kv_heads"):
        LlamaShape(hidden=512, heads=8, kv_heads=3)
    with pytest.raises(ValueError, match="layers"):
        LlamaShape(layers=0)


def test_vllm_config_names_the_missing_model_and_the_command(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="make-model"):
        VllmConfig(model=str(tmp_path))
    with pytest.raises(ValueError, match="not a model directory"):
        read_shape(tmp_path)


def test_instance_spec_refuses_unknown_roles_and_a_connector_without_url() -> None:
    common = {"index": 0, "model": "m", "core": 0, "t0": 0.0, "max_model_len": 64, "max_batched_tokens": 64}
    with pytest.raises(ValueError, match="role"):
        InstanceSpec(role="both", **common)
    with pytest.raises(ValueError, match="url"):
        InstanceSpec(role="kv_consumer", **common)
    spec = InstanceSpec(role="kv_producer", url="unix:///x.sock", **common)
    assert InstanceSpec.from_json(spec.to_json()) == spec


# -- the whole comparison on vLLM ------------------------------------------------------------------------------
def _rows(run: Path, arch: str) -> dict[str, dict]:
    lines = (run / "short" / arch / "requests.jsonl").read_text().splitlines()
    return {r["id"]: r for r in map(json.loads, lines)}


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory) -> Path:
    pytest.importorskip("vllm")
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("pdvllm")
    model = root / "model"
    made = subprocess.run([sys.executable, "-m", "benchmarks.pd", "make-model", "--layers", str(TINY.layers),
                           "--hidden", str(TINY.hidden), "--heads", str(TINY.heads), "--kv-heads",
                           str(TINY.kv_heads), "--intermediate", str(TINY.intermediate), "--vocab", str(TINY.vocab),
                           "--max-position", str(TINY.max_position), "--dtype", "float32", "--out", str(model)],
                          env=child_env(), capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-4000:]
    return _compare(model, root / "out")


def _compare(model: Path, out: Path, *extra: str) -> Path:
    # prompts of 1-3 blocks of 64 tokens: every hand-off has full blocks to move, and the decode instance
    # computes the last partial block itself. float32: in bf16, decode batches of other sizes (one instance
    # decoding everything vs two sharing it) can flip a near-tie argmax late in a random model's output
    proc = subprocess.run([sys.executable, "-m", "benchmarks.pd", "compare", "--engine", "vllm", "--via", "inprocess",
                           "--model",
                           str(model), "--workloads", "short", "--num-requests", "4", "--block-size", "64",
                           "--max-model-len", "1024", "--kv-cache-size", "32MiB", "--store-capacity", "256MiB",
                           "--chunk-budget", "64",
                           "--transport", "tcp", "--vllm-dtype", "float32", "--out", str(out), *extra],
                          env=child_env(), capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return out


@pytest.mark.timeout(900)
def test_every_architecture_gives_the_same_greedy_tokens_for_the_same_arrivals(vllm_run: Path) -> None:
    rows = {a: [json.loads(line) for line in (vllm_run / "short" / a / "requests.jsonl").read_text().splitlines()]
            for a in ARCHS}
    ref = {r["id"]: r for r in rows["colocated"]}
    assert len(ref) == 4
    for arch in ARCHS:
        assert {r["id"] for r in rows[arch]} == set(ref)
        for r in rows[arch]:
            assert (r["arrival_s"], r["prompt_tokens"]) == (ref[r["id"]]["arrival_s"], ref[r["id"]]["prompt_tokens"])
            assert r["output_token_ids"] == ref[r["id"]]["output_token_ids"]
            assert len(r["output_token_ids"]) == r["target_output_tokens"] and r["ttft_s"] > 0
    doc = json.loads((vllm_run / "summary.json").read_text())
    assert doc["outputs"]["short"]["identical"] is True


@pytest.mark.timeout(900)
def test_summary_holds_every_metric_and_the_report_is_written(vllm_run: Path) -> None:
    doc = json.loads((vllm_run / "summary.json").read_text())
    assert doc["setup"]["engine_kind"] == "vllm" and doc["machine"]["cpu"]
    for arch in ARCHS:
        card = doc["results"]["short"][arch]
        for key in CARD_KEYS:
            assert card[key] is not None, f"{arch}: {key} missing"
        assert card["requests"]["completed"] == 4 and card["requests"]["lost"] == 0
        assert card["ttft_s"]["p50"] > 0 and card["tpot_s"]["p50"] > 0
        assert card["memory"]["model_memory_duplication"] == 2.0
        assert all(rss > 0 for rss in card["memory"]["rss_bytes_per_worker"])
        assert "goodput_rps" in card["slo"] and card["energy"]
    assert doc["verdicts"]["short"]["text"]
    for name in ("report.md", "report.html", "cdf_short.png"):
        assert (vllm_run / name).stat().st_size > 0


@pytest.mark.timeout(900)
def test_only_the_disaggregated_run_moves_kv_and_the_connector_counts_it(vllm_run: Path) -> None:
    doc = json.loads((vllm_run / "summary.json").read_text())
    short = doc["results"]["short"]
    for arch in ("colocated", "chunked"):
        assert short[arch]["transfer"]["kv_bytes_transferred"] == 0
    dis = short["disaggregated"]
    prefill, decode = dis["connector"]["0"], dis["connector"]["1"]
    assert prefill["saved_blocks"] > 0 and decode["loaded_blocks"] > 0 and decode["load_errors"] == 0
    # per-request bytes are the connector's own per-request records: they add up to its counters exactly
    assert decode["load_bytes"] > 0
    assert dis["transfer"]["kv_bytes_transferred"] == decode["load_bytes"]
    rows = _rows(vllm_run, "disaggregated").values()
    assert sum(r["kv_bytes_saved"] for r in rows) == prefill["save_bytes"]
    assert dis["transfer"]["handoffs"] >= 1 and dis["decode_queue_s"] is not None


@pytest.mark.timeout(900)
def test_a_killed_decode_instance_is_replaced_and_its_requests_refetched(vllm_run: Path) -> None:
    """decode-crash@0.05: the consumer is SIGKILLed while the trace runs; a replacement starts, the requests it
    held are loaded again from the store (not prefilled again), and every token is what colocated gave."""
    out = _compare(vllm_run.parent / "model", vllm_run.parent / "fault", "--archs", "disaggregated",
                   "--inject-fault", "decode-crash@0.05")
    fault = json.loads((out / "summary.json").read_text())["results"]["short"]["disaggregated"]["fault"]
    assert fault["injected"] and fault["victim_worker"] == 1 and fault["requests_lost"] == 0
    assert fault["replacement_ready_s"] > 0 and fault["requests_recomputed"] == 0
    assert fault["requests_refetched"] == fault["requests_interrupted"]
    rows, ref = _rows(out, "disaggregated"), _rows(vllm_run, "colocated")
    assert {k: r["output_token_ids"] for k, r in rows.items()} == {k: r["output_token_ids"] for k, r in ref.items()}
    assert all(len(r["output_token_ids"]) == r["target_output_tokens"] for r in rows.values())
