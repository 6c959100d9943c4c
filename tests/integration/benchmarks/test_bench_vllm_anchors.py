"""benchmarks/bench_vllm's anchor selection and hand-off table (pure logic: no engine, no NIXL or Mooncake
needed; the benchmark itself runs them)."""

from __future__ import annotations

import pytest

from benchmarks.bench_vllm import ANCHORS, handoff_table, parse_anchors, plan_runs
from benchmarks.vllm_handoff import handoff_params, missing_package

pytestmark = pytest.mark.timeout(60)


def test_parse_anchors_all_none_and_subsets_in_a_fixed_order():
    assert parse_anchors("all") == list(ANCHORS) == ["example", "nixl", "mooncake"]
    assert parse_anchors("none") == parse_anchors("") == []
    assert parse_anchors("mooncake, example") == ["example", "mooncake"]
    with pytest.raises(ValueError, match="unknown anchor.*lmcache"):
        parse_anchors("nixl,lmcache")


def test_plan_skips_a_missing_anchor_with_its_reason():
    absent = {"nixl": "python package 'nixl' not installed"}
    single, handoff, skipped = plan_runs(["none", "kvstore", "example"], ["example", "nixl", "mooncake"],
                                         missing=absent.get)
    assert single == ["none", "kvstore", "example"]
    assert handoff == ["kvstore", "mooncake"]  # kvstore's own hand-off first, then each anchor that can run
    assert skipped == absent


def test_plan_runs_no_handoff_without_a_handoff_anchor():
    assert plan_runs(["none", "kvstore", "example"], [], missing=lambda a: None) == (["none", "kvstore"], [], {})
    everything_missing = lambda a: f"{a} missing"
    single, handoff, skipped = plan_runs(["kvstore"], ["nixl", "mooncake"], missing=everything_missing)
    assert (single, handoff) == (["kvstore"], [])
    assert skipped == {"nixl": "nixl missing", "mooncake": "mooncake missing"}


def test_kvstore_and_example_need_no_package():
    assert missing_package("kvstore") is None and missing_package("example") is None


def test_handoff_params_drop_only_the_producers_cache_hit_count():
    params = {"do_remote_prefill": True, "remote_block_ids": [[1, 2]], "remote_prefill_cached_tokens": 0}
    assert handoff_params(params) == {"do_remote_prefill": True, "remote_block_ids": [[1, 2]]}
    assert handoff_params(None) is None
    assert handoff_params({"kvstore": {"version": 1}}) == {"kvstore": {"version": 1}}


def test_handoff_table_ratios_and_failures():
    samples = lambda hit: {"1024": {"recompute": [1.0, 1.0, 1.0], "prefill": [0.9] * 3, "settle": [0.0] * 3,
                                    "hit": hit, "cached": [896, 896, 0]}}
    results = {"kvstore": {"connector": "kvstore", "samples": samples([0.2, 0.2, 0.3])},
               "nixl": {"connector": "nixl", "samples": samples([0.4, 0.4, 0.5])},
               "mooncake": {"connector": "mooncake", "error": "engine exited\nRuntimeError: no segment"}}
    rows = {r["connector"]: r for r in handoff_table(results, ["1024"])}
    assert rows["kvstore"]["hit_ms"] == pytest.approx(200.0)
    assert rows["kvstore"]["hit_vs_recompute"] == pytest.approx(0.2)
    assert rows["kvstore"]["cached"] == 0  # the worst round: a silent recompute shows
    assert "kvstore_hit_vs_this" not in rows["kvstore"]
    assert rows["nixl"]["kvstore_hit_vs_this"] == pytest.approx(0.5)
    assert rows["mooncake"]["error"] == ["RuntimeError: no segment"]
