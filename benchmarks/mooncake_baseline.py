"""Mooncake Store measured on this machine, in this run: the baseline kvstore's store benchmark is
compared against.

    python benchmarks/mooncake_baseline.py [--sizes 4KiB,1MiB,16MiB] [--modes tcp,local] [--json PATH]
    python -m benchmarks.mooncake_baseline --batch CHUNK_SIZE [--counts 1,16,64] ...
    python -m benchmarks.mooncake_baseline --handoff-blocks 1,16,64 [--block-bytes 2MiB] [--chunk-blocks 16] ...

``measure(sizes)`` never raises. Without a usable Mooncake (``pip install
mooncake-transfer-engine-non-cuda``; its native libraries also need ``libibverbs.so.1``, from Debian's
``libibverbs1``) it returns ``{"available": False, "reason": ...}``. Otherwise it starts, on free
loopback ports:

* ``mooncake_master`` (the binary the wheel ships inside the ``mooncake`` package) with its built-in HTTP
  metadata server, so no etcd is needed;
* for mode ``tcp``: a *segment holder*, a Python process that mounts the store's memory
  (``global_segment_size``) and does nothing else, the analogue of kvstore's daemon;
* a *client* process that contributes no memory (``global_segment_size=0``), registers one buffer with
  ``register_buffer`` and times Mooncake's Python API: ``put_from`` and ``get_into`` (zero-copy from/into
  the registered buffer, the fastest paths), plain ``put`` (from a buffer) and plain ``get`` (returns
  ``bytes``). Every byte moves over Mooncake's TCP transport on 127.0.0.1.

``measure_batches(chunk_size, counts)`` (``--batch``) times instead Mooncake's batch calls, the anchor of the
hand-off benchmark: ``batch_put_from(keys, ptrs, sizes)`` and ``batch_get_into(keys, ptrs, sizes)`` of
``count`` chunks laid out back to back in one registered buffer, one call per batch.
``measure_handoff_batches(blocks)`` (``--handoff-blocks``) makes each batch the chunks ``KVHandoff.publish``
stores for a request of that many blocks (Llama-3-8B: 2 MiB a block, 16 blocks a chunk, the last one partial).
The bytes ``batch_get_into`` reads back are compared with those written; a mismatch fails the measurement.

Mode ``local`` (opt-in) skips the holder: the client mounts the segment itself, so Mooncake copies with
memcpy inside one process (its TCP-only auto-detection turns ``MC_STORE_MEMCPY`` on): the analogue of
kvstore's embedded store.

Everything started is stopped before ``measure`` returns, on error too (each child also gets
``PR_SET_PDEATHSIG`` so it dies with the calling process). Statistics are ``benchmarks.common.timing``'s
(median and p99 of ``kvstore.workloads.stats``, GB/s = size / p50 / 1e9), computed in this process from the
client's raw times.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

HOST = "127.0.0.1"
DEFAULT_SIZES = [4 << 10, 1 << 20, 16 << 20]
DISTRIBUTIONS = ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine",
                 "mooncake-transfer-engine-cuda13", "mooncake-transfer-engine-efa-non-cuda")
OPS = ("put_from", "put", "get_into", "get")
BATCH_OPS = ("batch_put_from", "batch_get_into")
# the hand-off's geometry (kvstore/handoff.py, benchmarks/bench_handoff.py): Llama-3-8B, 32 layers x K and V x
# 8 KV heads x head_dim 128 x bf16 x block 16 = 2 MiB a block, KVHandoff's default 16 blocks (32 MiB) a chunk
LLAMA3_8B_BLOCK_BYTES = 32 * 2 * 8 * 128 * 2 * 16
HANDOFF_CHUNK_BLOCKS = 16
PATH_NAME = {"tcp": "mooncake+tcp", "local": "mooncake+local"}
START_TIMEOUT_S = 60.0
CLIENT_TIMEOUT_S = 120.0  # per mode; the timed loops themselves stop at their budget long before
TIME_BUDGET_S = 50.0  # whole measure(), aimed at < 60 s; split into a per-op cap on warm-up + timed loop
OP_BUDGET_MAX_S = 3.0  # stop one op's timed loop after this long, once it has MIN_ITERS samples
PARENT_ENV = "MOONCAKE_BASELINE_PARENT"
MIN_ITERS, MAX_ITERS, BUDGET_BYTES = 20, 3000, 512 << 20


# ---- detection ---------------------------------------------------------------------------------------
def detect() -> dict:
    """Whether Mooncake Store can run here: package, master binary, and an importable native client."""
    info: dict = {"installed": False, "package": None, "master": None, "reason": None}
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        info["reason"] = ("Mooncake is not installed (python package 'mooncake' not found; "
                          "pip install mooncake-transfer-engine-non-cuda)")
        return info
    info["package"] = _package_version()
    pkg_dir = list(spec.submodule_search_locations)[0]
    master = os.path.join(pkg_dir, "mooncake_master")
    if not os.path.isfile(master):
        master = shutil.which("mooncake_master") or ""
    if not master:
        info["reason"] = f"mooncake_master binary not found (looked in {pkg_dir} and on PATH)"
        return info
    if not os.access(master, os.X_OK):
        with contextlib.suppress(OSError):
            os.chmod(master, os.stat(master).st_mode | 0o111)
    info["master"] = master
    probe = subprocess.run([sys.executable, "-c", "from mooncake.store import MooncakeDistributedStore"],
                           capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        hint = " (apt-get install libibverbs1)" if "libibverbs" in last else ""
        info["reason"] = f"mooncake.store cannot be imported: {last}{hint}"
        return info
    info["installed"] = True
    return info


def _package_version() -> str | None:
    from importlib import metadata

    for name in DISTRIBUTIONS:
        with contextlib.suppress(metadata.PackageNotFoundError):
            return f"{name} {metadata.version(name)}"
    return None


# ---- process management -----------------------------------------------------------------------------
def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((HOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _die_with_parent() -> None:
    """Called first thing in every child: SIGKILL it when the process that started it dies (the
    setting survives exec, so it covers mooncake_master too). No preexec_fn: the caller may have threads."""
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    parent = os.environ.get(PARENT_ENV)
    if parent and os.getppid() != int(parent):  # the starter died before the line above ran
        os._exit(1)


class _Procs:
    """Children started by one measurement; ``stop()`` ends them all, newest first."""

    def __init__(self, workdir: str):
        self.workdir = workdir
        self.procs: list[tuple[str, subprocess.Popen, str]] = []

    def start(self, name: str, argv: list[str], env: dict, stdout=subprocess.DEVNULL) -> subprocess.Popen:
        log = os.path.join(self.workdir, f"{name}.log")
        with open(log, "ab") as err:
            proc = subprocess.Popen(argv, env={**env, PARENT_ENV: str(os.getpid())}, stdin=subprocess.DEVNULL,
                                    stdout=stdout, stderr=err, start_new_session=True)
        self.procs.append((name, proc, log))
        return proc

    def stop(self) -> None:
        for _, proc, _ in reversed(self.procs):
            _stop(proc)
        self.procs.clear()

    def log_tail(self, name: str, lines: int = 12) -> str:
        for n, _, log in self.procs:
            if n == name:
                return _tail(log, lines)
        return _tail(os.path.join(self.workdir, f"{name}.log"), lines)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)
    else:  # the leader is gone; make sure nothing else it started survives in its group
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def _tail(path: str, lines: int) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read().splitlines()
    except OSError:
        return ""
    # glog's INFO lines, and the 404 every client logs once while registering itself, are noise here
    noise = re.compile(r"^I\d{4} |metadata not found|Failed to retrieve segment descriptor|Logging before InitGoogle")
    keep = [ln for ln in text if not noise.search(ln)]
    return "\n".join(keep[-lines:])


def _wait_port(port: int, proc: subprocess.Popen, deadline: float) -> None:
    while True:
        with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=1):
            return
        if proc.poll() is not None:
            raise RuntimeError(f"exited with code {proc.returncode} before listening on port {port}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"not listening on port {port} after {START_TIMEOUT_S:.0f} s")
        time.sleep(0.05)


def _master_flags(master: str) -> set[str]:
    try:
        out = subprocess.run([master, "--helpfull"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return set()
    return set(re.findall(r"^\s+-(\w+) ", out.stdout + out.stderr, re.M))


def _start_master(procs: _Procs, master: str, env: dict) -> tuple[str, str, list[str]]:
    """Start mooncake_master with its HTTP metadata server; returns (master address, metadata URL, argv)."""
    known = _master_flags(master)
    last_error = ""
    for _attempt in range(3):
        rpc, meta, metrics = _free_ports(3)
        flags = {"rpc_port": rpc, "port": rpc, "rpc_address": HOST,
                 "enable_http_metadata_server": "true", "http_metadata_server_host": HOST,
                 "http_metadata_server_port": meta, "metrics_host": HOST, "metrics_port": metrics,
                 "enable_metric_reporting": "false", "logtostderr": "true"}
        # eviction keeps its defaults (high watermark 0.9): the segment is sized at 4x the largest value
        # and every put's key is force-removed right after, so the timed loops never come near it
        if "rpc_port" in known:
            flags.pop("port")
        argv = [master] + [f"--{k}={v}" for k, v in flags.items() if not known or k in known]
        proc = procs.start("master", [sys.executable, os.path.abspath(__file__), "_exec"] + argv, env)
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            _wait_port(rpc, proc, deadline)
            _wait_port(meta, proc, deadline)
            return f"{HOST}:{rpc}", f"http://{HOST}:{meta}/metadata", argv
        except RuntimeError as e:
            last_error = f"mooncake_master {e}: {procs.log_tail('master')}"
            _stop(proc)
            procs.procs.pop()
    raise RuntimeError(last_error)


def _child_env() -> dict:
    env = dict(os.environ)
    env["MC_TCP_BIND_ADDRESS"] = HOST  # advertise 127.0.0.1 to peers, not the first NIC's address
    env.pop("MC_STORE_LOCAL_HOT_CACHE_SIZE", None)  # no client-side cache in front of the transport
    env.pop("MC_LEGACY_RPC_PORT_BINDING", None)  # collides with the TCP transport's handshake port
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _start_holder(procs: _Procs, cfg_path: str, env: dict) -> None:
    proc = procs.start("holder", [sys.executable, os.path.abspath(__file__), "_holder", cfg_path], env,
                       stdout=subprocess.PIPE)
    deadline = time.monotonic() + START_TIMEOUT_S
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        while time.monotonic() < deadline:
            if sel.select(timeout=0.2):
                line = proc.stdout.readline()
                if line.startswith(b"READY"):
                    return
                if not line:
                    break
            elif proc.poll() is not None:
                break
    finally:
        sel.close()
    raise RuntimeError(f"segment holder did not start: {procs.log_tail('holder')}")


# ---- measurement (parent side) ----------------------------------------------------------------------
@contextlib.contextmanager
def _never_raises(result: dict):
    """Run a measurement into ``result``: an exception becomes ``available`` False with its ``reason`` (a baseline
    must never take the caller's benchmark down); the load average after and the total time are recorded."""
    t_start = time.monotonic()
    try:
        yield
    except Exception as e:
        result["available"] = False
        result["reason"] = f"{type(e).__name__}: {e}"
    finally:
        result["loadavg_after"] = _loadavg()
        result["total_s"] = round(time.monotonic() - t_start, 2)


def measure(sizes: list[int] | None = None, modes: tuple[str, ...] | list[str] = ("tcp",),
            time_budget_s: float = TIME_BUDGET_S) -> dict:
    """Mooncake Store timings for each size and mode (``tcp``: client and segment in two processes;
    ``local``: one process). Never raises: ``available`` is False and ``reason`` says why when it
    could not run. Rows have the keys of ``benchmarks.common.timing.Timing.as_dict`` plus ``path``/``op``."""
    sizes = sorted(set(int(s) for s in (sizes or DEFAULT_SIZES)))
    result: dict = {"available": False, "reason": None, "package": None, "rows": [], "modes": list(modes),
                    "sizes": sizes, "loadavg_before": _loadavg()}
    with _never_raises(result):
        info = detect()
        result["package"] = info["package"]
        if not info["installed"]:
            result["reason"] = info["reason"]
            return result
        bad = [m for m in modes if m not in PATH_NAME]
        if bad or not sizes or min(sizes) <= 0:
            result["reason"] = f"bad arguments: modes {list(modes)}, sizes {sizes}"
            return result
        details = {}
        # 4 ops per size per mode; keep ~5 s per mode for starting and stopping processes
        op_budget = (time_budget_s - 5.0 * len(modes)) / (len(OPS) * len(sizes) * len(modes))
        op_budget = max(0.3, min(OP_BUDGET_MAX_S, op_budget))
        result["op_budget_s"] = round(op_budget, 2)
        for mode in modes:
            rows, detail = _measure_mode(info["master"], sizes, mode, op_budget)
            result["rows"].extend(rows)
            details[mode] = detail
        result["details"] = details
        result["available"] = True
    return result


def row(result: dict, op: str, size: int, path: str = "mooncake+tcp") -> dict | None:
    """The row of ``measure()``'s result for one op ("put_from", "put", "get_into", "get") and size."""
    for r in result.get("rows", []):
        if r["op"] == op and r["size"] == size and r["path"] == path:
            return r
    return None


def _measure_mode(master: str, sizes: list[int], mode: str, op_budget: float) -> tuple[list[dict], dict]:
    biggest = max(sizes)
    segment = max(256 << 20, 4 * biggest + (64 << 20))
    data, detail = _run_client(master, mode, segment, "_client",
                               {"sizes": sizes, "op_budget_s": op_budget, "local_buffer": 2 * biggest + (16 << 20)})
    # the client (a script, without the project on its path) reports raw times; statistics are made here
    from benchmarks.common.timing import timing_of

    rows = [{"path": PATH_NAME[mode], "op": r["op"], **timing_of(r["size"], r["times_s"]).as_dict()}
            for r in data["rows"]]
    detail["loopback_bytes_per_get_into"] = data.get("lo_bytes")
    return rows, detail


def _run_client(master: str, mode: str, segment: int, client_cmd: str, client_cfg: dict) -> tuple[dict, dict]:
    """Start the master (and, in mode ``tcp``, the segment holder), run one client process (``client_cmd``
    with ``client_cfg`` plus the addresses), stop everything; returns (the client's JSON output, details)."""
    with tempfile.TemporaryDirectory(prefix="mooncake-baseline-") as workdir:
        procs = _Procs(workdir)
        try:
            t0 = time.monotonic()
            env = _child_env()
            master_addr, meta_url, master_argv = _start_master(procs, master, env)
            common = {"master": master_addr, "metadata": meta_url, "segment": segment}
            if mode == "tcp":
                holder_cfg = os.path.join(workdir, "holder.json")
                _write_json(holder_cfg, {**common, "local_buffer": 16 << 20})
                _start_holder(procs, holder_cfg, env)
            cfg_path, out = os.path.join(workdir, "client.json"), os.path.join(workdir, "out.json")
            _write_json(cfg_path, {**common, **client_cfg, "out": out,
                                   "client_segment": segment if mode == "local" else 0})
            startup_s = time.monotonic() - t0
            client = procs.start("client", [sys.executable, os.path.abspath(__file__), client_cmd, cfg_path], env)
            try:
                client.wait(timeout=CLIENT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"client did not finish in {CLIENT_TIMEOUT_S:.0f} s: "
                                   f"{procs.log_tail('client')}") from None
            if client.returncode != 0 or not os.path.exists(out):
                raise RuntimeError(f"client failed (exit {client.returncode}): {procs.log_tail('client')}")
            with open(out) as f:
                data = json.load(f)
        finally:
            procs.stop()
    detail = {"master_argv": master_argv, "startup_s": round(startup_s, 2), "segment_bytes": segment,
              "mc_env": {k: v for k, v in _child_env().items() if k.startswith("MC_")},
              "client_setup_s": data.get("setup_s")}
    return data, detail


# ---- batches: the hand-off's anchor ------------------------------------------------------------------
def handoff_chunks(blocks: int, block_nbytes: int = LLAMA3_8B_BLOCK_BYTES,
                   chunk_blocks: int = HANDOFF_CHUNK_BLOCKS) -> list[int]:
    """Byte sizes of the chunks ``KVHandoff.publish`` stores for a request of ``blocks`` blocks: one per
    ``chunk_blocks`` blocks, the last one holding the remainder. Raises ValueError for a count below 1."""
    for name, v in (("blocks", blocks), ("block_nbytes", block_nbytes), ("chunk_blocks", chunk_blocks)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    return [min(chunk_blocks, blocks - b) * block_nbytes for b in range(0, blocks, chunk_blocks)]


def measure_batches(chunk_size: int, counts: list[int], modes: tuple[str, ...] | list[str] = ("tcp",),
                    time_budget_s: float = TIME_BUDGET_S) -> dict:
    """Mooncake's ``batch_put_from`` and ``batch_get_into`` of ``count`` chunks of ``chunk_size`` bytes each,
    from and into one registered buffer, for each count and mode: one call per batch, as a hand-off of
    ``count`` chunks would make. Never raises (``available`` False and ``reason`` when it could not run).
    Rows: ``path``, ``op`` (``batch_put_from``/``batch_get_into``), ``count``, ``chunk_size``, ``size`` (the
    batch's bytes), ``p50_us``, ``p99_us``, ``gbps`` (size / p50), ``n``, ``verified`` (the bytes read back
    by ``batch_get_into`` equal those ``batch_put_from`` wrote; a mismatch fails the measurement)."""
    def batches() -> list[dict]:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
        if not counts or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts):
            raise ValueError(f"counts must be ints >= 1, got {counts!r}")
        return [{"count": c, "chunk_sizes": [chunk_size] * c} for c in sorted(set(counts))]

    return _measure_batch_list(batches, modes, time_budget_s)


def measure_handoff_batches(blocks: list[int], block_nbytes: int = LLAMA3_8B_BLOCK_BYTES,
                            chunk_blocks: int = HANDOFF_CHUNK_BLOCKS, modes: tuple[str, ...] | list[str] = ("tcp",),
                            time_budget_s: float = TIME_BUDGET_S) -> dict:
    """:func:`measure_batches` in the hand-off's geometry: for each request size in ``blocks``, one batch of
    the chunks ``KVHandoff.publish`` would store (:func:`handoff_chunks`; the last chunk may be smaller).
    Rows also carry ``blocks``; ``chunk_size`` is the largest chunk. Never raises."""
    def batches() -> list[dict]:
        if not blocks:
            raise ValueError("blocks must name at least one request size")
        return [{"blocks": b, "count": len(c), "chunk_sizes": c}
                for b in sorted(set(blocks)) for c in [handoff_chunks(b, block_nbytes, chunk_blocks)]]

    result = _measure_batch_list(batches, modes, time_budget_s)
    result.update(block_nbytes=block_nbytes, chunk_blocks=chunk_blocks)
    return result


def batch_row(result: dict, op: str, *, count: int | None = None, blocks: int | None = None,
              path: str = "mooncake+tcp") -> dict | None:
    """The row of a batch result for ``op`` and ``count`` (measure_batches) or ``blocks``
    (measure_handoff_batches)."""
    for r in result.get("rows", []):
        if (r["op"] == op and r["path"] == path and (count is None or r["count"] == count)
                and (blocks is None or r.get("blocks") == blocks)):
            return r
    return None


def _measure_batch_list(make_batches, modes, time_budget_s: float) -> dict:
    result: dict = {"available": False, "reason": None, "package": None, "rows": [], "modes": list(modes),
                    "batches": [], "loadavg_before": _loadavg()}
    with _never_raises(result):
        try:
            batches = make_batches()
        except ValueError as e:
            result["reason"] = f"bad arguments: {e}"
            return result
        result["batches"] = [{k: v for k, v in b.items() if k != "chunk_sizes"} | {"size": sum(b["chunk_sizes"])}
                             for b in batches]
        if bad := [m for m in modes if m not in PATH_NAME]:
            result["reason"] = f"bad arguments: modes {bad} (known: {sorted(PATH_NAME)})"
            return result
        info = detect()
        result["package"] = info["package"]
        if not info["installed"]:
            result["reason"] = info["reason"]
            return result
        op_budget = (time_budget_s - 5.0 * len(modes)) / (len(BATCH_OPS) * len(batches) * len(modes))
        result["op_budget_s"] = round(max(0.3, min(OP_BUDGET_MAX_S, op_budget)), 2)
        biggest = max(sum(b["chunk_sizes"]) for b in batches)
        # one batch stays stored for the reads while a put batch is in flight; well under the 0.9 watermark
        segment = max(256 << 20, 3 * biggest + (64 << 20))
        details = {}
        for mode in modes:
            data, details[mode] = _run_client(info["master"], mode, segment, "_batch_client",
                                              {"batches": batches, "op_budget_s": result["op_budget_s"],
                                               "local_buffer": 16 << 20})
            result["rows"].extend(_batch_rows(mode, batches, data["rows"]))
        result["details"] = details
        result["available"] = True
    return result


def _batch_rows(mode: str, batches: list[dict], raw: list[dict]) -> list[dict]:
    from benchmarks.common.timing import timing_of

    rows = []
    for r in raw:
        batch = batches[r["batch"]]
        extra = {"blocks": batch["blocks"]} if "blocks" in batch else {}
        rows.append({"path": PATH_NAME[mode], "op": r["op"], "count": batch["count"],
                     "chunk_size": max(batch["chunk_sizes"]), **extra,
                     **timing_of(sum(batch["chunk_sizes"]), r["times_s"]).as_dict(), "verified": r["verified"]})
    return rows


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)


def _loadavg() -> list[float] | None:
    with contextlib.suppress(OSError, AttributeError):
        return [round(x, 2) for x in os.getloadavg()]
    return None


# ---- child processes --------------------------------------------------------------------------------
def _new_store(cfg: dict, segment: int, local_buffer: int):
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(HOST, cfg["metadata"], segment, local_buffer, "tcp", "", cfg["master"])
    if rc != 0:
        raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
    return store


def _holder_main(cfg_path: str) -> int:
    _die_with_parent()
    with open(cfg_path) as f:
        cfg = json.load(f)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    store = _new_store(cfg, cfg["segment"], cfg["local_buffer"])  # keep it referenced: it owns the segment
    print("READY", flush=True)
    while store is not None:
        time.sleep(3600)
    return 0


def _iterations(size: int) -> int:
    return max(MIN_ITERS, min(MAX_ITERS, BUDGET_BYTES // size))


def _timed(fn, n: int, warmup: int, budget_s: float) -> list[float]:
    """Call fn(i) warmup times untimed, then up to n times timed (fn returns its own duration), stopping
    early once budget_s (counted from the first warm-up call) has passed and MIN_ITERS samples are in."""
    stop_at = time.perf_counter() + budget_s
    for i in range(warmup):
        fn(i)
    times: list[float] = []
    for i in range(warmup, warmup + n):
        times.append(fn(i))
        if len(times) >= MIN_ITERS and time.perf_counter() > stop_at:
            break
    return times


def _lo_bytes() -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in open("/proc/net/dev"):
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[0])
    return None


def _client_main(cfg_path: str) -> int:
    _die_with_parent()
    import numpy as np

    with open(cfg_path) as f:
        cfg = json.load(f)
    sizes: list[int] = cfg["sizes"]
    biggest = max(sizes)
    t0 = time.perf_counter()
    store = _new_store(cfg, cfg["client_segment"], cfg["local_buffer"])
    setup_s = time.perf_counter() - t0
    clock = time.perf_counter

    buf = np.empty(2 * biggest, dtype=np.uint8)
    buf[:] = 1  # pre-fault, as kvstore's benchmark does for its destination buffers
    src_ptr, dst_ptr = buf.ctypes.data, buf.ctypes.data + biggest
    rc = store.register_buffer(buf.ctypes.data, buf.nbytes)
    if rc != 0:
        raise RuntimeError(f"register_buffer returned {rc}")
    rows: list[dict] = []
    lo_bytes = None
    try:
        for size in sizes:
            value = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
            buf[:size] = value
            n = _iterations(size)
            warmup = max(3, min(50, n // 10))

            def put_from(i: int, size=size) -> float:
                key = f"bench/put_from/{size}/{i}"
                t = clock()
                r = store.put_from(key, src_ptr, size)
                dt = clock() - t
                if r != 0:
                    raise RuntimeError(f"put_from({size}) returned {r}")
                store.remove(key, True)  # a put to an existing key is a no-op; keep keys fresh, untimed
                return dt

            def put(i: int, size=size, value=value) -> float:
                key = f"bench/put/{size}/{i}"
                t = clock()
                r = store.put(key, value)
                dt = clock() - t
                if r != 0:
                    raise RuntimeError(f"put({size}) returned {r}")
                store.remove(key, True)
                return dt

            key = f"bench/get/{size}"
            if store.put_from(key, src_ptr, size) != 0:
                raise RuntimeError(f"put_from({key}) failed")

            def get_into(i: int, size=size, key=key) -> float:
                t = clock()
                r = store.get_into(key, dst_ptr, size)
                dt = clock() - t
                if r != size:
                    raise RuntimeError(f"get_into({size}) returned {r}")
                return dt

            def get(i: int, size=size, key=key) -> float:
                t = clock()
                v = store.get(key)
                dt = clock() - t
                if len(v) != size:
                    raise RuntimeError(f"get({size}) returned {len(v)} bytes")
                return dt

            for op, fn in (("put_from", put_from), ("put", put), ("get_into", get_into), ("get", get)):
                lo0 = _lo_bytes() if op == "get_into" and size == biggest else None
                times = _timed(fn, n, warmup, cfg["op_budget_s"])
                if lo0 is not None and (lo1 := _lo_bytes()) is not None:
                    lo_bytes = (lo1 - lo0) // (warmup + len(times))
                rows.append({"op": op, "size": size, "times_s": times})
            if not np.array_equal(buf[biggest:biggest + size], value):
                raise RuntimeError(f"get_into returned wrong bytes at size {size}")
            if bytes(store.get(key)) != value.tobytes():
                raise RuntimeError(f"get returned wrong bytes at size {size}")
            store.remove(key, True)
    finally:
        with contextlib.suppress(Exception):
            store.unregister_buffer(buf.ctypes.data)
        with contextlib.suppress(Exception):
            store.close()
    _write_json(cfg["out"], {"rows": rows, "setup_s": round(setup_s, 3), "lo_bytes": lo_bytes})
    return 0


def _batch_client_main(cfg_path: str) -> int:
    _die_with_parent()
    import numpy as np

    with open(cfg_path) as f:
        cfg = json.load(f)
    biggest = max(sum(b["chunk_sizes"]) for b in cfg["batches"])
    t0 = time.perf_counter()
    store = _new_store(cfg, cfg["client_segment"], cfg["local_buffer"])
    setup_s = time.perf_counter() - t0
    buf = np.empty(2 * biggest, dtype=np.uint8)  # [0, biggest): the chunks put; [biggest, 2 biggest): read into
    buf[:] = 1  # pre-fault
    if (rc := store.register_buffer(buf.ctypes.data, buf.nbytes)) != 0:
        raise RuntimeError(f"register_buffer returned {rc}")
    rows: list[dict] = []
    try:
        for k, batch in enumerate(cfg["batches"]):
            rows += _time_batch(store, buf, biggest, k, batch["chunk_sizes"], cfg["op_budget_s"])
    finally:
        with contextlib.suppress(Exception):
            store.unregister_buffer(buf.ctypes.data)
        with contextlib.suppress(Exception):
            store.close()
    _write_json(cfg["out"], {"rows": rows, "setup_s": round(setup_s, 3)})
    return 0


def _time_batch(store, buf, half: int, k: int, sizes: list[int], budget_s: float) -> list[dict]:
    """Time one batch's batch_put_from (fresh keys, removed untimed) and batch_get_into; check the bytes."""
    import numpy as np

    total, clock = sum(sizes), time.perf_counter
    offsets = [sum(sizes[:j]) for j in range(len(sizes))]
    src = [buf.ctypes.data + o for o in offsets]
    dst = [buf.ctypes.data + half + o for o in offsets]
    value = np.random.default_rng(k).integers(0, 256, total, dtype=np.uint8)
    buf[:total] = value
    buf[half:half + total] = 0  # so that the check below sees what batch_get_into wrote

    def put_from(i: int) -> float:
        keys = [f"batch/{k}/put/{i}/{j}" for j in range(len(sizes))]
        t = clock()
        res = store.batch_put_from(keys, src, sizes)
        dt = clock() - t
        if any(r != 0 for r in res):
            raise RuntimeError(f"batch_put_from of {len(sizes)} chunks returned {list(res)}")
        # a put to an existing key does nothing, so every round puts fresh keys and drops them untimed
        if any(r != 0 for r in store.batch_remove(keys, True)):
            raise RuntimeError(f"batch_remove of {len(sizes)} chunks failed")
        return dt

    get_keys = [f"batch/{k}/get/{j}" for j in range(len(sizes))]
    res = store.batch_put_from(get_keys, src, sizes)
    if any(r != 0 for r in res):
        raise RuntimeError(f"batch_put_from of the read batch returned {list(res)}")

    def get_into(i: int) -> float:
        t = clock()
        res = store.batch_get_into(get_keys, dst, sizes)
        dt = clock() - t
        if list(res) != sizes:
            raise RuntimeError(f"batch_get_into of {len(sizes)} chunks returned {list(res)}, expected {sizes}")
        return dt

    n = _iterations(total)
    warmup = max(3, min(50, n // 10))
    rows = [{"batch": k, "op": op, "times_s": _timed(fn, n, warmup, budget_s)}
            for op, fn in (("batch_put_from", put_from), ("batch_get_into", get_into))]
    if not np.array_equal(buf[half:half + total], value):
        raise RuntimeError(f"batch_get_into returned wrong bytes for batch {k} ({len(sizes)} chunks)")
    store.batch_remove(get_keys, True)
    return [{**r, "verified": True} for r in rows]


# ---- command line -----------------------------------------------------------------------------------
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"bad size {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: int) -> str:
    for unit, mult in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return f"{n}B"


def print_table(result: dict) -> None:
    print(f"# Mooncake Store baseline — {result.get('package') or 'mooncake'}; "
          f"load avg {result.get('loadavg_before')} -> {result.get('loadavg_after')}; {result.get('total_s')} s")
    if not result["available"]:
        print(f"not measured: {result['reason']}")
        return
    from benchmarks.common.table import Column, format_table

    batch = "batches" in result
    key = ([Column("blocks", ">6", "blocks")] if batch and "block_nbytes" in result else []) + (
        [Column("chunks", ">6", "count"), Column("chunk", ">7", lambda r: format_size(r["chunk_size"]))]
        if batch else [])
    print(format_table([Column("path", "<15", "path"), Column("op", "<14" if batch else "<9", "op"), *key,
                        Column("size", ">7", lambda r: format_size(r["size"])), Column("p50 us", ">10.1f", "p50_us"),
                        Column("p99 us", ">10.1f", "p99_us"), Column("GB/s", ">7.2f", "gbps"),
                        Column("n", ">5", "n")], result["rows"]))
    for mode, d in result.get("details", {}).items():
        loopback = "" if batch else (", loopback bytes per get_into of the largest size "
                                     f"{d['loopback_bytes_per_get_into']}")
        print(f"# {mode}: startup {d['startup_s']} s, client setup {d['client_setup_s']} s{loopback}")
    if batch:
        print("# bytes read back by batch_get_into checked against those written: "
              + ("equal" if all(r["verified"] for r in result["rows"]) else "NOT CHECKED"))


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_exec"]:  # run a binary (mooncake_master) with the parent-death signal armed
        _die_with_parent()
        os.execv(argv[1], argv[1:])
    children = {"_holder": _holder_main, "_client": _client_main, "_batch_client": _batch_client_main}
    if argv[:1] and argv[0] in children:
        return children[argv[0]](argv[1])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="4KiB,1MiB,16MiB", help="comma-separated sizes (default %(default)s)")
    parser.add_argument("--modes", default="tcp", help="comma-separated: tcp, local (default %(default)s)")
    parser.add_argument("--batch", metavar="CHUNK_SIZE", type=parse_size,
                        help="time batch_put_from/batch_get_into of --counts chunks of this size instead")
    parser.add_argument("--counts", type=_int_list, default=[1, 16, 64],
                        help="chunks per batch with --batch (default 1,16,64)")
    parser.add_argument("--handoff-blocks", metavar="BLOCKS", type=_int_list,
                        help="time batches in the hand-off's chunks for requests of these block counts instead")
    parser.add_argument("--block-bytes", type=parse_size, default=LLAMA3_8B_BLOCK_BYTES,
                        help="bytes a block with --handoff-blocks (default 2MiB: Llama-3-8B, block 16)")
    parser.add_argument("--chunk-blocks", type=int, default=HANDOFF_CHUNK_BLOCKS,
                        help="blocks a chunk with --handoff-blocks (default %(default)s, KVHandoff's)")
    parser.add_argument("--time-budget", type=float, default=TIME_BUDGET_S,
                        help="seconds for all timed loops together (default %(default)s)")
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    args = parser.parse_args(argv)
    modes = tuple(args.modes.split(","))
    if args.batch is not None and args.handoff_blocks is not None:
        parser.error("--batch and --handoff-blocks are alternatives")
    if args.batch is not None:
        result = measure_batches(args.batch, args.counts, modes, args.time_budget)
    elif args.handoff_blocks is not None:
        result = measure_handoff_batches(args.handoff_blocks, args.block_bytes, args.chunk_blocks, modes,
                                         args.time_budget)
    else:
        result = measure([parse_size(s) for s in args.sizes.split(",")], modes, args.time_budget)
    print_table(result)
    if args.json:
        _write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
