"""kvstore.testing.daemon: the public ``kvstore serve`` launcher that tests/conftest.py's Daemon and the
benchmarks are built on."""

from __future__ import annotations

import os
import signal

import pytest

import kvstore
from kvstore.testing.daemon import Daemon, DaemonStartError

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
    assert d.leftovers() == []
    with pytest.raises(ValueError, match="does not listen on TCP"):
        _ = d.tcp_url


def test_launcher_start_failure_is_a_typed_error_with_the_log(tmp_path):
    d = Daemon(str(tmp_path), capacity="not-a-size")
    with pytest.raises(DaemonStartError, match="did not become ready") as info:
        d.start(timeout=30)
    assert "not-a-size" in str(info.value) and not d.running()


def test_started_daemon_serves_both_transports_and_stops_gracefully_at_once(tmp_path):
    """Started means serving: a SIGTERM right after start() is a graceful stop (exit 0), not a kill."""
    d = Daemon(str(tmp_path), capacity="8MiB").start()
    try:
        assert " serving " in d.log()
        with d.connect("shm") as shm, d.connect("tcp") as tcp:
            shm.put("k", b"v" * 100)
            assert bytes(tcp.get("k")) == b"v" * 100
    finally:
        rc = d.stop(signal.SIGTERM)
    assert rc == 0 and d.leftovers() == []


def test_leftovers_names_what_a_killed_daemon_left(tmp_path):
    d = Daemon(str(tmp_path), capacity="8MiB", tcp=False).start()
    pid = d.pid
    d.kill()  # no cleanup: the socket file and the shared memory stay until the next daemon reaps them
    left = d.leftovers()
    try:
        assert d.unix_path in left
        assert any(name.startswith(f"/dev/shm/kvstore-{pid}-") for name in left)
    finally:
        for name in left:
            os.unlink(name)


def test_conftest_daemon_is_the_launcher_with_the_suites_checks(daemon_factory):
    from conftest import Daemon as SuiteDaemon

    assert issubclass(SuiteDaemon, Daemon)
    d = daemon_factory(capacity="8MiB", args=("--low-watermark", "0.5"), env={"KVSTORE_TEST_MARK": "suite"})
    assert _proc_list(d.pid, "cmdline")[-2:] == ["--low-watermark", "0.5"]
    assert "KVSTORE_TEST_MARK=suite" in _proc_list(d.pid, "environ")
    with d.connect("tcp") as store:
        assert store.keys("") == []
