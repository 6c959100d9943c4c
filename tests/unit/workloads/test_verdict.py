"""The shared verdict core (kvstore.workloads.verdict): who meets, the winner by the caller's cost, ties, the
closest when none meets, and why the others miss."""

from __future__ import annotations

import pytest

from kvstore.workloads.metrics import RequestOutcome, aggregate
from kvstore.workloads.slo import SLO
from kvstore.workloads.verdict import Standing, choose, miss

pytestmark = pytest.mark.timeout(60)

SLO_1S = SLO(ttft_s=1.0, tpot_s=0.1)


def _s(meets: bool, attain: float = 1.0, goodput: float = 1.0, ttft: float | None = 0.5,
       tpot: float | None = 0.05, lost: int = 0) -> Standing:
    return Standing(meets, attain, goodput, ttft, tpot, lost)


def test_the_cheapest_that_meets_wins() -> None:
    standings = {"colocated": _s(False, 0.5, ttft=2.0), "chunked": _s(True), "disaggregated": _s(True)}
    cost = {"colocated": 0, "chunked": 3, "disaggregated": 2}
    c = choose(standings, SLO_1S, cost=cost.__getitem__)
    assert c.meeting == ("chunked", "disaggregated") and c.winner == "disaggregated"
    assert list(c.misses) == ["colocated"]  # the cheapest of all does not meet: it cannot win
    assert c.misses["colocated"] == "TTFT p90 2000 ms > 1000 ms (interactive attainment 50%)"


def test_ties_go_to_the_architecture_given_first() -> None:
    standings = {"b": _s(True), "a": _s(True)}
    assert choose(standings, SLO_1S, cost=lambda k: 1).winner == "b"
    assert choose(dict(reversed(standings.items())), SLO_1S, cost=lambda k: 1).winner == "a"


def test_none_meets_the_closest_by_attainment_then_goodput() -> None:
    standings = {"x": _s(False, 0.7, 1.0), "y": _s(False, 0.8, 0.5), "z": _s(False, 0.8, 0.9)}
    c = choose(standings, SLO_1S, cost=lambda k: 0)
    assert c.winner is None and c.meeting == () and c.closest == "z" and set(c.misses) == {"x", "y", "z"}
    assert choose(standings, SLO_1S, cost=lambda k: 0, closeness=lambda k: k == "x").closest == "x"
    with pytest.raises(ValueError, match="at least one"):
        choose({}, SLO_1S, cost=lambda k: 0)


def test_miss_names_lost_requests_and_the_limits_past() -> None:
    assert miss(_s(False, lost=2), SLO_1S) == "lost 2 requests"
    assert miss(_s(False, 0.6, ttft=1.5, tpot=0.2), SLO_1S) == \
        "TTFT p90 1500 ms > 1000 ms, TPOT p90 200 ms > 100 ms (interactive attainment 60%)"
    assert miss(_s(False, 0.85, tpot=None), SLO_1S) == "attainment short (interactive attainment 85%)"
    assert miss(_s(False, 0.0, ttft=float("nan"), tpot=None), SLO_1S).startswith("attainment short")


def test_standing_of_an_aggregate_and_of_its_card() -> None:
    reqs = [RequestOutcome(id=i, arrival_s=0.0, output_tokens=1, ttft_s=t, finish_s=t) for i, t in
            enumerate((0.5, 0.6, 3.0))]
    agg = aggregate(reqs, SLO(1.0, 0.1, attainment=0.9))
    s = Standing.of(agg)
    assert not s.meets and s.attainment_interactive == pytest.approx(2 / 3) and s.tpot_p90 is None
    assert s.ttft_p90 == pytest.approx(agg.ttft.p90 if agg.ttft else 0)
    card = {"slo": agg.slo_dict(), "ttft_s": agg.ttft.to_dict() if agg.ttft else None, "tpot_s": None,
            "requests": {"lost": 0}}
    assert Standing.of_card(card) == Standing(False, round(2 / 3, 4), round(agg.slo.goodput_rps, 4),
                                              round(s.ttft_p90 or 0, 6), None, 0)
