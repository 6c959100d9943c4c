"""``compare --engine vllm`` through the product: real vLLM OpenAI servers (vLLM-CPU, a tiny random Llama)
behind ``kvstore router`` as its own process, a handful of requests sent over HTTP (streaming) and timed at
the client; the colocated, chunked and disaggregated fleets; a context smaller than some requests (fitted, not
refused); ``--admission budget``; a decode crash injected. Run as ``python -m benchmarks.pd`` (no import of
benchmarks/ here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import child_env

ARCHS = ("colocated", "chunked", "disaggregated")
MAX_LEN = 192  # the short workload's prompts are 32-192 tokens with 16-48 output: some do not fit
pytestmark = pytest.mark.timeout(3000)


def _compare(model: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.pd", "compare", "--engine", "vllm", "--via", "router",
                           "--model", str(model), "--workloads", "short", "--num-requests", "4", "--block-size", "64",
                           "--max-model-len", str(MAX_LEN), "--kv-cache-size", "32MiB", "--chunk-budget", "64",
                           "--transport", "tcp", "--vllm-dtype", "float32", "--slo-ttft", "30", "--slo-tpot", "5",
                           "--out", str(out), *extra], env=child_env(), capture_output=True, text=True, timeout=2700)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    pytest.importorskip("vllm")
    pytest.importorskip("aiohttp")
    path = tmp_path_factory.mktemp("pdhttp") / "model"
    made = subprocess.run([sys.executable, "-m", "benchmarks.pd", "make-model", "--layers", "2", "--hidden", "256",
                           "--heads", "4", "--kv-heads", "2", "--intermediate", "512", "--vocab", "1024",
                           "--max-position", "4096", "--dtype", "float32", "--out", str(path)],
                          env=child_env(), capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-4000:]
    return path


@pytest.fixture(scope="module")
def run(model: Path) -> Path:
    out = model.parent / "out"
    proc = _compare(model, out, "--admission", "budget")
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return out


def _rows(out: Path, arch: str) -> list[dict]:
    return [json.loads(line) for line in (out / "short" / arch / "requests.jsonl").read_text().splitlines()]


def test_every_architecture_serves_the_trace_through_the_router(run: Path) -> None:
    doc = json.loads((run / "summary.json").read_text())
    assert doc["setup"]["via"].startswith("kvstore router") and doc["setup"]["admission"] == "budget"
    for arch in ARCHS:
        res = doc["results"]["short"][arch]
        assert res["requests"]["total"] == 4 and res["requests"]["completed"] == 4 and res["requests"]["lost"] == 0
        assert res["ttft_s"]["p50"] > 0 and res["tpot_s"]["p50"] > 0
        for row in _rows(run, arch):
            assert row["output_tokens"] == row["target_output_tokens"] and len(row["output_token_ids"]) == \
                row["target_output_tokens"]
            # times are the run's (seconds since its start, as arrival_s): every answer ended within the run
            assert 0 < row["ttft_s"] <= row["e2e_s"] <= res["throughput"]["run_wall_s"] - row["arrival_s"]
        routes = {k: v for k, v in res["router"].items() if k.startswith("kvstore_router_routes_total")}
        if arch == "disaggregated":  # verified hand-offs (or prompts below the threshold) through the router
            assert routes.get('kvstore_router_routes_total{route="handoff"}', 0) + \
                routes.get('kvstore_router_routes_total{route="skip_short"}', 0) == 4
        else:
            assert routes == {'kvstore_router_routes_total{route="colocated"}': 4}
    assert doc["outputs"]["short"]["identical"] is True
    assert "kvstore router" in (run / "report.md").read_text()


def test_requests_longer_than_the_context_are_fitted_and_reported(run: Path) -> None:
    doc = json.loads((run / "summary.json").read_text())
    fitted = doc["setup"]["traces"]["short"]["fitted"]
    assert fitted["max_model_len"] == MAX_LEN and fitted["rule"]
    rows = _rows(run, "colocated")
    assert fitted["requests_fitted"] == sum(r["capped"] for r in rows)
    assert all(r["prompt_tokens"] + r["target_output_tokens"] <= MAX_LEN for r in rows)


def test_a_decode_crash_is_survived_through_the_router(model: Path) -> None:
    """decode-crash@0: the decode instance is SIGKILLed as the trace starts and started again; the router
    ejects it, the clients' retries land on the replacement, and no request is lost."""
    out = model.parent / "fault"
    proc = _compare(model, out, "--archs", "disaggregated", "--inject-fault", "decode-crash@0",
                    "--admission", "none")
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    res = json.loads((out / "summary.json").read_text())["results"]["short"]["disaggregated"]
    assert res["fault"]["injected"] == "decode-crash@0" and res["fault"]["replacement_ready_s"] > 0
    assert res["requests"]["lost"] == 0 and res["requests"]["completed"] == 4


def test_a_bad_fleet_option_is_a_usage_error_before_anything_starts(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.pd", "compare", "--engine", "vllm", "--model",
                           str(tmp_path / "nothing"), "--out", str(tmp_path / "out")], env=child_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no config.json" in proc.stderr
