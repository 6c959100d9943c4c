"""The small serving engine of benchmarks/pd: model and paged attention, scheduler policies, traces, and
greedy outputs that do not depend on the deployment (collocated, chunked, disaggregated)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from paths import TRACES

from benchmarks.pd.attention import AttentionBatch, SeqChunk, paged_attention
from benchmarks.pd.block_allocator import BlockAllocator, OutOfBlocksError
from benchmarks.pd.deployment import Arch, DeploymentConfig, run
from benchmarks.pd.engine import Engine
from benchmarks.pd.kv_cache import CacheSpec, PagedKVCache
from benchmarks.pd.model import MODEL_PRESETS, LlamaModel, ModelConfig
from benchmarks.pd.pool import InlinePool
from benchmarks.pd.request import Phase, Request
from benchmarks.pd.router import Router
from benchmarks.pd.scheduler import Policy, Scheduler, SchedulerConfig
from benchmarks.pd.trace import BuiltinWorkload, TraceFormat, TraceScaling, generate, load_token_trace
from kvstore.workloads import runschema

TINY = MODEL_PRESETS["tiny"]


def _has_handoff() -> bool:
    try:
        return importlib.util.find_spec("kvstore.handoff") is not None
    except ImportError:
        return False


needs_handoff = pytest.mark.skipif(not _has_handoff(), reason="kvstore.handoff is not available yet")


@pytest.fixture(scope="module")
def tiny_model() -> LlamaModel:
    torch.set_num_threads(1)
    return LlamaModel(TINY)


def _cache(model_cfg: ModelConfig = TINY, num_blocks: int = 64, block_size: int = 4) -> PagedKVCache:
    return PagedKVCache(CacheSpec(model_cfg.num_layers, num_blocks, block_size, model_cfg.num_kv_heads,
                                  model_cfg.head_dim, model_cfg.torch_dtype))


def _prompt(n: int, seed: int = 0, vocab: int = TINY.vocab_size) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy_reference(model: LlamaModel, prompt: list[int], n_out: int) -> list[int]:
    """Whole-prompt prefill then one token at a time, alone, in a fresh cache with contiguous blocks."""
    cache = _cache(model.cfg, num_blocks=256, block_size=16)
    table = list(range(cache.spec.blocks_for(len(prompt) + n_out)))
    logits = model(torch.tensor(prompt), AttentionBatch.build([SeqChunk(table, 0, len(prompt))], cache), cache)
    out = [int(logits.argmax())]
    while len(out) < n_out:
        pos = len(prompt) + len(out) - 1
        logits = model(torch.tensor(out[-1:]), AttentionBatch.build([SeqChunk(table, pos, 1)], cache), cache)
        out.append(int(logits.argmax()))
    return out


# -- model and paged attention ---------------------------------------------------------------------------
def _dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Textbook causal GQA in float64: q [n, H, d] are the last n of L positions; k, v [L, Hkv, d]."""
    n, heads, d = q.shape
    length, group = k.shape[0], heads // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) / math.sqrt(d)
    q_pos = torch.arange(length - n, length)[:, None]
    scores = scores.masked_fill(torch.arange(length)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


@pytest.mark.parametrize("start,num_new", [(0, 37), (24, 13), (36, 1)])
def test_paged_attention_over_shuffled_blocks_matches_dense(start: int, num_new: int) -> None:
    gen = torch.Generator().manual_seed(start + num_new)
    heads, kv_heads, d, length = 4, 2, 16, start + num_new
    cache = PagedKVCache(CacheSpec(1, 32, 4, kv_heads, d))
    table = torch.randperm(32, generator=gen)[: cache.spec.blocks_for(length)].tolist()
    k, v = torch.randn(length, kv_heads, d, generator=gen), torch.randn(length, kv_heads, d, generator=gen)
    cache.write(0, cache.slots(table, 0, length), k, v)
    q = torch.randn(num_new, heads, d, generator=gen)
    batch = AttentionBatch.build([SeqChunk(table, start, num_new)], cache)
    out = paged_attention(q, cache, 0, batch, 1.0 / math.sqrt(d))
    torch.testing.assert_close(out.double(), _dense_attention(q, k, v), atol=1e-5, rtol=1e-5)


def test_chunked_prefill_matches_whole_prefill(tiny_model: LlamaModel) -> None:
    prompt = _prompt(45, seed=1)
    whole, chunked = _cache(), _cache()
    table_a = list(range(12))
    table_b = torch.randperm(64, generator=torch.Generator().manual_seed(2))[:12].tolist()
    ref = tiny_model(torch.tensor(prompt), AttentionBatch.build([SeqChunk(table_a, 0, 45)], whole), whole)
    for start in range(0, 45, 7):
        n = min(7, 45 - start)
        got = tiny_model(torch.tensor(prompt[start:start + n]),
                         AttentionBatch.build([SeqChunk(table_b, start, n)], chunked), chunked)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    for layer in range(TINY.num_layers):
        k_a, v_a = whole.gather(layer, torch.tensor(table_a), 45)
        k_b, v_b = chunked.gather(layer, torch.tensor(table_b), 45)
        torch.testing.assert_close(k_b, k_a, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v_b, v_a, atol=1e-5, rtol=1e-5)


def test_batched_step_matches_separate_steps(tiny_model: LlamaModel) -> None:
    cache = _cache()
    a, b = _prompt(9, seed=3), _prompt(14, seed=4)
    chunks = [SeqChunk([0, 1, 2], 0, 9), SeqChunk([5, 4, 3, 9], 0, 14)]
    both = tiny_model(torch.tensor(a + b), AttentionBatch.build(chunks, cache), cache)
    alone_a = tiny_model(torch.tensor(a), AttentionBatch.build(chunks[:1], cache), cache)
    alone_b = tiny_model(torch.tensor(b), AttentionBatch.build(chunks[1:], cache), cache)
    torch.testing.assert_close(both, torch.cat([alone_a, alone_b]), atol=1e-5, rtol=1e-5)


def test_weights_are_deterministic_from_the_seed() -> None:
    one, two, other = LlamaModel(TINY), LlamaModel(TINY), LlamaModel(dataclasses.replace(TINY, seed=1))
    for (name, p1), p2, p3 in zip(one.named_parameters(), two.parameters(), other.parameters(), strict=True):
        assert torch.equal(p1, p2), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(p1, p3), name


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelConfig(num_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig(dtype="float64")
    with pytest.raises(ValueError, match="need 3 blocks"):
        _cache(block_size=4).slots([0, 1], 0, 9)


# -- allocator and scheduler -----------------------------------------------------------------------------
def test_block_allocator_tables_free_list_and_peak() -> None:
    alloc = BlockAllocator(8)
    assert alloc.allocate("a", 3) == [0, 1, 2]
    assert alloc.allocate("b", 2) == [3, 4]
    assert alloc.allocate("a", 1) == [0, 1, 2, 5]
    with pytest.raises(OutOfBlocksError, match="need 3 blocks, 2 free"):
        alloc.allocate("c", 3)
    assert alloc.free("a") == 4 and alloc.num_free == 6 and alloc.peak_used == 6
    assert alloc.allocate("c", 3) == [6, 7, 0]  # freed blocks come back last: tables get scrambled
    with pytest.raises(KeyError):
        alloc.table("a")


def _sched(policy: Policy, budget: int = 16, blocks: int = 64, max_running: int = 8) -> Scheduler:
    return Scheduler(SchedulerConfig(policy, budget, max_running), BlockAllocator(blocks), block_size=4)


def _decoding(rid: str, prompt: int = 8) -> Request:
    r = Request(rid, [1] * prompt, 4, output_ids=[7], num_computed=prompt, phase=Phase.DECODING)
    return r


def _plan_summary(plan) -> list[tuple[str, int, int]]:
    return [(c.request.id, c.start, c.num_new) for c in plan.chunks]


def test_prefill_first_runs_waiting_prefills_before_decodes() -> None:
    s = _sched(Policy.PREFILL_FIRST, budget=16)
    s.add(Request("a", [1] * 10, 3))
    s.add(Request("b", [1] * 6, 3))
    s.add(Request("c", [1] * 30, 3))
    plan = s.schedule()
    assert _plan_summary(plan) == [("a", 0, 10), ("b", 0, 6)]  # whole prompts batched up to the budget
    for chunk in plan.chunks:
        chunk.request.num_computed, chunk.request.phase = chunk.start + chunk.num_new, Phase.DECODING
        chunk.request.output_ids.append(5)
    assert _plan_summary(s.schedule()) == [("c", 0, 30)]  # a prompt over the budget runs alone, decodes wait
    s.running[-1].phase, s.running[-1].num_computed = Phase.DECODING, 30
    s.running[-1].output_ids.append(5)
    assert _plan_summary(s.schedule()) == [("a", 10, 1), ("b", 6, 1), ("c", 30, 1)]


def test_chunked_shares_the_token_budget_between_decodes_and_prompt_chunks() -> None:
    s = _sched(Policy.CHUNKED, budget=16)
    for rid in ("d1", "d2", "d3"):
        r = _decoding(rid)
        s.allocator.allocate(rid, 3)
        s.running.append(r)
    s.add(Request("p1", [1] * 20, 2))
    s.add(Request("p2", [1] * 5, 2))
    plan = s.schedule()
    assert _plan_summary(plan) == [("d1", 8, 1), ("d2", 8, 1), ("d3", 8, 1), ("p1", 0, 13)]
    plan.chunks[-1].request.num_computed = 13
    plan = s.schedule()  # p1 continues first, then p2 is admitted into what is left
    assert _plan_summary(plan) == [("d1", 8, 1), ("d2", 8, 1), ("d3", 8, 1), ("p1", 13, 7), ("p2", 0, 5)]
    assert sum(c.num_new for c in plan.chunks) <= 16


def test_prefill_only_never_decodes_and_decode_only_never_prefills() -> None:
    p = _sched(Policy.PREFILL_ONLY)
    p.running.append(_decoding("x"))
    assert not p.schedule()
    p.add(Request("a", [1] * 9, 3))
    assert _plan_summary(p.schedule()) == [("a", 0, 9)]
    d = _sched(Policy.DECODE_ONLY)
    d.add(Request("b", [1] * 9, 3, output_ids=[4]))
    plan = d.schedule()
    assert [r.id for r in plan.admitted] == ["b"] and not plan.chunks  # the engine fetches, then decodes it


def test_admission_waits_for_blocks_and_max_running() -> None:
    s = _sched(Policy.CHUNKED, budget=64, blocks=6, max_running=8)
    s.add(Request("a", [1] * 12, 5))  # 16 tokens -> 4 blocks
    s.add(Request("b", [1] * 12, 5))
    assert [c.request.id for c in s.schedule().chunks] == ["a"]
    assert [r.id for r in s.waiting] == ["b"]
    s.release(s.running[0])
    assert [c.request.id for c in s.schedule().chunks] == ["b"]
    with pytest.raises(ValueError, match="needs 26 blocks"):
        s.add(Request("huge", [1] * 100, 5))


# -- engines and hand-off roles (in process) -------------------------------------------------------------
class LocalPort:
    """An in-process stand-in for the store hand-off; ``scramble`` delivers the pages in the wrong order."""

    def __init__(self, scramble: bool = False):
        self.held: dict[str, list[torch.Tensor]] = {}
        self.scramble = scramble

    def publish(self, request: Request, cache: PagedKVCache, block_ids: list[int]) -> float:
        self.held[request.id] = [layer[:, block_ids].clone() for layer in cache.layers]
        return 0.0

    def fetch(self, request: Request, cache: PagedKVCache, block_ids: list[int]) -> float:
        pages = self.held.pop(request.id)
        for layer, page in zip(cache.layers, pages, strict=True):
            layer[:, block_ids] = page.flip(1) if self.scramble else page
        return 0.0


def _engine(model: LlamaModel, policy: Policy, budget: int = 24, port: LocalPort | None = None) -> Engine:
    spec = CacheSpec(TINY.num_layers, 128, 4, TINY.num_kv_heads, TINY.head_dim)
    return Engine(model, spec, SchedulerConfig(policy, budget, 8), port=port)


def _drain(engine: Engine) -> list[Request]:
    done = []
    while engine.has_work():
        outcome = engine.step()
        done += outcome.finished + outcome.handed_off
    return done


REQS = [(17, 6), (33, 4), (5, 9), (26, 1)]


@pytest.mark.parametrize("policy", [Policy.PREFILL_FIRST, Policy.CHUNKED])
def test_collocated_engines_match_the_reference(tiny_model: LlamaModel, policy: Policy) -> None:
    engine = _engine(tiny_model, policy, budget=10)
    for i, (n_in, n_out) in enumerate(REQS):
        engine.add(Request(f"r{i}", _prompt(n_in, seed=i), n_out))
    done = {r.id: r for r in _drain(engine)}
    for i, (n_in, n_out) in enumerate(REQS):
        r = done[f"r{i}"]
        assert r.output_ids == greedy_reference(tiny_model, _prompt(n_in, seed=i), n_out)
        assert len(r.times.token_times_s) == n_out and r.times.prefill_start_s <= r.times.prefill_end_s
    assert engine.allocator.num_free == engine.allocator.num_blocks  # nothing leaked


@pytest.mark.parametrize("scramble", [False, True])
def test_prefill_and_decode_roles_hand_off_through_a_port(tiny_model: LlamaModel, scramble: bool) -> None:
    port = LocalPort(scramble)
    prefill, decode = _engine(tiny_model, Policy.PREFILL_ONLY, port=port), _engine(tiny_model, Policy.DECODE_ONLY,
                                                                                   port=port)
    decode.allocator.allocate("ballast", 7)  # the decode side's blocks differ from the producer's
    for i, (n_in, n_out) in enumerate(REQS):
        prefill.add(Request(f"r{i}", _prompt(n_in, seed=i), n_out))
    outputs = {}
    for r in _drain(prefill):
        if r.phase is Phase.HANDED_OFF:
            decode.add(Request(r.id, r.prompt_ids, r.max_output, output_ids=list(r.output_ids)))
        else:
            outputs[r.id] = r.output_ids
    outputs.update({r.id: r.output_ids for r in _drain(decode)})
    reference = {f"r{i}": greedy_reference(tiny_model, _prompt(n, seed=i), o) for i, (n, o) in enumerate(REQS)}
    if scramble:  # proves the equivalence checks can fail: pages in the wrong order change the tokens
        assert outputs != reference
    else:
        assert outputs == reference


# -- router ----------------------------------------------------------------------------------------------
class ScriptedPool:
    """A fake pool: prefill workers hand off at once; the first fetch of each request fails."""

    def __init__(self):
        self.sent: list[tuple[int, str, str]] = []
        self.outbox: list[dict] = []
        self.failed_once: set[str] = set()

    def start(self) -> list[dict]:
        return [{"worker": i, "weight_bytes": 1, "kv_cache_bytes": 1} for i in range(2)]

    def begin(self, t0: float) -> None:
        pass

    def send(self, index: int, op: str, **fields) -> None:
        r = fields["req"]
        self.sent.append((index, op, r["id"]))
        times = {"queued_s": 0.0, "admitted_s": 0.0, "prefill_start_s": 0.0, "prefill_end_s": 0.0,
                 "publish_s": 0.0, "fetch_s": 0.0, "error": None}
        if op == "add":
            self.outbox.append({"op": "handed_off", "worker": index,
                                "req": {**times, "id": r["id"], "output_ids": [3], "token_times_s": [0.0]}})
        elif r["id"].split("@")[0] not in self.failed_once:
            self.failed_once.add(r["id"].split("@")[0])
            self.outbox.append({"op": "failed", "worker": index, "req": {**times, "id": r["id"], "output_ids": [3],
                                "token_times_s": [], "error": "HandoffTimeoutError: no publish"}})
        else:
            out = [3] + [4] * (r["max_output"] - 1)
            self.outbox.append({"op": "finished", "worker": index, "req": {**times, "id": r["id"], "output_ids": out,
                                "token_times_s": [0.1 * i for i in range(len(out))]}})

    def pump(self, timeout: float) -> list[dict]:
        out, self.outbox = self.outbox, []
        return out

    def stop(self) -> list[dict]:
        return []

    def abort(self) -> None:
        pass


def test_router_recomputes_a_request_whose_hand_off_failed() -> None:
    trace = generate(BuiltinWorkload.SHORT, 2, seed=0, vocab_size=64, rate_rps=1000.0)
    pool = ScriptedPool()
    records, _ = Router(trace, pool, [Policy.PREFILL_ONLY, Policy.DECODE_ONLY], lambda n: n).run()
    assert all(r.finished and r.recomputed == 1 and not r.lost for r in records)
    assert all("HandoffTimeoutError" in r.errors[0] for r in records)
    rid = records[0].id
    assert [(w, op, i) for w, op, i in pool.sent if i.startswith(rid)] == [
        (0, "add", rid), (1, "decode", rid), (0, "add", f"{rid}@2"), (1, "decode", f"{rid}@2")]


class LosingPool(ScriptedPool):
    """Two collocated replicas; replica 0 dies as soon as it gets its first request."""

    def send(self, index: int, op: str, **fields) -> None:
        r = fields["req"]
        self.sent.append((index, op, r["id"]))
        if index == 0:
            self.outbox.append({"op": "lost", "worker": 0, "exitcode": -9})
            return
        out = [3] * r["max_output"]
        self.outbox.append({"op": "finished", "worker": index, "req": {
            "id": r["id"], "output_ids": out, "token_times_s": [0.1 * i for i in range(len(out))], "queued_s": 0.0,
            "admitted_s": 0.0, "prefill_start_s": 0.0, "prefill_end_s": 0.0, "publish_s": 0.0, "fetch_s": 0.0,
            "error": None}})


def test_router_moves_a_dead_replicas_requests_to_the_survivor() -> None:
    trace = generate(BuiltinWorkload.SHORT, 3, seed=0, vocab_size=64, rate_rps=1000.0)
    pool = LosingPool()
    records, _ = Router(trace, pool, [Policy.CHUNKED, Policy.CHUNKED], lambda n: n).run()
    assert all(r.finished and not r.lost and r.prefill_worker == 1 for r in records)
    assert records[0].recomputed == 1 and "died (exit code -9)" in records[0].errors[0]
    assert [w for w, _, _ in pool.sent] == [0, 1, 1, 1]


# -- traces ----------------------------------------------------------------------------------------------
def test_generated_workloads_are_seeded_and_poisson() -> None:
    a, b = generate(BuiltinWorkload.MIXED, 200, seed=5), generate(BuiltinWorkload.MIXED, 200, seed=5)
    assert a == b and a != generate(BuiltinWorkload.MIXED, 200, seed=6)
    arrivals = [r.arrival_s for r in a.requests]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    assert 2.0 < len(arrivals) / arrivals[-1] < 4.5  # about the mixed default of 3 requests/s
    assert {r.klass for r in a.requests} == {"interactive", "background"}
    longs = generate(BuiltinWorkload.LONG, 20, seed=5)
    assert min(r.prompt_tokens for r in longs.requests) >= 640


@pytest.mark.skipif(not TRACES.exists(), reason="sample traces not present")
def test_mooncake_reader_replays_shared_hash_ids_as_shared_prefixes() -> None:
    path = TRACES / "mooncake_synthetic_trace.jsonl"
    raw = [json.loads(line) for line in path.open().readlines()[:300]]
    scaling = TraceScaling(prompt_scale=0.01, output_scale=0.5, time_scale=0.1)
    trace = load_token_trace(path, num_requests=300, scaling=scaling)
    assert len(trace.requests) == 300 and trace.describe()["prompt_scale"] == 0.01
    block = math.ceil(512 * 0.01)
    by_first: dict[int, list[int]] = {}
    for i, rec in enumerate(raw):
        by_first.setdefault(rec["hash_ids"][0], []).append(i)
    i, j = next(v[:2] for v in by_first.values() if len(v) > 1 and len(raw[v[0]]["hash_ids"]) > 1
                and len(raw[v[1]]["hash_ids"]) > 1 and raw[v[0]]["input_length"] * 0.01 > block)
    reqs = {r.id: r for r in trace.requests}
    a, b = reqs[f"r{i:05d}"], reqs[f"r{j:05d}"]
    assert a.prompt_ids[:block] == b.prompt_ids[:block]
    unique = next(k for k, v in by_first.items() if len(v) == 1)
    assert reqs[f"r{by_first[unique][0]:05d}"].prompt_ids[:block] != a.prompt_ids[:block]
    assert a.prompt_tokens == max(1, round(raw[i]["input_length"] * 0.01))
    assert a.output_tokens == max(1, round(raw[i]["output_length"] * 0.5))
    assert reqs["r00003"].arrival_s == pytest.approx(raw[3]["timestamp"] / 1000 * 0.1)


@pytest.mark.skipif(not TRACES.exists(), reason="sample traces not present")
def test_azure_reader_scales_and_caps_explicitly() -> None:
    path = TRACES / "azure_llm_code_2023.csv"
    trace = load_token_trace(path, num_requests=50, scaling=TraceScaling(prompt_scale=0.1, max_prompt_tokens=300))
    assert TraceFormat.from_path(path) is TraceFormat.AZURE and len(trace.requests) == 50
    first = trace.requests[0]
    assert (first.source_prompt_tokens, first.source_output_tokens) == (4808, 10)
    assert first.prompt_tokens == 300 and first.capped  # 480 scaled tokens, capped at 300 and counted
    assert trace.capped_requests == sum(round(r.source_prompt_tokens * 0.1) > 300 for r in trace.requests) > 0
    assert trace.requests[1].arrival_s == pytest.approx(0.052)
    uncapped = load_token_trace(path, num_requests=50, scaling=TraceScaling(prompt_scale=0.1))
    with pytest.raises(ValueError, match="needs 481\\+10 tokens"):
        uncapped.check_fits(400)


def test_trace_readers_reject_bad_input(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 900, "output_length": 2, "hash_ids": [1]}\n')
    with pytest.raises(ValueError, match="cannot hold 900"):
        load_token_trace(bad)
    bad.write_text('{"timestamp": 0, "input_length": 9}\n')
    with pytest.raises(ValueError, match="output_length"):
        load_token_trace(bad)
    with pytest.raises(ValueError, match="trace format"):
        load_token_trace(tmp_path / "t.parquet")
    with pytest.raises(ValueError, match="time_scale"):
        TraceScaling(time_scale=0)


# -- whole deployments -----------------------------------------------------------------------------------
def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]


def _deploy(arch: Arch, **kw) -> DeploymentConfig:
    return DeploymentConfig(arch, model=TINY, num_blocks=256, chunk_budget=24, prefill_batch_tokens=256, **kw)


def test_inline_disaggregated_with_a_local_port(tiny_model: LlamaModel) -> None:
    trace = generate(BuiltinWorkload.SHORT, 5, seed=2, vocab_size=TINY.vocab_size, rate_rps=200.0)
    port = LocalPort()
    cfg = _deploy(Arch.DISAGGREGATED, inline=True)
    pool = InlinePool(cfg.worker_specs(None), ports={0: port, 1: port})
    records, stats = Router(trace, pool, cfg.policies(), lambda n: n).run()
    for r, req in zip(records, trace.requests, strict=True):
        assert r.output_token_ids == greedy_reference(tiny_model, list(req.prompt_ids), req.output_tokens)
        assert (r.prefill_worker, r.decode_worker, r.handed_off) == (0, 1, True)
    assert [s["role"] for s in stats] == ["prefill-only", "decode-only"]


def test_cli_run_writes_requests_and_summary(tmp_path: Path) -> None:
    from benchmarks.pd.cli import main

    out = tmp_path / "run"
    assert main(["run", "--arch", "chunked", "--workload", "short", "--num-requests", "3", "--seed", "1",
                 "--model", "tiny", "--rate", "50", "--inline", "--no-progress", "--out", str(out)]) == 0
    rows = _rows(out)
    assert len(rows) == 3 and all(list(row) == list(runschema.FIELDS) for row in rows)
    assert all(len(row["token_times_s"]) == row["output_tokens"] == len(row["output_token_ids"]) for row in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"] == {"total": 3, "completed": 3, "lost": 0, "recomputed": 0}
    assert summary["deployment"]["workers"] == [{"index": i, "role": "chunked", "threads": 1, "process": False}
                                                for i in range(2)]
    assert summary["ttft_s"]["p50"] > 0 and summary["tpot_s"]["p99"] >= summary["tpot_s"]["p50"]
    assert (out / "timeline.jsonl").read_text().count("\n") > 0


@pytest.mark.timeout(240)
def test_greedy_outputs_identical_across_architectures(tmp_path: Path, tiny_model: LlamaModel) -> None:
    """The same trace and seed through real worker processes: the hand-off loses nothing."""
    trace = generate(BuiltinWorkload.SHORT, 6, seed=3, vocab_size=TINY.vocab_size, rate_rps=30.0)
    reference = {r.id: greedy_reference(tiny_model, list(r.prompt_ids), r.output_tokens) for r in trace.requests}
    archs = [Arch.COLOCATED, Arch.CHUNKED] + ([Arch.DISAGGREGATED] if _has_handoff() else [])
    for arch in archs:
        summary = run(_deploy(arch), trace, tmp_path / arch.value)
        rows = _rows(tmp_path / arch.value)
        assert {row["id"]: row["output_token_ids"] for row in rows} == reference, arch
        assert summary["requests"]["completed"] == len(trace.requests)
        assert all(w["threads"] == 1 and w["pid"] for w in summary["workers"])
        moved = summary["transfer"]["kv_bytes_transferred"]
        if arch is Arch.DISAGGREGATED:
            handed = [row for row in rows if row["output_tokens"] > 1]
            assert moved == sum(row["kv_bytes"] for row in handed) > 0
            assert all(row["transfer_s"] > 0 and row["decode_worker"] == 1 for row in handed)
        else:
            assert moved == 0
    if Arch.DISAGGREGATED not in archs:
        pytest.skip("disaggregated leg skipped: kvstore.handoff is not available yet (collocated legs passed)")


@needs_handoff
def test_inline_disaggregated_through_an_embedded_store(tmp_path: Path, tiny_model: LlamaModel) -> None:
    trace = generate(BuiltinWorkload.SHORT, 4, seed=4, vocab_size=TINY.vocab_size, rate_rps=100.0)
    summary = run(_deploy(Arch.DISAGGREGATED, inline=True), trace, tmp_path)
    rows = _rows(tmp_path)
    for row, req in zip(rows, trace.requests, strict=True):
        assert row["output_token_ids"] == greedy_reference(tiny_model, list(req.prompt_ids), req.output_tokens)
    assert summary["deployment"]["store"] == "embedded" and summary["transfer"]["handoffs"] > 0


@needs_handoff
@pytest.mark.parametrize("prefix_keys", [False, True])
def test_shared_prefixes_hand_off_without_recompute(tmp_path: Path, tiny_model: LlamaModel, prefix_keys: bool) -> None:
    """Mooncake-style traffic: concurrent requests whose prompts share their first 70 tokens."""
    trace = generate(BuiltinWorkload.SHORT, 4, seed=4, vocab_size=TINY.vocab_size, rate_rps=1000.0)
    shared = _prompt(70, seed=9)
    trace = dataclasses.replace(trace, requests=tuple(
        dataclasses.replace(r, prompt_ids=tuple(shared) + r.prompt_ids[:10]) for r in trace.requests))
    cfg = dataclasses.replace(_deploy(Arch.DISAGGREGATED, inline=True), block_size=4, handoff_prefix_keys=prefix_keys)
    summary = run(cfg, trace, tmp_path)
    for row, req in zip(_rows(tmp_path), trace.requests, strict=True):
        assert row["output_token_ids"] == greedy_reference(tiny_model, list(req.prompt_ids), req.output_tokens)
    assert summary["requests"] == {"total": 4, "completed": 4, "lost": 0, "recomputed": 0}
