"""Prefill -> decode hand-off through a KV connector, measured on two vLLM engines (CPU): a producer instance
prefills a prompt (``max_tokens=1``), a consumer instance then runs the same prompt carrying the producer's
``kv_transfer_params``; the consumer's time to first token is the hand-off's hit TTFT. Used by
``benchmarks.bench_vllm`` (its "P->D hand-off" table) for kvstore's connector and for the anchors:

* ``kvstore``: KVStoreConnector, ``kv_producer`` / ``kv_consumer`` on one ``kvstore serve`` daemon.
* ``nixl``: vLLM's NixlConnector (``kv_producer`` / ``kv_consumer``, ``kv_buffer_device: cpu``, the UCX
  backend): the producer's request carries ``{"do_remote_decode": true}``, its ``request_finished`` holds the
  blocks and returns their ids and side channel; the consumer pulls them from the producer's KV cache.
* ``mooncake``: vLLM's MooncakeStoreConnector on a ``mooncake_master`` started for the run (embedded
  segments, TCP transport): the producer saves, the consumer looks the prompt up and loads it.

Each engine is a single-process offline ``LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) in its own child
process; the driver (this module's :func:`run_handoff`) starts the pair, talks to it over a
``multiprocessing.connection`` socket, and stops it. One round: the consumer computes a fresh prompt of the
same length with no parameters (``recompute``, the baseline on the decode side), the producer prefills the
measured prompt (``prefill``), the consumer runs it with the producer's parameters (``hit``); the consumer's
prefix cache is reset after each request, so a hit's KV comes through the connector. ``cached`` is vLLM's
``num_cached_tokens`` of the hit: the tokens the consumer did not compute (a hand-off that silently fell
back to recomputing shows 0).

    python -m benchmarks.vllm_handoff --connectors kvstore,nixl --tokens 1024 --repeats 3   # alone
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Client, Connection, Listener

from benchmarks.common.daemon import free_port

CONNECTORS = ("kvstore", "nixl", "mooncake")
AUTH_ENV = "KVSTORE_BENCH_HANDOFF_AUTH"
LOOKUP_PORT_ENV = "KVSTORE_BENCH_MOONCAKE_LOOKUP"  # names each engine's lookup socket (an ipc:// path)
MOONCAKE_SEGMENT = "1GB"  # each engine's share of the store (embedded mode), and its transfer buffer
MOONCAKE_BUFFER = "512MB"
START_TIMEOUT_S = 600.0  # an engine's start on 2 loaded vCPUs (model load, KV cache, warm-up of the pair)
REQUEST_TIMEOUT_S = 600.0


def missing_package(connector: str) -> str | None:
    """Why ``connector`` cannot run here (its Python package is not installed), or None."""
    need = {"nixl": ("nixl", 'pip install -e ".[peers]" (nixl==1.5.1)'),
            "mooncake": ("mooncake", 'pip install -e ".[peers]" (mooncake-transfer-engine-non-cuda) and '
                                     "apt-get install -y libibverbs1")}.get(connector)
    if need is None:
        return None
    module, how = need
    if importlib.util.find_spec(module) is None:
        return f"python package {module!r} not installed: {how}"
    return None


# ---- one engine (a child process) ------------------------------------------------------------------------
def transfer_config(connector: str, role: str, url: str):
    from vllm.config import KVTransferConfig

    kv_role = "kv_producer" if role == "producer" else "kv_consumer"
    if connector == "kvstore":
        return KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.integrations.vllm",
                                kv_role=kv_role, kv_connector_extra_config={"url": url})
    if connector == "nixl":
        return KVTransferConfig(kv_connector="NixlConnector", kv_role=kv_role, kv_buffer_device="cpu",
                                kv_connector_extra_config={"backends": ["UCX"]})
    if connector == "mooncake":  # the store's addresses: MOONCAKE_CONFIG_PATH (start_mooncake)
        return KVTransferConfig(kv_connector="MooncakeStoreConnector", kv_role=kv_role,
                                kv_connector_extra_config={"lookup_rpc_port": int(os.environ[LOOKUP_PORT_ENV])})
    raise ValueError(f"unknown connector {connector!r}")


def producer_request_params(connector: str) -> dict | None:
    """What the producer's request carries: NIXL holds a request's blocks for a decode only when asked."""
    return {"do_remote_decode": True} if connector == "nixl" else None


def child_main(args) -> int:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    conn = Client(args.address, family="AF_UNIX", authkey=bytes.fromhex(os.environ.pop(AUTH_ENV)))
    conn.send({"role": args.role})
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype=args.dtype, kv_cache_memory_bytes=args.kv_bytes,
              max_model_len=args.max_len, enforce_eager=True, max_num_batched_tokens=args.max_len,
              enable_prefix_caching=True, seed=0,
              kv_transfer_config=transfer_config(args.connector, args.role, args.url))
    conn.send({"ready": True, "vocab": llm.llm_engine.model_config.get_vocab_size()})
    while True:
        msg = conn.recv()
        if msg["op"] == "stop":
            break
        kv_params = msg.get("params") if args.role == "consumer" else producer_request_params(args.connector)
        extra = {"kv_transfer_params": kv_params} if kv_params else None
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, extra_args=extra)
        start = time.perf_counter()
        (out,) = llm.generate([{"prompt_token_ids": msg["prompt"]}], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        settle = 0.0
        if args.role == "producer" and (args.connector == "mooncake" or args.settle):
            settle = drain_saves(llm, kvstore=args.connector == "kvstore")
        if args.role == "consumer":
            llm.reset_prefix_cache()  # the next hit's KV comes through the connector, never vLLM's own cache
        conn.send({"s": elapsed, "settle": settle, "cached": out.num_cached_tokens,
                   "params": out.kv_transfer_params})
    conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    # the driver stops everything next; a normal exit of a NIXL engine segfaults in a native library's
    # teardown (UCX's netlink handlers, in _dl_fini), which would only add noise to the log
    os._exit(0)


def drain_saves(llm, timeout_s: float = 60.0, kvstore: bool = False) -> float:
    """Step an idle engine until its connector holds no save in flight; the seconds it took. (An offline
    engine takes no step by itself, and store completions reach vLLM's scheduler only on a step.)"""
    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    start = time.perf_counter()
    if kvstore:  # the saver thread's queue first
        from kvstore.integrations.vllm import live_connectors

        for c in live_connectors():
            c.wait_for_saves(timeout_s)
    while connector.has_pending_push_work() and time.perf_counter() - start < timeout_s:
        llm.llm_engine.step()
        time.sleep(0.001)
    return time.perf_counter() - start


# ---- the driver ------------------------------------------------------------------------------------------
def handoff_params(params: dict | None) -> dict | None:
    """The producer's ``kv_transfer_params`` as the consumer's request carries them. vLLM's own
    ``remote_prefill_cached_tokens`` (the producer's prefix-cache hits, which vLLM would report as the
    consumer request's ``num_cached_tokens``) is left out, so ``cached`` counts what the consumer did not
    compute itself."""
    if not params:
        return params
    return {k: v for k, v in params.items() if k != "remote_prefill_cached_tokens"}


def start_mooncake(workdir: str):
    """A ``mooncake_master`` with its HTTP metadata server on free loopback ports, and the environment that
    points an engine's MooncakeStoreConnector at it (a config file: TCP transport, embedded segments)."""
    from benchmarks import mooncake_baseline as mb

    info = mb.detect()
    if not info["installed"]:
        raise RuntimeError(info["reason"])
    procs = mb._Procs(workdir)
    try:
        master, metadata, _ = mb._start_master(procs, info["master"], mb._child_env())
    except BaseException:
        procs.stop()
        raise
    path = os.path.join(workdir, "mooncake.json")
    with open(path, "w") as f:
        json.dump({"metadata_server": metadata, "master_server_address": master, "protocol": "tcp",
                   "device_name": "", "global_segment_size": MOONCAKE_SEGMENT,
                   "local_buffer_size": MOONCAKE_BUFFER}, f)
    env = {k: v for k, v in mb._child_env().items() if k.startswith("MC_")}
    return procs, {**env, "MOONCAKE_CONFIG_PATH": path, "VLLM_HOST_IP": mb.HOST}


class _Engine:
    def __init__(self, name: str, cmd: list[str], env: dict, workdir: str):
        self.name = name
        self.log = os.path.join(workdir, f"{name}.log")
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.conn: Connection | None = None

    def tail(self, lines: int = 25) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return "\n".join(f.read().splitlines()[-lines:])
        except OSError:
            return ""

    def request(self, msg: dict, timeout_s: float = REQUEST_TIMEOUT_S) -> dict:
        assert self.conn is not None
        self.conn.send(msg)
        return self.reply(timeout_s)

    def reply(self, timeout_s: float) -> dict:
        assert self.conn is not None
        deadline = time.monotonic() + timeout_s
        while not self.conn.poll(1.0):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: no reply after {timeout_s:.0f} s:\n{self.tail()}")
        try:
            return self.conn.recv()
        except EOFError as e:
            self.proc.wait(timeout=30)
            raise RuntimeError(f"{self.name} exited with code {self.proc.returncode}:\n{self.tail()}") from e

    def stop(self) -> None:
        if self.conn is not None and self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self.conn.send({"op": "stop"})
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        if self.conn is not None:
            self.conn.close()


def _accept(listener: Listener, engines: list[_Engine], timeout_s: float) -> None:
    """Pair each started engine with its connection (a child sends its role first)."""
    import threading

    accepted: list[Connection] = []
    thread = threading.Thread(target=lambda: [accepted.append(listener.accept()) for _ in engines], daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while thread.is_alive():
        thread.join(1.0)
        for e in engines:
            if e.proc.poll() is not None:
                raise RuntimeError(f"{e.name} exited with code {e.proc.returncode} during start:\n{e.tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"engines not connected after {timeout_s:.0f} s")
    for c in accepted:
        role = c.recv()["role"]
        next(e for e in engines if e.name.endswith(role)).conn = c


def run_handoff(connector: str, *, model: str, lengths: list[int], repeats: int, workdir: str, url: str = "",
                dtype: str = "bfloat16", kv_bytes: int = 1 << 30, seed: int = 0, env: dict | None = None,
                settle: bool = False, log=print) -> dict:
    """Time ``repeats`` rounds of (recompute, prefill, hit) for each prompt length; never raises: a pair that
    fails returns ``{"connector", "error"}`` with the failing engine's log tail."""
    import random

    address = os.path.join(workdir, f"handoff-{connector}.sock")
    auth = secrets.token_bytes(16)
    listener = Listener(address, family="AF_UNIX", authkey=auth)
    max_len = max(lengths) + 16
    engines: list[_Engine] = []
    mooncake = None
    try:
        extra_env: dict[str, str] = {}
        if connector == "mooncake":
            mooncake, extra_env = start_mooncake(workdir)
        for role in ("producer", "consumer"):
            child_env = dict(os.environ, **(env or {}), **extra_env, VLLM_ENABLE_V1_MULTIPROCESSING="0",
                             PYTHONUNBUFFERED="1")
            child_env[AUTH_ENV] = auth.hex()
            if connector == "nixl":  # each engine's handshake listener on its own free port
                child_env.update(VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
                                 VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port()))
            if connector == "mooncake":
                child_env[LOOKUP_PORT_ENV] = str(free_port())
            cmd = [sys.executable, "-m", "benchmarks.vllm_handoff", "--child", "--role", role, "--connector",
                   connector, "--address", address, "--url", url, "--model", model, "--dtype", dtype,
                   "--kv-bytes", str(kv_bytes), "--max-len", str(max_len)] + (["--settle"] if settle else [])
            engines.append(_Engine(f"{connector}-{role}", cmd, child_env, workdir))
        _accept(listener, engines, START_TIMEOUT_S)
        producer, consumer = engines
        vocab = min(e.reply(START_TIMEOUT_S)["vocab"] for e in engines)
        rng = random.Random(seed)
        prompt = lambda n: [rng.randrange(3, vocab) for _ in range(n)]

        def round_(n: int) -> dict:
            recompute = consumer.request({"op": "run", "prompt": prompt(n)})
            p = prompt(n)
            prefill = producer.request({"op": "run", "prompt": p})
            hit = consumer.request({"op": "run", "prompt": p, "params": handoff_params(prefill["params"])})
            return {"recompute": recompute["s"], "prefill": prefill["s"], "settle": prefill["settle"], "hit": hit["s"],
                    "cached": hit["cached"]}

        for _ in range(2):  # warm-up: the first hand-off's handshakes, connections, lazy imports
            round_(256)
        samples: dict[str, dict[str, list]] = {str(n): {"recompute": [], "prefill": [], "settle": [], "hit": [],
                                                                "cached": []}
                                               for n in lengths}
        for i in range(repeats):
            for n in lengths:
                r = round_(n)
                for k, v in r.items():
                    samples[str(n)][k].append(v)
            log(f"[handoff {connector}] repeat {i + 1}/{repeats} done")
        return {"connector": connector, "samples": samples}
    except Exception as e:  # noqa: BLE001 - reported in the table and the JSON, the other connectors go on
        return {"connector": connector, "error": str(e)}
    finally:
        for e in reversed(engines):
            e.stop()
        if mooncake is not None:
            mooncake.stop()
        listener.close()
        with contextlib.suppress(OSError):
            os.unlink(address)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--role", choices=("producer", "consumer"), default="producer", help=argparse.SUPPRESS)
    p.add_argument("--connector", default="kvstore", help=argparse.SUPPRESS)
    p.add_argument("--address", default="", help=argparse.SUPPRESS)
    p.add_argument("--max-len", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--url", default="", help=argparse.SUPPRESS)
    p.add_argument("--settle", action="store_true",
                   help="diagnostic: the producer's saves land (untimed) before the consumer's request, for "
                        "kvstore too (its hit then excludes the bounded wait for saves in flight)")
    p.add_argument("--connectors", default="kvstore,nixl")
    p.add_argument("--model", default="")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-bytes", type=int, default=1 << 30)
    p.add_argument("--tokens", default="1024")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--keep", default="", help="keep the engines' logs in this directory")
    args = p.parse_args(argv)
    if args.child:
        return child_main(args)
    import shutil

    from benchmarks.common.daemon import Daemon
    from kvstore.integrations.vllm.tiny_model import KV_REALISTIC_CONFIG, build_tiny_llama

    model = args.model or build_tiny_llama(os.path.join(tempfile.gettempdir(), "kvstore-realistic-llama"),
                                           config=KV_REALISTIC_CONFIG)
    workdir = args.keep or tempfile.mkdtemp(prefix="kvs-handoff-", dir="/tmp")
    os.makedirs(workdir, exist_ok=True)
    daemon = Daemon(workdir, capacity="3GiB", tcp=False).start()
    try:
        for c in args.connectors.split(","):
            why = missing_package(c)
            if why:
                print(f"[handoff {c}] skipped: {why}")
                continue
            out = run_handoff(c, model=model, lengths=[int(t) for t in args.tokens.split(",")],
                              repeats=args.repeats, workdir=workdir, url=daemon.unix_url, dtype=args.dtype,
                              kv_bytes=args.kv_bytes, settle=args.settle)
            print(json.dumps(out))
    finally:
        daemon.stop()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
