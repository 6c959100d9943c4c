"""The ``kvstore`` command line against a real daemon, through subprocesses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import xxhash
from conftest import child_env, free_port, short_tmpdir

pytestmark = pytest.mark.timeout(60)

SUBCOMMANDS = ["serve", "stats", "ls", "inspect", "put", "get", "rm"]


def kv(*args: str, env: dict | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstore.cli", *args], capture_output=True, timeout=timeout,
                          env=env or child_env())


def text(proc: subprocess.CompletedProcess) -> tuple[str, str]:
    return proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace")


@pytest.fixture(scope="module")
def files():
    path = short_tmpdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


# ---- help ------------------------------------------------------------------------------------------------
def test_entry_point_help():
    exe = shutil.which("kvstore")
    assert exe, "the `kvstore` console script is not installed"
    proc = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=30, env=child_env())
    assert proc.returncode == 0, proc.stderr
    assert "usage: kvstore" in proc.stdout
    for name in SUBCOMMANDS:
        assert name in proc.stdout


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_subcommand_help(command):
    proc = kv(command, "--help")
    out, err = text(proc)
    assert proc.returncode == 0, err
    assert f"usage: kvstore {command}" in out
    if command != "serve":
        assert "--url" in out and "--timeout" in out
    else:
        for option in ("--listen", "--capacity", "--metrics-port", "--token-file", "--insecure"):
            assert option in out


def test_no_command_is_a_usage_error():
    proc = kv()
    assert proc.returncode == 2
    assert "usage:" in text(proc)[1]


# ---- against a daemon ------------------------------------------------------------------------------------
@pytest.mark.parametrize("url_kind", ["unix", "tcp"])
def test_put_get_ls_inspect_rm(daemon, files, url_kind):
    url = daemon.unix_url if url_kind == "unix" else daemon.tcp_url
    transport = ["--transport", "tcp"] if url_kind == "tcp" else []
    data = np.random.default_rng(5).integers(0, 256, 300_000, dtype=np.uint8).tobytes()
    src = os.path.join(files, f"in-{url_kind}.bin")
    with open(src, "wb") as f:
        f.write(data)
    key = f"cli-{url_kind}/obj"

    proc = kv("put", "--url", url, *transport, key, src)
    out, err = text(proc)
    assert proc.returncode == 0, err
    assert key in out and f"{xxhash.xxh3_64_intdigest(data):016x}" in out

    dst = os.path.join(files, f"out-{url_kind}.bin")
    proc = kv("get", "--url", url, *transport, key, dst)
    assert proc.returncode == 0, text(proc)[1]
    with open(dst, "rb") as f:
        assert f.read() == data
    proc = kv("get", "--url", url, *transport, key, "-")
    assert proc.returncode == 0 and proc.stdout == data

    kv("put", "--url", url, f"cli-{url_kind}/other", src)
    proc = kv("ls", "--url", url, f"cli-{url_kind}/")
    assert proc.returncode == 0
    assert text(proc)[0].split() == [key, f"cli-{url_kind}/other"]
    proc = kv("ls", "--url", url, f"cli-{url_kind}/ot")
    assert text(proc)[0].split() == [f"cli-{url_kind}/other"]

    proc = kv("inspect", "--url", url, key, "--json")
    assert proc.returncode == 0, text(proc)[1]
    info = json.loads(proc.stdout)
    assert info["key"] == key and info["size"] == len(data) and info["state"] == "complete"
    assert info["checksum"] == f"{xxhash.xxh3_64_intdigest(data):016x}"
    for field in ("segment", "offset", "leases", "age_s", "ttl_s", "dtype", "shape"):
        assert field in info
    proc = kv("inspect", "--url", url, key)
    out = text(proc)[0]
    assert proc.returncode == 0 and "size" in out and str(len(data)) in out and "checksum" in out

    for k in (key, f"cli-{url_kind}/other"):
        proc = kv("rm", "--url", url, k)
        assert proc.returncode == 0, text(proc)[1]
    proc = kv("rm", "--url", url, key)
    assert proc.returncode == 1 and "not found" in text(proc)[1]
    proc = kv("get", "--url", url, key, dst)
    assert proc.returncode == 2
    assert "KeyNotFoundError" in text(proc)[1] and key in text(proc)[1]
    assert kv("ls", "--url", url, f"cli-{url_kind}/").stdout == b""


def test_put_with_ttl_and_empty_file(daemon, files):
    empty = os.path.join(files, "empty")
    open(empty, "wb").close()
    assert kv("put", "--url", daemon.unix_url, "cli/empty", empty).returncode == 0
    assert kv("get", "--url", daemon.unix_url, "cli/empty", "-").stdout == b""
    assert kv("put", "--url", daemon.unix_url, "--ttl", "600", "cli/ttl", empty).returncode == 0
    info = json.loads(kv("inspect", "--url", daemon.unix_url, "--json", "cli/ttl").stdout)
    assert info["ttl_s"] == 600 and 0 < info["expires_in_s"] <= 600
    for k in ("cli/empty", "cli/ttl"):
        assert kv("rm", "--url", daemon.unix_url, k).returncode == 0


def test_stats(daemon):
    proc = kv("stats", "--url", daemon.unix_url)
    out, err = text(proc)
    assert proc.returncode == 0, err
    assert "capacity" in out and "64.0 MiB" in out and "used" in out
    for name in ("objects", "pending", "leases", "evictions"):
        assert name in out
    proc = kv("stats", "--url", daemon.tcp_url, "--transport", "tcp", "--json")
    assert proc.returncode == 0, text(proc)[1]
    stats = json.loads(proc.stdout)
    assert stats["capacity_bytes"] == 64 << 20
    for name in ("used_bytes", "objects", "evictions", "leases", "pending"):
        assert isinstance(stats[name], int)


def test_url_from_environment(daemon):
    env = child_env()
    env["KVSTORE_URL"] = daemon.unix_url
    proc = kv("stats", "--json", env=env)
    assert proc.returncode == 0, text(proc)[1]
    assert json.loads(proc.stdout)["capacity_bytes"] == 64 << 20


def test_put_of_missing_file(daemon, files):
    proc = kv("put", "--url", daemon.unix_url, "cli/x", os.path.join(files, "does-not-exist"))
    assert proc.returncode == 2
    assert "does-not-exist" in text(proc)[1]


def test_bad_key_is_reported(daemon, files):
    src = os.path.join(files, "one")
    with open(src, "wb") as f:
        f.write(b"1")
    proc = kv("put", "--url", daemon.unix_url, "k" * 2000, src)
    assert proc.returncode == 2
    assert "InvalidKeyError" in text(proc)[1]


# ---- daemon unreachable ----------------------------------------------------------------------------------
@pytest.mark.parametrize("command", [["stats"], ["stats", "--json"], ["ls"], ["inspect", "k"], ["get", "k", "-"],
                                     ["rm", "k"], ["put", "k", "/dev/null"]])
def test_unreachable_daemon(command):
    url = "unix:///tmp/kvstore-test-no-such-dir/none.sock"
    proc = kv(*command, "--url", url, "--timeout", "3")
    out, err = text(proc)
    assert proc.returncode == 2, (out, err)
    assert "none.sock" in err and "connect" in err, err
    assert "Traceback" not in err


def test_unreachable_tcp_daemon():
    port = free_port()  # nothing listens there
    proc = kv("stats", "--url", f"tcp://127.0.0.1:{port}", "--timeout", "3")
    out, err = text(proc)
    assert proc.returncode == 2
    assert str(port) in err and "Traceback" not in err


def test_bad_url():
    proc = kv("stats", "--url", "http://example.invalid/")
    assert proc.returncode == 2
    assert "unix://" in text(proc)[1]


def test_serve_bad_capacity():
    proc = kv("serve", "--listen", "unix:///tmp/kvstore-test-bad-cap.sock", "--capacity", "lots")
    assert proc.returncode == 2
    assert "lots" in text(proc)[1] and "Traceback" not in text(proc)[1]


def test_ls_escapes_control_characters_in_keys(daemon):
    keys = {"esc/\x1b[2Jwiped": "esc/\\x1b[2Jwiped", "esc/line\nforged": "esc/line\\nforged",
            "esc/rtl\u202eevil": "esc/rtl\\u202eevil", "esc/caf\u00e9": "esc/caf\u00e9",
            "esc/back\\slash": "esc/back\\\\slash"}
    with daemon.connect("shm") as s:
        for key in keys:
            s.put(key, b"x")
        try:
            proc = kv("ls", "esc/", "--url", daemon.unix_url)
            out, err = text(proc)
            assert proc.returncode == 0, err
            assert "\x1b" not in out and "\u202e" not in out
            assert sorted(out.splitlines()) == sorted(keys.values()), out
        finally:
            for key in keys:
                s.remove(key)


def test_serve_cluster_without_the_cluster_extra_names_the_extra(files):
    """Without the redis client, --cluster says which extra to install (no ModuleNotFoundError traceback)."""
    sock = os.path.join(files, "nocluster.sock")
    code = ("import sys; sys.modules['redis'] = None\n"  # what an install without the extra looks like
            "from kvstore.cli.main import main\n"
            f"sys.exit(main(['serve', '--listen', 'unix://{sock}', '--cluster', 'redis://127.0.0.1:1/0']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, env=child_env())
    assert proc.returncode == 2, proc.stderr
    assert "kvstore[cluster]" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not os.path.exists(sock)


def test_inspect_stats_and_requests_escape_control_characters(daemon_factory):
    """Keys, client names and metadata are any client's bytes: the terminal never gets their escapes raw."""
    import kvstore

    d = daemon_factory(capacity="8MiB")
    key = "evil\x1b[2J\u202ekey"
    with kvstore.connect(d.unix_url, token=d.token, client_name="name\x1b]0;owned\x07") as s:
        s.put(key, b"v", meta={"note": "\x1b[31mred"})
        for args in (("inspect", key), ("stats",)):
            proc = kv(*args, "--url", d.unix_url)
            out, err = text(proc)
            assert proc.returncode == 0, err
            assert "\x1b" not in out and "\u202e" not in out and "\x07" not in out, out
            assert "\\x1b" in out
