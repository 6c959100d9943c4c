"""The connector's KV events: the workers' bounded logs, the scheduler's book (a block is stored once every TP
rank saved it, removed as soon as one rank finds it gone), vLLM's hashes and tokens in the events, bounds."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("vllm")

from test_keys import LAYOUT  # noqa: E402
from test_scheduler import CountingStore, blocks, new_req, request, side, step  # noqa: E402
from vllm.distributed.kv_events import MEDIUM_STORAGE, BlockRemoved, BlockStored  # noqa: E402

from kvstore.integrations.vllm.events import (  # noqa: E402
    OWNERSHIP,
    EventBook,
    WorkerEventLog,
    WorkerEvents,
    external_hash,
)
from kvstore.integrations.vllm.keys import block_hashes, block_key  # noqa: E402

BS = LAYOUT.block_size
RANK1 = dataclasses.replace(LAYOUT, tp_rank=1, tp_size=2)
RANK0 = dataclasses.replace(LAYOUT, tp_rank=0, tp_size=2)


def keys(layout, digests):
    return [block_key(layout.fingerprint(), d) for d in digests]


def test_worker_log_is_bounded_and_off_unless_enabled():
    off = WorkerEventLog(False, limit=2)
    off.stored(["kvp/a/00"])
    assert off.take() is None
    log = WorkerEventLog(True, limit=2)
    log.stored(["kvp/a/01", "kvp/a/02"])
    log.removed(["kvp/a/03"])
    taken = log.take()
    assert taken.get_all_events() == [("stored", "kvp/a/02"), ("removed", "kvp/a/03")] and taken.dropped == 1
    assert log.take() is None  # taken once


def test_block_stored_once_every_tp_rank_saved_it():
    digests = block_hashes(list(range(2 * BS)), BS, "vllm-prompt")
    book = EventBook(True, [RANK0.fingerprint(), RANK1.fingerprint()], BS)
    # the two workers' containers, merged as vLLM's KVOutputAggregator does (first one, then add_events)
    merged = WorkerEvents([("stored", k) for k in keys(RANK0, digests)])
    merged.add_events([("stored", k) for k in keys(RANK1, digests[:1])])
    merged.increment_workers(1)
    book.on_worker_events(merged)
    first = book.take()
    assert [type(e) for e in first] == [BlockStored]  # block 1: rank 1's save has not landed yet
    assert first[0].block_hashes == [external_hash(digests[0])] and first[0].medium == MEDIUM_STORAGE
    assert first[0].ownership == OWNERSHIP
    book.on_worker_events(WorkerEvents([("stored", k) for k in keys(RANK1, digests[1:])]))
    assert [e.block_hashes for e in book.take()] == [[external_hash(digests[1])]]
    book.on_worker_events(WorkerEvents([("removed", keys(RANK1, digests[:1])[0])]))
    removed = book.take()
    assert [type(e) for e in removed] == [BlockRemoved] and removed[0].block_hashes == [external_hash(digests[0])]
    book.on_worker_events(WorkerEvents([("stored", "kvp/another-layout/" + digests[0].hex())]))
    assert book.take() == []  # another instance's layout: not a block of this engine


def test_book_is_bounded_and_counts_what_it_dropped():
    book = EventBook(True, [LAYOUT.fingerprint()], BS, limit=2)
    digests = block_hashes(list(range(5 * BS)), BS, "vllm-prompt")
    book.on_worker_events(WorkerEvents([("stored", k) for k in keys(LAYOUT, digests)], dropped=1))
    assert len(book.take()) == 2 and book.take_dropped() == 4  # 3 events past the bound + 1 a worker dropped
    assert book.take() == [] and book.take_dropped() == 0
    off = EventBook(False, [LAYOUT.fingerprint()], BS)
    off.on_worker_events(WorkerEvents([("stored", k) for k in keys(LAYOUT, digests)]))
    off.removed([digests[0].hex()])
    assert off.take() == []


def test_scheduler_names_saved_blocks_by_vllms_hashes_and_tokens():
    prompt = list(range(2 * BS + 1))
    vllm_hashes = [b"h0" * 16, b"h1" * 16]  # what vLLM's Request.block_hashes holds (one per full block)
    s = side(CountingStore())
    s.events = EventBook(True, s.fingerprints, BS)
    req = request(prompt)
    req.block_hashes = vllm_hashes
    s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, blocks([4, 5, 6]), 0)
    meta = s.build_connector_meta(step(new=[new_req(prompt, [4, 5, 6], 0)], scheduled={"r1": len(prompt)}))
    assert [t.block_ids for t in meta.saves] == [[4, 5]]
    s.update_connector_output(type("Out", (), {"kv_cache_events": WorkerEvents(
        [("stored", block_key(LAYOUT.fingerprint(), bytes.fromhex(d))) for d in meta.saves[0].digests])})())
    events = s.events.take()
    assert [e.block_hashes for e in events] == [[external_hash(h)] for h in vllm_hashes]
    assert [e.parent_block_hash for e in events] == [None, external_hash(vllm_hashes[0])]
    assert [e.token_ids for e in events] == [prompt[:BS], prompt[BS:2 * BS]]
    assert all(e.block_size == BS for e in events)
