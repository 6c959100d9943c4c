"""Mooncake Store measured on this machine, in this run: the baseline kvstore's store benchmark is
compared against.

    python benchmarks/mooncake_baseline.py [--sizes 4KiB,1MiB,16MiB] [--modes tcp,local] [--json PATH]
    python -m benchmarks.mooncake_baseline ...

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
def measure(sizes: list[int] | None = None, modes: tuple[str, ...] | list[str] = ("tcp",),
            time_budget_s: float = TIME_BUDGET_S) -> dict:
    """Mooncake Store timings for each size and mode (``tcp``: client and segment in two processes;
    ``local``: one process). Never raises: ``available`` is False and ``reason`` says why when it
    could not run. Rows have the keys of ``benchmarks.common.timing.Timing.as_dict`` plus ``path``/``op``."""
    sizes = sorted(set(int(s) for s in (sizes or DEFAULT_SIZES)))
    t_start = time.monotonic()
    result: dict = {"available": False, "reason": None, "package": None, "rows": [], "modes": list(modes),
                    "sizes": sizes, "loadavg_before": _loadavg()}
    try:
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
    except Exception as e:  # a baseline must never take the caller's benchmark down
        result["available"] = False
        result["reason"] = f"{type(e).__name__}: {e}"
    finally:
        result["loadavg_after"] = _loadavg()
        result["total_s"] = round(time.monotonic() - t_start, 2)
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
            client_cfg, out = os.path.join(workdir, "client.json"), os.path.join(workdir, "out.json")
            _write_json(client_cfg, {**common, "sizes": sizes, "out": out, "op_budget_s": op_budget,
                                     "client_segment": segment if mode == "local" else 0,
                                     "local_buffer": 2 * biggest + (16 << 20)})
            startup_s = time.monotonic() - t0
            client = procs.start("client", [sys.executable, os.path.abspath(__file__), "_client", client_cfg],
                                 env)
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
    # the client (a script, without the project on its path) reports raw times; statistics are made here
    from benchmarks.common.timing import timing_of

    rows = [{"path": PATH_NAME[mode], "op": r["op"], **timing_of(r["size"], r["times_s"]).as_dict()}
            for r in data["rows"]]
    detail = {"master_argv": master_argv, "startup_s": round(startup_s, 2), "segment_bytes": segment,
              "mc_env": {k: v for k, v in _child_env().items() if k.startswith("MC_")},
              "client_setup_s": data.get("setup_s"), "loopback_bytes_per_get_into": data.get("lo_bytes")}
    return rows, detail


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

    print(format_table([Column("path", "<15", "path"), Column("op", "<9", "op"),
                        Column("size", ">7", lambda r: format_size(r["size"])), Column("p50 us", ">10.1f", "p50_us"),
                        Column("p99 us", ">10.1f", "p99_us"), Column("GB/s", ">7.2f", "gbps"),
                        Column("n", ">5", "n")], result["rows"]))
    for mode, d in result.get("details", {}).items():
        print(f"# {mode}: startup {d['startup_s']} s, client setup {d['client_setup_s']} s, "
              f"loopback bytes per get_into of the largest size {d['loopback_bytes_per_get_into']}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_exec"]:  # run a binary (mooncake_master) with the parent-death signal armed
        _die_with_parent()
        os.execv(argv[1], argv[1:])
    if argv[:1] == ["_holder"]:
        return _holder_main(argv[1])
    if argv[:1] == ["_client"]:
        return _client_main(argv[1])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="4KiB,1MiB,16MiB", help="comma-separated sizes (default %(default)s)")
    parser.add_argument("--modes", default="tcp", help="comma-separated: tcp, local (default %(default)s)")
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    args = parser.parse_args(argv)
    result = measure([parse_size(s) for s in args.sizes.split(",")], tuple(args.modes.split(",")))
    print_table(result)
    if args.json:
        _write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
