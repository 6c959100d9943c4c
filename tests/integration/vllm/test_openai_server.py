"""A prefill -> decode hand-off through vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``,
the engine core in its own process), the way a router drives it: the prefill instance's completion response
carries ``kv_transfer_params``; sent unchanged with the decode request, the decode instance loads every
promised block instead of computing it. A promise that never arrives is waited for (bounded), logged, and the
request computed."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from conftest import Daemon, short_tmpdir  # noqa: E402
from vllm_runner import BLOCK, child_env, claimable_tokens, make_prompts  # noqa: E402

pytestmark = [pytest.mark.heavy(125), pytest.mark.timeout(2400)]
HANDOFF_WAIT_S = 3.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One ``api_server`` process with a KVStoreConnector of ``role``; its output goes to ``log``."""

    def __init__(self, model: str, role: str, url: str, log: str, extra: dict | None = None):
        self.model, self.port, self.log = model, free_port(), log
        config = {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.integrations.vllm",
                  "kv_role": role, "kv_connector_extra_config": {"url": url, "transport": "tcp", **(extra or {})}}
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
               "--port", str(self.port), "--skip-tokenizer-init", "--dtype", "bfloat16", "--block-size", str(BLOCK),
               "--max-model-len", "4096", "--kv-cache-memory-bytes", str(64 << 20), "--enforce-eager",
               "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(config)]
        env = child_env()
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the engine core in its own process, as deployed
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited:\n{self.output()[-6000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        raise AssertionError(f"server not ready after {timeout} s:\n{self.output()[-6000:]}")

    def complete(self, prompt: list[int], max_tokens: int, kv_transfer_params: dict | None = None) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True}
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())

    def output(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def servers():
    from kvstore.integrations.vllm.tiny_model import build_tiny_llama

    workdir = short_tmpdir()
    model = build_tiny_llama(os.path.join(workdir, "tiny-llama"))
    daemon = Daemon(workdir, capacity="256MiB").start()
    prefill = Server(model, "kv_producer", daemon.unix_url, os.path.join(workdir, "prefill.log"))
    decode = Server(model, "kv_consumer", daemon.unix_url, os.path.join(workdir, "decode.log"),
                    extra={"handoff_wait_s": HANDOFF_WAIT_S})
    try:
        prefill.wait_ready(1200)
        decode.wait_ready(1200)
        yield daemon, prefill, decode
    finally:
        prefill.stop()
        decode.stop()
        daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def cached_tokens(response: dict) -> int:
    return (response.get("usage", {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def test_prefill_to_decode_through_the_openai_server(servers):
    _, prefill, decode = servers
    prompt = make_prompts()[2]  # 400 tokens: 3 full blocks
    first = prefill.complete(prompt, max_tokens=1)
    params = first["kv_transfer_params"]
    entry = params["kvstore"]
    assert set(entry) == {"version", "fingerprint", "num_tokens", "saved_blocks", "dropped_blocks", "pending"}
    assert entry["version"] == 1 and len(entry["fingerprint"]) == 32 and isinstance(entry["pending"], bool)
    assert entry["num_tokens"] == 3 * BLOCK and entry["saved_blocks"] == 3 and entry["dropped_blocks"] == 0
    second = decode.complete(prompt, max_tokens=4, kv_transfer_params=params)  # as a router sends it
    assert cached_tokens(second) == claimable_tokens(prompt)  # every promised block came from the store
    assert second["choices"][0]["token_ids"][:1] == first["choices"][0]["token_ids"]
    assert "was promised" not in decode.output()


def test_a_promise_that_never_arrives_is_logged_and_computed(servers):
    _, prefill, decode = servers
    prompt = make_prompts()[3]  # never prefilled
    from kvstore.integrations.vllm.transfer_params import Promise

    fingerprint = prefill.complete(make_prompts()[2], max_tokens=1)["kv_transfer_params"]["kvstore"]["fingerprint"]
    params = Promise(fingerprint, num_tokens=3 * BLOCK, saved_blocks=3, dropped_blocks=0, pending=True).to_params()
    start = time.monotonic()
    response = decode.complete(prompt, max_tokens=2, kv_transfer_params=params)
    assert time.monotonic() - start < 300  # a bounded wait, not a hang
    assert cached_tokens(response) == 0 and len(response["choices"][0]["token_ids"]) == 2
    assert "was promised 3 blocks" in decode.output()


def metric(text: str, name: str) -> float:
    """The sum of ``name``'s samples over every label set in a Prometheus text exposition."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def test_connector_counters_reach_vllms_metrics(servers):
    _, prefill, decode = servers  # after the two tests above: a hand-off and a promised miss
    deadline = time.monotonic() + 120
    while True:  # vLLM publishes stats on its logging interval
        with urllib.request.urlopen(f"http://127.0.0.1:{decode.port}/metrics", timeout=30) as r:
            text = r.read().decode()
        if metric(text, "vllm:kvstore_promised_misses_total") >= 1 or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert metric(text, "vllm:kvstore_loaded_blocks_total") >= 3
    assert metric(text, "vllm:kvstore_hit_tokens_total") >= 3 * BLOCK  # a scheduler-side counter
    assert metric(text, "vllm:kvstore_promised_requests_total") >= 2
    assert metric(text, "vllm:kvstore_promised_misses_total") >= 1
    with urllib.request.urlopen(f"http://127.0.0.1:{prefill.port}/metrics", timeout=30) as r:
        assert metric(r.read().decode(), "vllm:kvstore_saved_blocks_total") >= 3
