"""The shared aggregate of the evaluation wing (kvstore.workloads.metrics): known requests in, known metrics out."""

from __future__ import annotations

import pytest

from kvstore.workloads.metrics import (
    Pcts,
    RequestOutcome,
    aggregate,
    burst,
    by_class,
    interference,
    prefill_step_starts,
    slo_block,
)
from kvstore.workloads.slo import SLO

pytestmark = pytest.mark.timeout(60)

SLO_1S = SLO(ttft_s=1.0, tpot_s=0.1, attainment=0.75)


def _req(i: int, ttft: float, times: tuple[float, ...], **kw) -> RequestOutcome:
    arrival = kw.pop("arrival_s", float(i))
    times = tuple(arrival + t for t in times)
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
    return RequestOutcome(id=i, arrival_s=arrival, prompt_tokens=100, output_tokens=len(times), ttft_s=ttft,
                          tpot_s=tpot, finish_s=times[-1], token_times_s=times, **kw)


def test_percentiles_throughput_and_slo_of_known_requests() -> None:
    # four requests arriving at 0, 1, 2, 3 s; TTFTs 0.1..0.4 s; 3 tokens each, 0.05 s apart (one at 0.5 s)
    reqs = [_req(i, 0.1 * (i + 1), (0.1 * (i + 1), 0.1 * (i + 1) + g, 0.1 * (i + 1) + 2 * g), prefill_queue_s=0.0,
                 decode_queue_s=0.01 * i) for i, g in enumerate((0.05, 0.05, 0.05, 0.5))]
    agg = aggregate(reqs, SLO_1S)
    assert (agg.requests, agg.completed, agg.lost, agg.rejected) == (4, 4, 0, 0)
    assert agg.ttft == Pcts(pytest.approx(0.25), pytest.approx(0.37), pytest.approx(0.397))  # linear interpolation
    assert agg.tpot == Pcts(pytest.approx(0.05), pytest.approx(0.365), pytest.approx(0.4865))  # 0.05 + 0.97 * 0.45
    assert agg.decode_queue is not None and agg.decode_queue.p50 == pytest.approx(0.015)
    # duration: first arrival (0) -> last token (3 + 0.4 + 1.0)
    assert agg.duration_s == pytest.approx(4.4)
    assert agg.prompt_tokens_per_s == pytest.approx(400 / 4.4) and agg.output_tokens_per_s == pytest.approx(12 / 4.4)
    assert agg.slo.met == 3 and agg.slo.attainment == pytest.approx(0.75) and agg.slo.meets_slo
    assert agg.slo.goodput_rps == pytest.approx(3 / 4.4)
    assert agg.slo_ratio == pytest.approx(max(0.37 / 1.0, agg.tpot.p90 / 0.1))
    assert agg.transfer is None and agg.handoffs == 0 and agg.transfer_share_of_ttft == 0.0
    assert agg.slo_dict() == {"goodput_rps": round(3 / 4.4, 4), "attainment": 0.75, "attainment_interactive": 0.75,
                              "met": True}


def test_lost_and_rejected_requests_miss_and_only_a_lost_one_fails_the_run() -> None:
    ok = [_req(i, 0.1, (0.1, 0.15)) for i in range(3)]
    rejected = RequestOutcome(id=9, arrival_s=0.0, prompt_tokens=100, output_tokens=5, rejected=True)
    lost = RequestOutcome(id=10, arrival_s=0.0, prompt_tokens=100, output_tokens=5, lost=True)
    agg = aggregate(ok + [rejected], SLO_1S)
    assert (agg.completed, agg.rejected, agg.lost) == (3, 1, 0)
    assert agg.slo.attainment == pytest.approx(0.75) and agg.slo.meets_slo  # 3 of 4 >= 0.75
    agg = aggregate(ok + [lost], SLO_1S)
    assert (agg.completed, agg.lost) == (3, 1) and not agg.slo.meets_slo
    assert aggregate([rejected], SLO_1S).prompt_tokens_per_s is None  # nothing completed: no duration


def test_transfer_share_per_request_and_summed() -> None:
    moved = [_req(0, 1.0, (1.0, 1.1), transfer_s=0.5, kv_bytes=100, kv_bytes_transferred=100),
             _req(1, 3.0, (3.0, 3.1), transfer_s=0.3, kv_bytes=100, kv_bytes_transferred=100)]
    local = _req(2, 0.2, (0.2, 0.3))
    agg = aggregate(moved + [local], SLO(10.0, 1.0))
    assert agg.handoffs == 2 and agg.kv_bytes_transferred == 200
    assert agg.transfer is not None and agg.transfer.p50 == pytest.approx(0.4)
    assert agg.transfer_share_of_ttft == pytest.approx(0.8 / 4.0)  # summed transfer / summed TTFT
    assert agg.transfer_share_per_request is not None and agg.transfer_share_per_request.p50 == pytest.approx(0.3)


def test_interference_counts_the_gaps_a_prefill_step_on_the_same_worker_started_in() -> None:
    a = _req(0, 0.0, (0.0, 0.01, 0.02, 0.22, 0.23), arrival_s=0.0, decode_worker=0)
    b = _req(1, 0.0, (0.0, 0.01, 0.02), arrival_s=0.0, decode_worker=1)
    timeline = [{"worker": 0, "start_s": 0.021, "prefill_tokens": 500}, {"worker": 0, "start_s": -0.1,
                "prefill_tokens": 64}, {"worker": 1, "start_s": 0.5, "prefill_tokens": 0}]
    starts = prefill_step_starts(timeline)
    assert starts == {0: [-0.1, 0.021]}  # sorted, decode-only steps left out
    i = aggregate([a, b], SLO_1S, prefill_starts=starts).interference
    assert i is not None and (i.gaps, len(i.gaps_with_prefill)) == (6, 1)
    assert i.share_with_prefill == pytest.approx(1 / 6)
    d = i.to_dict()
    assert d["gap_p50_decode_only_s"] == pytest.approx(0.01) and d["gap_p50_with_prefill_s"] == pytest.approx(0.2)
    assert d["tpot_inflation"] == pytest.approx(19.0)
    assert aggregate([a, b], SLO_1S).interference is None  # no timeline: not measured


def test_burst_splits_interactive_gaps_by_the_background_window() -> None:
    bg = _req(0, 1.0, (1.0,), arrival_s=1.0, klass="background", prefill_end_s=2.0)
    inside = _req(1, 0.5, (0.5, 0.6, 0.9), arrival_s=1.0)
    outside = _req(2, 0.1, (0.0, 0.01, 0.02), arrival_s=3.0)
    b = aggregate([bg, inside, outside], SLO_1S).burst
    assert b is not None and (b.start_s, b.end_s) == (1.0, 2.0)
    assert len(b.inside) == 2 and len(b.outside) == 2
    assert b.to_dict()["p90_inflation"] > 1
    assert aggregate([inside, outside], SLO_1S).burst is None


def test_by_class_holds_each_class_to_the_slo() -> None:
    reqs = [_req(0, 0.5, (0.5, 0.55)), _req(1, 2.0, (2.0, 2.05), klass="background"),
            _req(2, 0.4, (0.4, 0.45), klass="background")]
    agg = aggregate(reqs, SLO_1S)
    assert agg.slo.attainment_interactive == 1.0 and agg.slo.attainment == pytest.approx(2 / 3)
    classes = {k: c.to_dict() for k, c in agg.by_class.items()}
    assert list(classes) == ["background", "interactive"]
    assert classes["background"]["requests"] == 2 and classes["background"]["attainment"] == 0.5
    assert classes["interactive"]["ttft_s"] == {"p50": 0.5, "p90": 0.5, "p99": 0.5}
    assert aggregate(reqs, SLO_1S, classes=False).by_class == {}


def test_the_row_functions_read_requests_jsonl_rows() -> None:
    rows = [{"id": "a", "class": "interactive", "arrival_s": 0.0, "ttft_s": 0.5, "tpot_s": None, "lost": False,
             "token_times_s": [0.5], "decode_worker": 0, "prefill_end_s": 0.5},
            {"id": "b", "class": "interactive", "arrival_s": 0.0, "ttft_s": None, "tpot_s": None, "lost": False,
             "shed": True, "token_times_s": []}]
    o = RequestOutcome.from_row(rows[1])
    assert o.rejected and not o.completed and not o.lost
    assert slo_block(rows, SLO_1S, duration_s=1.0) == {"goodput_rps": 1.0, "attainment": 0.5,
                                                       "attainment_interactive": 0.5, "met": False}
    assert by_class(rows, SLO_1S)["interactive"]["requests"] == 2  # shed ones are not lost
    assert interference(rows, [])["gaps"] == 0 and burst(rows) is None
