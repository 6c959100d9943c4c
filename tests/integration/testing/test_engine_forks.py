"""The tests' fork server (tests/helpers/engine_forks.py): each run a process of its own with its own pipes,
environment, directory and exit status, used like a ``subprocess.Popen``. Real processes; no vLLM needed (the
server preloads only ``json`` here)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
from conftest import pid_alive, wait_until
from engine_forks import ForkServer

SCRIPT = """
import json, os, sys
print("hash", hash("kvstore"), flush=True)
print("env", os.environ.get("ONLY_HERE"), "cwd", os.getcwd(), "preloaded", "json" in sys.modules, flush=True)
line = sys.stdin.readline()
if line.startswith("exit"):
    sys.exit(int(line.split()[1]))
if line.startswith("raise"):
    raise RuntimeError("from the script")
if line.startswith("sleep"):
    import time
    time.sleep(600)
print("echo", line.strip(), file=sys.stderr, flush=True)
"""


@pytest.fixture
def server(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    fs = ForkServer(str(tmp_path / "sock"), dict(os.environ, PYTHONHASHSEED="7"), ["json"], str(tmp_path / "log"))
    fs.wait_ready(60)
    yield fs, str(script)
    fs.close()


def _run(fs: ForkServer, script: str, line: str, tmp_path, **kw):
    proc = fs.popen([script], env=dict(os.environ, ONLY_HERE="yes"), cwd=str(tmp_path), stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    out, err = proc.communicate(line + "\n", timeout=60)
    return proc, out, err


def test_a_run_has_its_own_pipes_environment_directory_and_status(server, tmp_path):
    fs, script = server
    proc, out, err = _run(fs, script, "hello", tmp_path)
    assert proc.returncode == 0 and proc.pid != fs.proc.pid
    assert f"env yes cwd {tmp_path} preloaded True" in out
    assert err.strip() == "echo hello"
    proc, _, _ = _run(fs, script, "exit 3", tmp_path)
    assert proc.returncode == 3 and proc.poll() == 3
    proc, _, err = _run(fs, script, "raise", tmp_path)
    assert proc.returncode == 1 and "RuntimeError: from the script" in err


def test_runs_share_the_servers_hash_seed(server, tmp_path):
    fs, script = server
    hashes = {_run(fs, script, "x", tmp_path)[1].splitlines()[0] for _ in range(2)}
    direct = subprocess.run([sys.executable, script], input="x\n", capture_output=True, text=True, timeout=60,
                            env=dict(os.environ, PYTHONHASHSEED="7"))
    assert hashes == {direct.stdout.splitlines()[0]}


def test_a_run_is_killed_and_waited_for_like_a_popen(server, tmp_path):
    fs, script = server
    proc = fs.popen([script], env=dict(os.environ), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    proc.stdin.write("sleep\n")
    proc.stdin.flush()
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.5)
    assert proc.poll() is None
    proc.kill()
    assert proc.wait(30) == -signal.SIGKILL


def test_runs_die_with_the_server(server, tmp_path):
    fs, script = server
    proc = fs.popen([script], env=dict(os.environ), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    proc.stdin.write("sleep\n")
    proc.stdin.flush()
    fs.proc.kill()
    fs.proc.wait()
    assert proc.wait(30) == -signal.SIGKILL  # no status from a dead server: its children are killed with it
    wait_until(lambda: not pid_alive(proc.pid), 30)
    assert not pid_alive(proc.pid)


def test_a_server_that_cannot_start_says_why(tmp_path):
    fs = ForkServer(str(tmp_path / "sock"), dict(os.environ), ["no_such_module_here"], str(tmp_path / "log"))
    try:
        with pytest.raises(RuntimeError, match="no_such_module_here"):
            fs.wait_ready(60)
    finally:
        fs.close()


def test_a_malformed_request_is_refused_and_the_server_goes_on(server, tmp_path):
    fs, script = server
    open_fds = lambda: len(os.listdir(f"/proc/{fs.proc.pid}/fd"))  # noqa: E731
    before = open_fds()
    for fds in ([0], [0, 1, 2]):  # too few descriptors; three, but a body that is not JSON
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
            conn.connect(fs.path)
            socket.send_fds(conn, [b"{}" if len(fds) == 1 else b"not json"], fds)
            answer = json.loads(conn.recv(1 << 16))
        assert "error" in answer and "pid" not in answer
    wait_until(lambda: open_fds() == before, 30)  # it closes the connection after answering
    assert open_fds() == before  # the descriptors it was sent are closed again
    proc, out, _ = _run(fs, script, "still here", tmp_path)
    assert proc.returncode == 0 and "env yes" in out
