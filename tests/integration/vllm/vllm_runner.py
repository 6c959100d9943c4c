"""Helpers for the vLLM connector tests: prompts and a runner for ``vllm_child.py`` (one single-process CPU
engine per run, the way vLLM is deployed: a process each). Not a conftest.py: tests/conftest.py is imported
as ``conftest`` by other test modules, and a second one would shadow it.

Each run is forked from a pre-imported parent (``engine_forks.py``, one per hash seed, started on first use
and kept for the worker's session): importing vLLM costs a process 11-14 s of one core here, and the suite
runs dozens of engines. ``KVSTORE_TEST_FORK_ENGINES=0`` starts every run as a fresh interpreter instead."""

from __future__ import annotations

import atexit
import glob
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from typing import Any

from conftest import child_env
from engine_forks import ForkServer

CHILD = os.path.join(os.path.dirname(__file__), "vllm_child.py")
BLOCK = 128


@dataclass
class Run:
    results: list[dict]
    counters: dict
    stderr: str = ""
    kv_events: list[dict] | None = None  # with --kv-events: every KV event the engine published

    @property
    def tokens(self) -> list[list[int]]:
        return [r["tokens"] for r in self.results]

    @property
    def cached(self) -> list[int]:
        return [r["cached"] for r in self.results]

    @property
    def transfers(self) -> list[dict]:
        """Per prompt, what the connector moved for it (its per-request record; {} when nothing)."""
        return [r.get("transfers", {}) for r in self.results]


def make_prompts() -> list[list[int]]:
    """Two prompts sharing a 2-block prefix, and two unrelated ones; none a whole number of blocks."""
    rng = random.Random(13)
    ids = lambda n: [rng.randrange(3, 1000) for _ in range(n)]
    shared = ids(2 * BLOCK + 20)
    return [shared + ids(30), shared + ids(150), ids(400), ids(3 * BLOCK + 1)]


def claimable_tokens(prompt: list[int], block: int = BLOCK) -> int:
    """What a store hit may cover with asynchronous loads (the default): the prompt's full blocks, the last
    token's too (vLLM recomputes only that token once they land)."""
    return len(prompt) // block * block


# what an engine run imports: vLLM's offline engine, its CPU worker and model, the connector
PRELOAD = ("vllm", "vllm.entrypoints.llm", "vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner",
           "vllm.model_executor.models.llama", "vllm.model_executor.model_loader",
           "kvstore.integrations.vllm.connector")
_servers: dict[int, tuple[ForkServer, str]] = {}  # hash seed -> its server and the directory of its socket and log
_servers_lock = threading.Lock()


def _close_servers() -> None:
    for server, where in _servers.values():
        server.close()
        shutil.rmtree(where, ignore_errors=True)


atexit.register(_close_servers)


def fork_server(hash_seed: int) -> ForkServer | None:
    """This worker's fork server for ``hash_seed`` (started on first use), or None when disabled."""
    if os.environ.get("KVSTORE_TEST_FORK_ENGINES", "1") == "0":
        return None
    with _servers_lock:
        if hash_seed not in _servers:
            where = tempfile.mkdtemp(prefix="kvforks-")
            server = ForkServer(os.path.join(where, "sock"), engine_env(hash_seed), PRELOAD,
                                os.path.join(where, "server.log"))
            _servers[hash_seed] = (server, where)
        return _servers[hash_seed][0]


def engine_env(hash_seed: int) -> dict:
    """An engine process's environment: this checkout first on its path, a fixed hash seed, the engine core in
    the same process (the offline engine, one process per run)."""
    env = child_env()
    env["PYTHONHASHSEED"] = str(hash_seed)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


def popen_engine(argv: list[str], *, hash_seed: int, **kw: Any) -> subprocess.Popen | Any:
    """``python argv...`` as an engine process: forked from the hash seed's fork server (see the module's
    docstring), else a fresh interpreter. ``kw`` are ``subprocess.Popen``'s stdin, stdout, stderr, text."""
    server = fork_server(hash_seed)
    if server is None:
        return subprocess.Popen([sys.executable, *argv], env=engine_env(hash_seed), **kw)
    return server.popen(argv, env=engine_env(hash_seed), **kw)


class Pending:
    """An engine run started in the background (:meth:`EngineRunner.start`); :meth:`result` waits for it."""

    def __init__(self, proc: Any, out: str, err_path: str, timeout: float):
        self.proc, self.out, self.err_path, self.timeout = proc, out, err_path, timeout

    def result(self) -> Run:
        try:
            self.proc.wait(self.timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        with open(self.err_path, errors="replace") as f:
            err = f.read()
        assert self.proc.returncode == 0, f"engine run failed ({self.proc.returncode}):\n{err[-6000:]}"
        run = load_run(self.out)
        run.stderr = err  # stdout and stderr, interleaved
        return run


def results(*pending: Pending) -> list[Run]:
    """Every run's result, in order; when one fails, the others are stopped before the failure propagates."""
    try:
        return [p.result() for p in pending]
    finally:
        for p in pending:
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait()


class EngineRunner:
    """Runs ``vllm_child.py`` engines over the test prompts. Each run is its own process (the connector is
    part of an engine's configuration); independent runs may be started together (:meth:`start`): an engine
    start is mostly one busy core, so two at once use a 2-core machine twice as well."""

    def __init__(self, workdir: str, model: str, prompts: list[list[int]]):
        self.workdir, self.model, self.prompts = workdir, model, prompts
        self.count = 0

    def command(self, *, url: str = "", role: str = "kv_both", extra: dict | None = None,
                args: tuple[str, ...] = ()) -> tuple[list[str], str]:
        self.count += 1
        prompts_path = os.path.join(self.workdir, f"prompts-{self.count}.json")
        out = os.path.join(self.workdir, f"out-{self.count}.json")
        with open(prompts_path, "w") as f:
            json.dump(self.prompts, f)
        # TCP data path: other sessions on this machine may run daemons in another PID namespace over the same
        # /dev/shm, whose orphan reaping unlinks a live daemon's segments (issue 11, defect 5); a TCP client
        # does not need to open them. BlockIO's own tests cover the shared-memory path.
        extra = {"transport": "tcp", **(extra or {})}
        cmd = [CHILD, "--model", self.model, "--prompts", prompts_path, "--out", out,
               "--role", role, "--extra", json.dumps(extra), *args]
        if url:
            cmd += ["--url", url]
        return cmd, out

    def start(self, *, hash_seed: int = 0, timeout: float = 900, **kw) -> Pending:
        """Start a run in the background (its output goes to files: vLLM logs a lot, and a full pipe blocks)."""
        cmd, out = self.command(**kw)
        err_path = out + ".log"
        with open(err_path, "w") as err:
            proc = popen_engine(cmd, hash_seed=hash_seed, stdin=subprocess.DEVNULL, stdout=err, stderr=err)
        return Pending(proc, out, err_path, timeout)

    def run(self, *, hash_seed: int = 0, timeout: float = 900, **kw) -> Run:
        return self.start(hash_seed=hash_seed, timeout=timeout, **kw).result()


def load_run(path: str) -> Run:
    with open(path) as f:
        data = json.load(f)
    return Run(data["results"], data["counters"], kv_events=data.get("kv_events"))


def segment_address(pid: int, segment: int) -> int:
    """Where daemon ``pid`` maps its shared-memory segment ``segment``: the mapping of the same file (inode) as
    ``/dev/shm/kvstore-<pid>-<stem>-<segment>`` (the daemon maps it under the name it created it with)."""
    names = glob.glob(f"/dev/shm/kvstore-{pid}-*-{segment}")
    inodes = {os.stat(name).st_ino for name in names}
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5].startswith("/dev/shm/") and int(parts[4]) in inodes:
                return int(parts[0].split("-")[0], 16)
    raise AssertionError(f"daemon {pid} maps no segment {segment}")


def flip_bytes(pid: int, address: int, n: int) -> bytes:
    """XOR ``n`` bytes of process ``pid``'s memory at ``address`` with 0xFF; returns the original bytes."""
    with open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
        mem.seek(address)
        original = mem.read(n)
        mem.seek(address)
        mem.write(bytes(b ^ 0xFF for b in original))
    return original
