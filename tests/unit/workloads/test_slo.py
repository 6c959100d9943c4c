"""kvstore's one SLO and its accounting (kvstore.workloads.slo), shared by the planner and benchmarks/pd."""

from __future__ import annotations

import math

import pytest

from kvstore.workloads.slo import SLO, judge

pytestmark = pytest.mark.timeout(60)


def test_a_request_meets_the_slo_on_both_limits() -> None:
    slo = SLO(ttft_s=1.0, tpot_s=0.1)
    assert slo.meets(0.5, None)  # one output token: judged on TTFT alone
    assert slo.meets(1.0, 0.1)
    assert not slo.meets(0.5, 0.2) and not slo.meets(1.5, 0.05)
    assert not slo.meets(None, None) and not slo.meets(math.nan, 0.05)  # never got a first token
    assert slo.describe() == "TTFT <= 1 s and TPOT <= 100 ms for 90% of requests"


@pytest.mark.parametrize("kwargs", [{"ttft_s": 0}, {"tpot_s": -1}, {"tpot_s": math.inf}, {"attainment": 1.5},
                                    {"attainment": 0}])
def test_slo_rejects_impossible_limits(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="SLO"):
        SLO(**kwargs)


def test_judge_holds_interactive_requests_to_the_attainment() -> None:
    slo = SLO(ttft_s=1.0, tpot_s=0.1, attainment=0.75)
    ok, slow, rejected = (0.5, 0.05, "interactive"), (0.5, 0.5, "interactive"), (None, None, "interactive")
    tally = judge(slo, [ok, ok, ok, slow, (2.0, 1.0, "background")], duration_s=2.0)
    assert (tally.requests, tally.met) == (5, 3)
    assert tally.attainment == pytest.approx(0.6) and tally.attainment_interactive == pytest.approx(0.75)
    assert tally.goodput_rps == pytest.approx(1.5) and tally.meets_slo  # background: measured, not held to it
    assert not judge(slo, [ok, ok, ok, ok], duration_s=2.0, lost=1).meets_slo  # a lost request: not met
    assert not judge(slo, [ok, ok, rejected, rejected], duration_s=2.0).meets_slo  # rejected requests miss
    empty = judge(slo, [], duration_s=0.0)
    assert (empty.attainment, empty.attainment_interactive, empty.goodput_rps) == (0.0, 1.0, 0.0)
