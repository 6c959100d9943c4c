"""benchmarks/common: the one daemon launcher (which tests/conftest.py's Daemon is built on), the machine
description and the table printer."""

from __future__ import annotations

import os
import sys

import pytest

import kvstore
from benchmarks.common.daemon import Daemon, DaemonStartError
from benchmarks.common.machine import describe, machine
from benchmarks.common.table import Column, format_table

pytestmark = pytest.mark.timeout(90)


def _proc_list(pid: int, name: str) -> list[str]:
    with open(f"/proc/{pid}/{name}", "rb") as f:
        return [part.decode() for part in f.read().split(b"\0") if part]


def test_launcher_passes_extra_serve_args_and_env_and_cleans_up():
    d = Daemon(capacity="8MiB", tcp=False, args=("--high-watermark", "0.95"),
               env={**os.environ, "PYTHONPATH": os.getcwd(), "KVSTORE_TEST_MARK": "launcher-42"})
    with d:
        assert d.url == d.unix_url and d.running()
        cmdline = _proc_list(d.pid, "cmdline")
        assert cmdline[-2:] == ["--high-watermark", "0.95"] and "--listen" in cmdline
        assert "KVSTORE_TEST_MARK=launcher-42" in _proc_list(d.pid, "environ")
        with kvstore.connect(d.url) as store:
            store.put("k", b"v")
            assert bytes(store.get("k")) == b"v"
        workdir = d.workdir
    assert d.exit_code == 0 and not os.path.exists(workdir)  # SIGTERM, clean exit, its own directory removed
    with pytest.raises(ValueError, match="does not listen on TCP"):
        _ = d.tcp_url


def test_launcher_start_failure_is_a_typed_error_with_the_log(tmp_path):
    d = Daemon(str(tmp_path), capacity="not-a-size")
    with pytest.raises(DaemonStartError, match="did not become ready") as info:
        d.start(timeout=30)
    assert "not-a-size" in str(info.value) and not d.running()


def test_conftest_daemon_is_the_launcher_with_the_suites_checks(daemon_factory):
    from conftest import Daemon as SuiteDaemon

    assert issubclass(SuiteDaemon, Daemon)
    d = daemon_factory(capacity="8MiB", args=("--low-watermark", "0.5"), env={"KVSTORE_TEST_MARK": "suite"})
    assert _proc_list(d.pid, "cmdline")[-2:] == ["--low-watermark", "0.5"]
    assert "KVSTORE_TEST_MARK=suite" in _proc_list(d.pid, "environ")
    with d.connect("tcp") as store:
        assert store.keys("") == []


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
