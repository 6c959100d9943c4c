"""The router's skip-the-prefill-pool thresholds (kvstore.planner.thresholds) on cost models whose answer
is known by construction, and their sense on the presets."""

from __future__ import annotations

import json

import pytest

from kvstore.planner.costmodel import CostModel, TransferModel
from kvstore.planner.thresholds import HandoffThresholds, handoff_thresholds

pytestmark = pytest.mark.timeout(60)

# A step of the decode worker costs max(a * prompt tokens, W) (overlap 1, nothing else): the first W / a
# prompt tokens ride under the weight reads for free. A token's KV crosses the link in b seconds.
A, W, B = 4e-5, 3.01e-3, 1e-5  # boundaries fall between integers: 150.3 and 100.3 tokens
KV = 1000  # bytes per token


def _models(latency: float) -> tuple[CostModel, TransferModel]:
    cost = CostModel(name="known", base_s=0.0, weight_s=W, token_s=A, seq_s=0.0, pair_s=0.0, ctx_s=0.0,
                     kv_bytes_per_token=KV, weight_bytes=1.0, kv_capacity_tokens=10**6, overlap=1.0)
    return cost, TransferModel(name="known-link", latency_s=latency, bytes_per_s=KV / B)


def test_short_prompt_threshold_known_by_construction():
    # recompute(n) = max(0, a n - W), hand-off(n) = L + b n: recompute wins while n <= (W + L) / (a - b)
    latency = 1.5e-3
    cost, link = _models(latency)
    t = handoff_thresholds(cost=cost, transfer=link, decode_batch=0, reference_prompt_tokens=1000,
                           max_prompt_tokens=8192)
    crossing = (W + latency) / (A - B)  # 150.3 tokens
    assert t.min_prefill_tokens == int(crossing) + 1
    assert t.skip_prefill(int(crossing)) and not t.skip_prefill(int(crossing) + 1)
    assert t.recompute_s(100) == pytest.approx(max(0.0, A * 100 - W))
    assert t.handoff_s(100) == pytest.approx(latency + B * 100)


def test_hit_fraction_known_by_construction():
    # with c tokens cached the fetch costs L + b c on both sides, so the rest is recomputed while
    # a m - W <= b m for the m = n - c missing tokens: m <= W / (a - b) = 100.3, at n = 1000 a hit of 0.9
    cost, link = _models(0.0)
    t = handoff_thresholds(cost=cost, transfer=link, decode_batch=0, reference_prompt_tokens=1000,
                           max_prompt_tokens=8192)
    assert t.skip_hit_fraction == pytest.approx(0.9)
    assert t.skip_prefill(1000, 900) and not t.skip_prefill(1000, 899)
    assert t.skip_prefill(1000, 1000)  # all cached: nothing to compute, nothing more to move


def test_transfer_never_wins_when_a_token_is_cheaper_to_compute_than_to_send():
    cost, _ = _models(0.0)
    slow = TransferModel(name="slow", latency_s=1e-4, bytes_per_s=KV / (2 * A))  # b = 2a
    t = handoff_thresholds(cost=cost, transfer=slow, decode_batch=0, max_prompt_tokens=8192)
    assert t.min_prefill_tokens is None and t.skip_hit_fraction == 0.0
    assert t.skip_prefill(8192)


def test_presets_order_links_sensibly():
    fast = handoff_thresholds("llama-3-8b", "nvlink-4", "h100")
    rdma = handoff_thresholds("llama-3-8b", "rdma-100g", "h100")
    slow = handoff_thresholds("llama-3-8b", "10gbe", "h100")
    # a faster link hands off shorter prompts; over 10 GbE a token's KV takes longer to send (105 us)
    # than an H100 takes to compute it (~32 us), so the transfer never pays
    assert fast.min_prefill_tokens < rdma.min_prefill_tokens
    assert 50 < rdma.min_prefill_tokens < 2000
    assert slow.min_prefill_tokens is None
    assert fast.skip_hit_fraction >= rdma.skip_hit_fraction > slow.skip_hit_fraction
    assert set(rdma.to_dict()) >= {"min_prefill_tokens", "skip_hit_fraction", "link", "cost_model"}


@pytest.mark.parametrize("kwargs", [dict(decode_batch=-1), dict(reference_prompt_tokens=0),
                                    dict(model="no-such-model"), dict(link="carrier-pigeon")])
def test_bad_arguments_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        handoff_thresholds(**kwargs)


def test_bad_counts_raise_value_error():
    t = handoff_thresholds()
    with pytest.raises(ValueError):
        t.skip_prefill(10, 11)
    with pytest.raises(ValueError):
        t.skip_prefill(-1)


def test_thresholds_round_trip_through_json():
    t = handoff_thresholds("llama-3-8b", "rdma-100g", "h100")
    back = HandoffThresholds.from_dict(json.loads(json.dumps(t.to_dict())))
    assert back == t
    assert back.skip_prefill(100) and not back.skip_prefill(4096)
    with pytest.raises(ValueError):
        HandoffThresholds.from_dict({"min_prefill_tokens": 3})
