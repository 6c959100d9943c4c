"""The scheduler half against an embedded store: one batched lookup, never the prompt's last token,
contiguous hits only, saves of newly computed full blocks exactly once, faults as misses."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from test_keys import LAYOUT  # noqa: E402

import kvstore  # noqa: E402
from kvstore.integrations.vllm.config import ConnectorConfig  # noqa: E402
from kvstore.integrations.vllm.keys import block_hashes, block_key  # noqa: E402
from kvstore.integrations.vllm.scheduler import SchedulerSide  # noqa: E402
from kvstore.integrations.vllm.stats import Counters  # noqa: E402

BS = LAYOUT.block_size


class CountingStore:
    """An embedded store that counts the lookups it answers."""

    def __init__(self):
        self.store = kvstore.KVStore.embedded(capacity="8MiB")
        self.batch_calls = 0
        self.exists_calls = 0

    def batch_exists(self, keys):
        self.batch_calls += 1
        return self.store.batch_exists(keys)

    def exists(self, key):
        self.exists_calls += 1
        return self.store.exists(key)

    def close(self):
        pass


def side(store, role="kv_both", fail=False, async_loads=True) -> SchedulerSide:
    # lookup_wait_s: the lookup thread answers within it however loaded the machine is (deterministic tests)
    s = SchedulerSide(ConnectorConfig(url="unix:///unused", retry_s=60, lookup_wait_s=30.0, async_loads=async_loads),
                      [LAYOUT], role, BS, Counters())

    def opener(url, timeout, transport):
        if fail:
            raise kvstore.StoreConnectionError("no daemon")
        return store

    s.link._open = opener
    return s


def request(prompt, rid="r1"):
    return SimpleNamespace(request_id=rid, prompt_token_ids=prompt, mm_features=[], lora_request=None,
                           prompt_embeds=None, cache_salt=None, kv_transfer_params=None)


def put_blocks(store, prompt, n):
    for digest in block_hashes(prompt, BS, "vllm-prompt")[:n]:
        store.store.put(block_key(LAYOUT.fingerprint(), digest), b"x")


def test_one_batched_lookup_and_the_last_block_only_when_loading_asynchronously():
    store = CountingStore()
    prompt = list(range(3 * BS))  # exactly 3 blocks
    put_blocks(store, prompt, 3)
    # asynchronous: all three (vLLM recomputes the last token once they land)
    assert side(store).get_num_new_matched_tokens(request(prompt), 0) == (3 * BS, True)
    assert store.batch_calls == 1 and store.exists_calls == 0
    # synchronous: the last token's block is left to compute
    assert side(store, async_loads=False).get_num_new_matched_tokens(request(prompt), 0) == (2 * BS, False)
    # and vLLM's own local hit (at most num_tokens - 1) plus the store's last block
    assert side(store).get_num_new_matched_tokens(request(prompt), 2 * BS) == (BS, True)


def test_hits_are_the_contiguous_run_after_the_local_prefix():
    store = CountingStore()
    prompt = list(range(5 * BS + 1))
    digests = block_hashes(prompt, BS, "vllm-prompt")
    for i in (0, 1, 2, 4):  # block 3 missing: block 4 cannot be used
        store.store.put(block_key(LAYOUT.fingerprint(), digests[i]), b"x")
    s = side(store)
    assert s.get_num_new_matched_tokens(request(prompt), 0) == (3 * BS, True)
    assert s.get_num_new_matched_tokens(request(prompt), BS) == (2 * BS, True)  # beyond vLLM's local hit
    assert s.get_num_new_matched_tokens(request(prompt), 3 * BS) == (0, False)


def test_producer_never_loads_and_consumer_never_saves():
    store = CountingStore()
    prompt = list(range(2 * BS + 1))
    put_blocks(store, prompt, 2)
    assert side(store, "kv_producer").get_num_new_matched_tokens(request(prompt), 0) == (0, False)
    consumer = side(store, "kv_consumer")
    consumer.get_num_new_matched_tokens(request(prompt), 0)
    consumer.update_state_after_alloc(request(prompt), blocks([7, 8, 9]), 2 * BS)
    meta = consumer.build_connector_meta(step(new=[new_req(prompt, [7, 8, 9], 0)], scheduled={"r1": 1}))
    assert [t.block_ids for t in meta.loads] == [[7, 8]] and meta.saves == []


def blocks(ids):
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def new_req(prompt, ids, computed, rid="r1"):
    return SimpleNamespace(req_id=rid, prompt_token_ids=prompt, block_ids=(list(ids),), num_computed_tokens=computed,
                           mm_features=[], lora_request=None, prompt_embeds=None)


def step(new=(), cached_ids=(), cached_new_blocks=(), cached_computed=(), scheduled=None, resumed=()):
    cached = SimpleNamespace(req_ids=list(cached_ids), new_block_ids=list(cached_new_blocks),
                             num_computed_tokens=list(cached_computed), resumed_req_ids=set(resumed))
    return SimpleNamespace(scheduled_new_reqs=list(new), scheduled_cached_reqs=cached,
                           num_scheduled_tokens=scheduled or {})


def test_chunked_prefill_saves_each_full_block_once():
    store = CountingStore()
    prompt = list(range(3 * BS + 2))
    s = side(store)
    s.get_num_new_matched_tokens(request(prompt), 0)
    s.update_state_after_alloc(request(prompt), blocks([4, 5]), 0)
    first = s.build_connector_meta(step(new=[new_req(prompt, [4, 5], 0)], scheduled={"r1": BS + 1}))
    assert [t.block_ids for t in first.saves] == [[4]]
    second = s.build_connector_meta(step(cached_ids=["r1"], cached_new_blocks=[([6, 7],)],
                                         cached_computed=[BS + 1], scheduled={"r1": 2 * BS + 1}))
    assert [t.block_ids for t in second.saves] == [[5, 6]]  # block 7 holds the partial tail: never saved
    digests = [d.hex() for d in block_hashes(prompt, BS, "vllm-prompt")]
    assert first.saves[0].digests + second.saves[0].digests == digests
    third = s.build_connector_meta(step(cached_ids=["r1"], cached_new_blocks=[None], cached_computed=[3 * BS + 2],
                                        scheduled={"r1": 1}))
    assert third.saves == []
    hold, params = s.request_finished(request(prompt), [4, 5, 6, 7])
    assert hold  # saves queued: vLLM keeps the blocks until a worker reports them
    assert params == {"kvstore": {"version": 1, "fingerprint": LAYOUT.fingerprint(), "num_tokens": 3 * BS,
                                  "saved_blocks": 3, "dropped_blocks": 0, "pending": True}}
    assert s.build_connector_meta(step()).held == ["r1"]


def test_loaded_blocks_are_planned_once_and_not_saved_again():
    store = CountingStore()
    prompt = list(range(3 * BS + 1))
    put_blocks(store, prompt, 2)
    s = side(store)
    assert s.get_num_new_matched_tokens(request(prompt), 0) == (2 * BS, True)
    s.update_state_after_alloc(request(prompt), blocks([1, 2, 3, 9]), 2 * BS)
    meta = s.build_connector_meta(step(new=[new_req(prompt, [1, 2, 3, 9], 2 * BS)], scheduled={"r1": BS + 1}))
    assert [t.block_ids for t in meta.loads] == [[1, 2]]
    assert [t.block_ids for t in meta.saves] == [[3]]
    again = s.build_connector_meta(step(cached_ids=["r1"], cached_new_blocks=[None], cached_computed=[3 * BS + 1],
                                        scheduled={"r1": 1}))
    assert again.loads == [] and again.saves == []


def test_a_request_whose_loads_keep_failing_computes_its_prompt():
    """vLLM reschedules a request whose load failed and asks again: a block that keeps failing (still in the
    store, still found) must not send the request round forever. Past MAX_LOAD_ATTEMPTS loads it is a miss."""
    from kvstore.integrations.vllm.scheduler import MAX_LOAD_ATTEMPTS

    store = CountingStore()
    prompt = list(range(3 * BS + 1))
    put_blocks(store, prompt, 2)
    s = side(store)
    for attempt in range(MAX_LOAD_ATTEMPTS):  # each load "fails": vLLM frees the blocks and asks from 0 again
        assert s.get_num_new_matched_tokens(request(prompt), 0) == (2 * BS, True), attempt
        s.update_state_after_alloc(request(prompt), blocks([1, 2, 3, 9]), 2 * BS)
        assert [t.block_ids for t in s.build_connector_meta(step()).loads] == [[1, 2]]
    assert s.get_num_new_matched_tokens(request(prompt), 0) == (0, False)
    assert s.counters.reloads_refused == 1 and store.batch_calls == MAX_LOAD_ATTEMPTS
    # the failed blocks are recomputed: a saving instance saves them once computed
    s.update_connector_output(SimpleNamespace(finished_sending=None, invalid_block_ids={1}))
    s.update_state_after_alloc(request(prompt), blocks([4, 5, 6, 7]), 0)
    meta = s.build_connector_meta(step(new=[new_req(prompt, [4, 5, 6, 7], 0)], scheduled={"r1": 3 * BS + 1}))
    assert [t.block_ids for t in meta.saves] == [[4, 5, 6]]
    # another request for the same prompt still loads
    assert s.get_num_new_matched_tokens(request(prompt, rid="r2"), 0) == (2 * BS, True)


def test_store_down_is_a_counted_miss():
    s = side(None, fail=True)
    prompt = list(range(3 * BS))
    assert s.get_num_new_matched_tokens(request(prompt), 0) == (0, False)
    assert s.get_num_new_matched_tokens(request(prompt), 0) == (0, False)  # inside retry_s: not even tried
    assert s.counters.lookup_errors == 2 and s.link.faults == 1


def test_multimodal_requests_are_neither_looked_up_nor_saved():
    store = CountingStore()
    prompt = list(range(3 * BS))
    put_blocks(store, prompt, 2)
    s = side(store)
    req = request(prompt)
    req.mm_features = [object()]
    assert s.get_num_new_matched_tokens(req, 0) == (0, False) and store.batch_calls == 0
    s.update_state_after_alloc(req, blocks([1, 2, 3]), 0)
    meta = s.build_connector_meta(step(new=[new_req(prompt, [1, 2, 3], 0)], scheduled={"r1": 3 * BS}))
    assert meta.saves == []


@pytest.mark.parametrize("field,value", [("cache_salt", "tenant-a"),
                                         ("lora_request", SimpleNamespace(lora_name="adapter", lora_path="/a"))])
def test_salted_or_adapter_requests_have_keys_of_their_own(field, value):
    store = CountingStore()
    prompt = list(range(3 * BS))
    put_blocks(store, prompt, 2)  # unsalted, no adapter
    s = side(store)
    req = request(prompt, "salted")
    setattr(req, field, value)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)  # asked, and the plain blocks are not its own
    assert store.batch_calls == 1
    s.update_state_after_alloc(req, blocks([1, 2, 3]), 0)
    meta = s.build_connector_meta(step(new=[new_req(prompt, [1, 2, 3], 0, rid="salted")],
                                       scheduled={"salted": 3 * BS}))
    plain = [d.hex() for d in block_hashes(prompt, BS, "vllm-prompt")]
    assert len(meta.saves[0].digests) == 3 and not set(meta.saves[0].digests) & set(plain)
    for d in meta.saves[0].digests[:2]:  # once saved under its own keys, the same salt hits
        store.store.put(block_key(LAYOUT.fingerprint(), bytes.fromhex(d)), b"x")
    again = request(prompt, "again")
    setattr(again, field, value)
    assert s.get_num_new_matched_tokens(again, 0) == (2 * BS, True)


class SlowStore(CountingStore):
    """Answers lookups only once ``gate`` is set (a slow daemon)."""

    def __init__(self):
        super().__init__()
        import threading

        self.gate = threading.Event()

    def batch_exists(self, keys):
        assert self.gate.wait(30)
        return super().batch_exists(keys)


def test_a_slow_lookup_is_answered_on_a_later_step():
    store = SlowStore()
    prompt = list(range(3 * BS + 1))
    put_blocks(store, prompt, 3)
    s = side(store)
    s.config = ConnectorConfig(url="unix:///unused", lookup_wait_s=0.01)
    assert s.get_num_new_matched_tokens(request(prompt), 0) == (None, False)  # in flight: not yet
    assert s.get_num_new_matched_tokens(request(prompt), 0) == (None, False)  # still the same lookup
    store.gate.set()
    s.config = ConnectorConfig(url="unix:///unused", lookup_wait_s=30.0)
    assert s.get_num_new_matched_tokens(request(prompt), 0) == (3 * BS, True)
    assert store.batch_calls == 1  # asked once


def promised(prompt, blocks_, pending, rid="d1", fingerprint=None):
    req = request(prompt, rid)
    req.kv_transfer_params = {"kvstore": {"version": 1, "fingerprint": fingerprint or LAYOUT.fingerprint(),
                                          "num_tokens": blocks_ * BS, "saved_blocks": blocks_,
                                          "dropped_blocks": 0, "pending": pending}}
    return req


def test_a_promise_still_in_flight_is_waited_for_then_loaded():
    store = CountingStore()
    prompt = list(range(3 * BS + 1))
    put_blocks(store, prompt, 1)  # the prefill's saves of blocks 1 and 2 have not landed yet
    s = side(store)
    req = promised(prompt, 3, pending=True)
    assert s.get_num_new_matched_tokens(req, 0) == (None, False)
    put_blocks(store, prompt, 3)
    import time

    deadline = time.monotonic() + 30
    while (got := s.get_num_new_matched_tokens(req, 0)) == (None, False) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert got == (3 * BS, True)
    assert s.counters.handoff_waits >= 1 and s.counters.promised_misses == 0


def test_a_promise_that_never_arrives_is_a_counted_miss(caplog):
    store = CountingStore()
    prompt = list(range(3 * BS + 1))
    put_blocks(store, prompt, 1)
    s = side(store)
    s.config = ConnectorConfig(url="unix:///unused", lookup_wait_s=30.0, handoff_wait_s=0.05)
    import time

    req = promised(prompt, 3, pending=True)
    deadline = time.monotonic() + 30
    while (got := s.get_num_new_matched_tokens(req, 0)) == (None, False) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert got == (BS, True)  # what is there is loaded; the rest is computed
    assert s.counters.promised_misses == 1 and s.counters.promised_missing_blocks == 2
    assert "was promised 3 blocks" in caplog.text
    done = promised(prompt, 3, pending=False, rid="d2")  # nothing in flight: a miss at once, no wait
    assert s.get_num_new_matched_tokens(done, 0) == (BS, True) and s.counters.promised_misses == 2


def test_a_promise_of_another_layout_or_malformed_is_logged_not_fatal(caplog):
    store = CountingStore()
    prompt = list(range(2 * BS + 1))
    put_blocks(store, prompt, 2)
    s = side(store)
    assert s.get_num_new_matched_tokens(promised(prompt, 2, True, "x", fingerprint="f" * 32), 0) == (2 * BS, True)
    assert s.counters.promise_layout_mismatches == 1 and "prepared by an instance with layout" in caplog.text
    bad = request(prompt, "bad")
    bad.kv_transfer_params = {"kvstore": {"version": 9}}
    assert s.get_num_new_matched_tokens(bad, 0) == (2 * BS, True)
    assert "ignoring its kv_transfer_params" in caplog.text
    other = request(prompt, "nixl")
    other.kv_transfer_params = {"do_remote_prefill": True}  # another connector's params: not ours, no warning
    assert s.get_num_new_matched_tokens(other, 0) == (2 * BS, True)


def test_preempted_requests_are_told_to_the_workers():
    s = side(CountingStore())
    out = step()
    out.preempted_req_ids = {"b", "a"}
    assert s.build_connector_meta(out).preempted == ["a", "b"]


def test_unknown_extra_config_keys_are_refused():
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config keys"):
        ConnectorConfig.from_extra({"url": "unix:///x", "timeout": 3})
    with pytest.raises(ValueError, match="timeout_s"):
        ConnectorConfig.from_extra({"url": "unix:///x", "timeout_s": -1})
    assert ConnectorConfig.from_extra({"url": "unix:///x", "ttl_s": None}).ttl_s is None


def test_connector_stats_aggregate_and_reduce_like_vllm_expects():
    from kvstore.integrations.vllm.connector import KVStoreConnector
    from kvstore.integrations.vllm.stats import KVStoreConnectorStats

    a = KVStoreConnector.build_kv_connector_stats({**Counters(loaded_blocks=2, load_bytes=2_000_000_000,
                                                               load_seconds=1.0).as_dict()})
    b = KVStoreConnectorStats(data=Counters(loaded_blocks=1, load_errors=1).as_dict())
    assert KVStoreConnectorStats().is_empty() and not a.is_empty()
    total = a.aggregate(b).reduce()
    assert total["loaded_blocks"] == 3 and total["load_errors"] == 1 and total["load_GBps"] == 2.0
    a.reset()
    assert a.is_empty()
