"""benchmarks/common: the machine description and the table printer (the daemon launcher it re-exports is
kvstore.testing.daemon, tested in tests/integration/testing/)."""

from __future__ import annotations

import os
import sys

import pytest

from benchmarks.common import daemon as bench_daemon
from benchmarks.common.machine import describe, machine
from benchmarks.common.table import Column, format_table
from benchmarks.common.timing import timing_of
from kvstore.workloads.stats import percentile

pytestmark = pytest.mark.timeout(90)


def test_machine_description_names_cpu_cores_and_python():
    m = machine()
    assert m["logical_cpus"] == os.cpu_count() and m["python"] == ".".join(map(str, sys.version_info[:3]))
    assert m["cpu"] and m["cpu"] != "?"
    line = describe({**m, "host": "h", "cpu": "CPU X", "logical_cpus": 2, "python": "3.10.1", "torch": None})
    assert line == "h: 2 cores, CPU X, Python 3.10.1"
    assert describe({**m, "torch": "2.5.0"}).endswith(", torch 2.5.0")


def test_table_aligns_headers_with_their_columns():
    cols = [Column("path", "<6", "path"), Column("p50 us", ">8.1f", "p50"),
            Column("ratio", ">6.2f", lambda r: r["x"] / 2, gap=3)]
    text = format_table(cols, [{"path": "shm", "p50": 12.345, "x": 1.0}], rule=True)
    assert text.splitlines() == ["path     p50 us    ratio", "------------------------", "shm        12.3     0.50"]


def test_benchmarks_launch_daemons_with_the_library_launcher():
    from kvstore.testing import daemon

    assert bench_daemon.Daemon is daemon.Daemon and bench_daemon.project_env is daemon.project_env


def test_benchmark_timing_reports_the_same_p99_as_the_planner():
    # 200 samples: the old benchmarks took the sorted sample int(0.99 * n) = 198 (1.98 s here), the planner
    # and the pd engine interpolated at rank 0.99 * 199 = 197.01; both now give the interpolated figure.
    times = [i / 100 for i in range(200)]
    t = timing_of(4096, times)
    assert (t.p50_s, t.p99_s, t.n) == (pytest.approx(0.995), pytest.approx(1.9701), 200)
    assert t.p99_s == percentile(times, 99)
