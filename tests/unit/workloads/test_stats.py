"""The one percentile (kvstore.workloads.stats) and the benchmarks' timing built on it."""

from __future__ import annotations

import pytest

from kvstore.workloads.stats import median, percentile, percentiles

pytestmark = pytest.mark.timeout(30)


def test_linear_interpolation_between_the_nearest_ranks():
    values = [4.0, 1.0, 3.0, 2.0]  # any order
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert median(values) == 2.5 and percentile(values, 25) == pytest.approx(1.75)
    samples = list(range(101))
    assert percentile(samples, 99) == 99.0 and percentile(samples, 99.5) == pytest.approx(99.5)
    assert percentiles(samples, (50, 90, 99)) == [50.0, 90.0, 99.0]


def test_bad_input_raises_value_error_naming_it():
    with pytest.raises(ValueError, match="non-empty"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"q must be a number in \[0, 100\], got 101"):
        percentile([1.0], 101)
    with pytest.raises(ValueError, match="got True"):
        percentiles([1.0], (True,))
