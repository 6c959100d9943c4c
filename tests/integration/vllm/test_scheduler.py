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


def side(store, role="kv_both", fail=False) -> SchedulerSide:
    s = SchedulerSide(ConnectorConfig(url="unix:///unused", retry_s=60), [LAYOUT], role, BS, Counters())

    def opener(url, timeout, transport):
        if fail:
            raise kvstore.StoreConnectionError("no daemon")
        return store

    s.link._open = opener
    return s


def request(prompt, rid="r1"):
    return SimpleNamespace(request_id=rid, prompt_token_ids=prompt, mm_features=[], lora_request=None,
                           prompt_embeds=None)


def put_blocks(store, prompt, n):
    for digest in block_hashes(prompt, BS, "vllm-prompt")[:n]:
        store.store.put(block_key(LAYOUT.fingerprint(), digest), b"x")


def test_one_batched_lookup_and_never_the_last_token():
    store = CountingStore()
    prompt = list(range(3 * BS))  # exactly 3 blocks: the last token's block may not be claimed
    put_blocks(store, prompt, 3)
    s = side(store)
    assert s.get_num_new_matched_tokens(request(prompt), 0) == (2 * BS, False)
    assert store.batch_calls == 1 and store.exists_calls == 0


def test_hits_are_the_contiguous_run_after_the_local_prefix():
    store = CountingStore()
    prompt = list(range(5 * BS + 1))
    digests = block_hashes(prompt, BS, "vllm-prompt")
    for i in (0, 1, 2, 4):  # block 3 missing: block 4 cannot be used
        store.store.put(block_key(LAYOUT.fingerprint(), digests[i]), b"x")
    s = side(store)
    assert s.get_num_new_matched_tokens(request(prompt), 0) == (3 * BS, False)
    assert s.get_num_new_matched_tokens(request(prompt), BS) == (2 * BS, False)  # beyond vLLM's local hit
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
    assert s.request_finished(request(prompt), [4, 5, 6, 7]) == (False, None)


def test_loaded_blocks_are_planned_once_and_not_saved_again():
    store = CountingStore()
    prompt = list(range(3 * BS + 1))
    put_blocks(store, prompt, 2)
    s = side(store)
    assert s.get_num_new_matched_tokens(request(prompt), 0) == (2 * BS, False)
    s.update_state_after_alloc(request(prompt), blocks([1, 2, 3, 9]), 2 * BS)
    meta = s.build_connector_meta(step(new=[new_req(prompt, [1, 2, 3, 9], 2 * BS)], scheduled={"r1": BS + 1}))
    assert [t.block_ids for t in meta.loads] == [[1, 2]]
    assert [t.block_ids for t in meta.saves] == [[3]]
    again = s.build_connector_meta(step(cached_ids=["r1"], cached_new_blocks=[None], cached_computed=[3 * BS + 1],
                                        scheduled={"r1": 1}))
    assert again.loads == [] and again.saves == []


def test_store_down_is_a_counted_miss():
    s = side(None, fail=True)
    prompt = list(range(3 * BS))
    assert s.get_num_new_matched_tokens(request(prompt), 0) == (0, False)
    assert s.get_num_new_matched_tokens(request(prompt), 0) == (0, False)  # inside retry_s: not even tried
    assert s.counters.lookup_errors == 2 and s.link.faults == 1


def test_multimodal_or_lora_requests_are_neither_looked_up_nor_saved():
    store = CountingStore()
    prompt = list(range(3 * BS))
    put_blocks(store, prompt, 2)
    s = side(store)
    req = request(prompt)
    req.lora_request = SimpleNamespace(lora_name="adapter")
    assert s.get_num_new_matched_tokens(req, 0) == (0, False) and store.batch_calls == 0
    s.update_state_after_alloc(req, blocks([1, 2, 3]), 0)
    meta = s.build_connector_meta(step(new=[new_req(prompt, [1, 2, 3], 0)], scheduled={"r1": 3 * BS}))
    assert meta.saves == []


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
