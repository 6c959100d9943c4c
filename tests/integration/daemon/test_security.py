"""Who may talk to a daemon: TCP listeners need a token (loopback included) unless --insecure, token files
must be private, the default socket lives in a private per-user directory, and a client refuses a Unix-socket
daemon run by another user before it sends anything (see docs/security.md)."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import sys

import pytest
from conftest import child_env, free_port, wait_until

import kvstore
from kvstore.protocol.credentials import ensure_private_dir, read_token_file

pytestmark = pytest.mark.timeout(60)


def serve(*args: str, cwd: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """A daemon that is expected to refuse to start."""
    return subprocess.run([sys.executable, "-m", "kvstore.cli", "serve", "--capacity", "4MiB", *args],
                          capture_output=True, text=True, timeout=30, env=env or child_env(), cwd=cwd)


def test_loopback_tcp_without_a_token_is_refused(short_dir):
    sock = os.path.join(short_dir, "x.sock")
    proc = serve("--listen", f"unix://{sock}", "--listen", f"tcp://127.0.0.1:{free_port()}", cwd=short_dir)
    assert proc.returncode != 0
    err = proc.stderr + proc.stdout
    assert "127.0.0.1" in err and "token" in err and "--insecure" in err, err
    assert not os.path.exists(sock)


def test_insecure_tcp_starts_with_a_warning_and_serves_without_a_token(daemon_factory):
    d = daemon_factory(capacity="4MiB", insecure=True)
    assert wait_until(lambda: "--insecure" in d.log() and "WARNING" in d.log(), 10), d.log()
    with kvstore.connect(d.tcp_url, transport="tcp", token=None) as s:
        s.put("open", b"o")


def test_tcp_client_without_the_token_is_refused(daemon_factory, monkeypatch):
    d = daemon_factory(capacity="4MiB")
    monkeypatch.delenv("KVSTORE_TOKEN_FILE")
    with pytest.raises(kvstore.AuthenticationError):
        kvstore.connect(d.tcp_url, transport="tcp")
    with kvstore.connect(d.tcp_url, transport="tcp", token=d.token) as s:
        s.ping()


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660])
def test_token_file_readable_by_others_is_refused(short_dir, mode):
    token = os.path.join(short_dir, "token")
    with open(token, "w") as f:
        f.write("t0ken")
    os.chmod(token, mode)
    proc = serve("--listen", f"unix://{short_dir}/x.sock", "--token-file", token, cwd=short_dir)
    assert proc.returncode != 0
    assert token in proc.stderr and "chmod 600" in proc.stderr, proc.stderr
    with pytest.raises(kvstore.InvalidArgumentError, match="group or others"):
        read_token_file(token)
    os.chmod(token, 0o600)
    assert read_token_file(token) == "t0ken"


def test_default_socket_is_in_a_private_per_user_directory(short_dir):
    runtime = os.path.join(short_dir, "run")
    env = {**child_env(), "XDG_RUNTIME_DIR": runtime}
    os.mkdir(runtime, 0o755)  # a runtime directory others can look into is refused
    proc = serve(cwd=short_dir, env=env)
    assert proc.returncode != 0 and "0700" in proc.stderr, proc.stderr
    os.chmod(runtime, 0o700)
    daemon = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "serve", "--capacity", "4MiB"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=short_dir)
    try:
        path = os.path.join(runtime, "kvstore.sock")
        assert wait_until(lambda: os.path.exists(path), 20), daemon
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        from kvstore.protocol.url import default_url
        old = os.environ.get("XDG_RUNTIME_DIR")
        os.environ["XDG_RUNTIME_DIR"] = runtime
        try:
            assert default_url() == f"unix://{path}" or os.environ.get("KVSTORE_URL")
            with kvstore.connect(f"unix://{path}") as s:
                s.ping()
        finally:
            if old is None:
                del os.environ["XDG_RUNTIME_DIR"]
            else:
                os.environ["XDG_RUNTIME_DIR"] = old
    finally:
        daemon.terminate()
        assert daemon.wait(20) == 0


def test_private_dir_owned_by_someone_else_is_refused(short_dir):
    mine = os.path.join(short_dir, "mine")
    ensure_private_dir(mine)
    assert stat.S_IMODE(os.stat(mine).st_mode) == 0o700
    ensure_private_dir(mine)  # idempotent
    link = os.path.join(short_dir, "link")
    os.symlink(mine, link)
    with pytest.raises(kvstore.InvalidArgumentError, match="not a directory"):
        ensure_private_dir(link)
    if os.getuid() == 0:
        theirs = os.path.join(short_dir, "theirs")
        os.mkdir(theirs, 0o700)
        os.chown(theirs, 65534, 65534)
        with pytest.raises(kvstore.InvalidArgumentError, match="uid 65534"):
            ensure_private_dir(theirs)


SQUATTER = r"""
import os, socket, sys
path = sys.argv[1]
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(path)
os.chmod(path, 0o777)
s.listen(4)
print("READY", flush=True)
conn, _ = s.accept()
conn.settimeout(3)
got = b""
try:
    while True:
        chunk = conn.recv(65536)
        if not chunk:
            break
        got += chunk
except OSError:
    pass
print("GOT", len(got), flush=True)
"""


SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")  # one that another user may execute


@pytest.mark.skipif(os.getuid() != 0 or SYSTEM_PYTHON is None,
                    reason="needs root and a system python3 to run a squatter as another user")
def test_client_refuses_a_socket_squatted_by_another_user(short_dir):
    """Another user binds the socket first: the client names its uid and sends it nothing (no token)."""
    os.chmod(short_dir, 0o777)
    path = os.path.join(short_dir, "kv.sock")
    nobody = pwd.getpwnam("nobody")
    squatter = subprocess.Popen([SYSTEM_PYTHON, "-c", SQUATTER, path], stdout=subprocess.PIPE, text=True,
                                user=nobody.pw_uid, group=nobody.pw_gid, env={"PATH": "/usr/bin:/bin"},
                                cwd="/")
    try:
        assert squatter.stdout.readline().strip() == "READY"
        with pytest.raises(kvstore.AuthenticationError, match=f"uid {nobody.pw_uid}"):
            kvstore.connect(f"unix://{path}", token="my-secret")
        out, _ = squatter.communicate(timeout=20)
        assert "GOT 0" in out, out
    finally:
        squatter.kill()
        squatter.wait()
