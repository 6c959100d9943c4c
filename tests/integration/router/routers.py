"""Helpers for the router's tests: the tiny model with a tokenizer, vLLM OpenAI servers, router processes.
Not a conftest.py (tests/conftest.py is imported as ``conftest`` elsewhere; a second one would shadow it)."""

from __future__ import annotations

import os
import re
import sys
import time
import urllib.request

from conftest import child_env, free_port

from kvstore.router.fleet import Child, Fleet, FleetError, vllm_command, wait_http

BLOCK = 128
VLLM_ARGS = ("--dtype", "bfloat16", "--block-size", str(BLOCK), "--kv-cache-memory-bytes", str(256 << 20),
             "--max-model-len", "2048", "--enforce-eager", "--seed", "0", "--max-num-seqs", "16",
             "--enable-prompt-tokens-details")
#: TCP data path, as the connector tests use (other sessions' daemons may reap /dev/shm segments).
CONNECTOR = {"transport": "tcp", "timeout_s": 5.0, "retry_s": 0.5}


def tiny_model(workdir: str) -> str:
    from kvstore.integrations.vllm.tiny_model import build_tiny_llama, build_tiny_tokenizer

    return build_tiny_tokenizer(build_tiny_llama(os.path.join(workdir, "tiny-llama"), dtype="bfloat16"))


def start_vllm(fleet: Fleet, name: str, model: str, role: str | None, store_url: str | None,
               extra: dict | None = None) -> str:
    """An OpenAI server (``extra``: more of the connector's settings) on a free port; its base URL."""
    port = free_port()
    fleet.start(name, vllm_command(model, port, role, store_url, connector_extra={**CONNECTOR, **(extra or {})},
                                   args=VLLM_ARGS))
    return f"http://127.0.0.1:{port}"


def wait_ready(fleet: Fleet, urls: dict[str, str], timeout_s: float = 600.0) -> None:
    by_name = {c.name: c for c in fleet.children}
    for name, url in urls.items():
        wait_http(by_name[name], url + "/health", timeout_s)


def start_router(fleet: Fleet, name: str, *args: str, timeout_s: float = 60.0) -> tuple[Child, str]:
    """``kvstore router ARGS`` on a free port; (child, base URL) once it listens."""
    port = free_port()
    child = fleet.start(name, [sys.executable, "-m", "kvstore.cli", "router", "--listen", f"127.0.0.1:{port}",
                               "--health-interval", "0.5", *args])
    deadline = time.monotonic() + timeout_s
    while "kvstore router on" not in child.log():
        if not child.running() or time.monotonic() > deadline:
            raise FleetError(f"router {name} did not start:\n{child.log()}")
        time.sleep(0.1)
    return child, f"http://127.0.0.1:{port}"


def metric(base: str, name: str, **labels: str) -> float:
    """A sample of the router's (or an instance's) /metrics, 0 when absent; without ``labels``, the sum over
    every label set."""
    with urllib.request.urlopen(base + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.escape(name) + (r"\{" + re.escape(want) + r"\}" if want else r"(?:\{[^}]*\})?") + r" (\S+)"
    total = 0.0
    for m in re.finditer(r"^" + pattern + "$", text, re.M):
        total += float(m.group(1))
    return total


def fleet_env() -> dict:
    env = child_env()
    env["VLLM_LOGGING_LEVEL"] = "WARNING"
    return env
