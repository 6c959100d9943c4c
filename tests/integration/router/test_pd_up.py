"""``kvstore pd up``: the one-command fleet starts a daemon, a vLLM OpenAI server and the router, serves a
request, and SIGINT (Ctrl-C) stops every process it started."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request

import pytest
from conftest import child_env, free_port, pid_alive, short_tmpdir, wait_until
from routers import tiny_model

pytest.importorskip("vllm")
pytest.importorskip("aiohttp")
pytestmark = [pytest.mark.heavy(45), pytest.mark.timeout(600)]


def _children(pid: int) -> set[int]:
    """Every descendant of ``pid`` now."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout.split()
    parents = {int(c): int(p) for c, p in zip(out[::2], out[1::2], strict=True)}
    found, frontier = set(), {pid}
    while frontier:
        frontier = {c for c, p in parents.items() if p in frontier} - found
        found |= frontier
    return found


def test_pd_up_serves_and_ctrl_c_stops_everything():
    workdir = short_tmpdir()
    model = tiny_model(workdir)
    port, base = free_port(), free_port()
    log = open(os.path.join(workdir, "pd.log"), "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore.cli", "pd", "up", "--model", model, "--prefill", "0", "--decode", "0",
         "--colocated", "1", "--base-port", str(base), "--listen", f"127.0.0.1:{port}", "--workdir", workdir,
         "--store-capacity", "256MiB", "--connector", '{"transport": "tcp"}',
         "--vllm-args", "--dtype bfloat16 --max-model-len 1024 --kv-cache-memory-bytes 134217728 --enforce-eager"],
        stdout=log, stderr=subprocess.STDOUT, env=child_env())
    read = lambda: open(log.name).read()
    try:
        assert wait_until(lambda: "kvstore router on" in read() or proc.poll() is not None, 500, 0.5), read()
        assert proc.poll() is None, read()
        started = _children(proc.pid)
        assert len(started) >= 2  # the daemon and the vLLM server (and its engine core)
        body = json.dumps({"prompt": "w5 w6 w7", "max_tokens": 3}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            assert re.fullmatch(r"( w\d+){3}", json.load(resp)["choices"][0]["text"])
        proc.send_signal(signal.SIGINT)
        assert proc.wait(120) == 0, read()
        assert wait_until(lambda: not any(pid_alive(p) for p in started), 60), read()
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
        shutil.rmtree(workdir, ignore_errors=True)
