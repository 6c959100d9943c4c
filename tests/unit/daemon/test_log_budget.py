"""The daemon's log budget and authentication back-off (kvstore.daemon.limits), as pure logic."""

from __future__ import annotations

from kvstore.daemon.limits import AuthBackoff, LogBudget


def test_a_flood_is_held_back_and_counted_per_key():
    budget = LogBudget(burst=3, every=3600)
    assert [budget.take("a") for _ in range(5)] == [0, 0, 0, None, None]
    assert budget.take("b") == 0  # another source has its own budget
    assert budget.held_back == 2


def test_the_held_back_count_goes_out_with_the_next_window():
    budget = LogBudget(burst=1, every=0.0)  # every call opens a new window
    budget._windows["a"] = [float("-inf"), 1, 7]
    assert budget.take("a") == 7


def test_backoff_doubles_up_to_its_bound_per_peer():
    backoff = AuthBackoff(first=0.1, most=1.0, forget=3600)
    assert [backoff.failed("p") for _ in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert backoff.failed("q") == 0.1
