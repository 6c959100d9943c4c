"""The ``kvstore`` command: ``serve`` the daemon, and inspect or edit a running one."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import unicodedata
from collections.abc import Callable

from kvstore.errors import InvalidArgumentError, KVStoreError
from kvstore.protocol.credentials import read_token_file
from kvstore.protocol.url import default_socket_url, default_url
from kvstore.units import format_size, parse_size

DEFAULT_URL = default_url()


def _serve(args: argparse.Namespace) -> int:
    from kvstore.daemon.server import ServerConfig, run

    token = read_token_file(args.token_file) if args.token_file else None
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = ServerConfig(listen=tuple(args.listen or [default_socket_url()]), capacity=parse_size(args.capacity),
                          metrics_port=args.metrics_port, token=token, insecure=args.insecure,
                          high_watermark=args.high_watermark, low_watermark=args.low_watermark,
                          relocate=not args.no_relocate, heartbeat_timeout=args.heartbeat_timeout,
                          gpu_capacity=parse_size(args.gpu_capacity),
                          device=args.device, disk=_disk_config(args), exit_with=args.exit_with,
                          **_limit_options(args))
    if args.cluster:
        from kvstore.cli.cluster import serve as serve_cluster

        return serve_cluster(args, config)
    return run(config)


def _limit_options(args: argparse.Namespace) -> dict:
    """The per-client limits, connection caps and deadlines of ``serve``, as ServerConfig fields."""
    return {"max_pending_bytes": parse_size(args.max_pending_bytes) if args.max_pending_bytes else None,
            "max_held_bytes": parse_size(args.max_held_bytes) if args.max_held_bytes else None,
            "max_leases": args.max_leases, "max_connections": args.max_connections,
            "arena_bytes": parse_size(args.arena_size) if args.arena_size else None,
            "max_connections_per_peer": args.max_connections_per_peer, "auth_timeout": args.auth_timeout,
            "transfer_timeout": args.transfer_timeout, "max_frame": parse_size(args.max_frame)}


def _add_limit_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("limits", "what one client or connection may hold (docs/security.md)")
    g.add_argument("--max-pending-bytes", metavar="SIZE",
                   help="uncommitted put bytes per client (and per process, all its connections together) "
                        "that may evict committed data; past it a put may only use free space, else it is refused "
                        "with QuotaExceededError (default: half the capacity)")
    g.add_argument("--max-held-bytes", metavar="SIZE",
                   help="segment bytes per client (and per process) in pending puts and leases together "
                        "(one object of any size is always allowed); also the most a paused, revoked same-host "
                        "client can keep quarantined (default: three quarters of the capacity)")
    g.add_argument("--arena-size", metavar="SIZE",
                   help="segment space granted at a time to a same-host client, which allocates its puts from it "
                        "itself (one round trip a put); counted in its pending bytes (default: min(64MiB, "
                        "capacity/16))")
    g.add_argument("--max-leases", type=int, default=16384, metavar="N",
                   help="leases one client (and one process, all its connections together) may hold at once "
                        "(default %(default)s)")
    g.add_argument("--max-connections", type=int, default=1024, metavar="N",
                   help="connections kept open in all; more are closed at accept (default %(default)s)")
    g.add_argument("--max-connections-per-peer", type=int, default=256, metavar="N",
                   help="connections kept open per peer: a Unix-socket user or a TCP address (default %(default)s)")
    g.add_argument("--max-frame", default="1MiB", metavar="SIZE",
                   help="the largest message a connection sends or takes, 256KiB to 1MiB: a connection's buffer "
                        "is this large; listings are paged to fit, a larger reply is refused on its request "
                        "(FrameTooLargeError) and clients size their requests by it (default %(default)s)")
    g.add_argument("--auth-timeout", type=float, default=5.0, metavar="S",
                   help="close a connection that has not said hello within S seconds (default %(default)s)")
    g.add_argument("--transfer-timeout", type=float, default=30.0, metavar="S",
                   help="cut a connection whose payload transfer (a stream put or get) moves no byte for S "
                        "seconds, freeing its reservation or lease (default %(default)s)")


def _disk_config(args: argparse.Namespace):
    if args.disk_path is None:
        if args.disk_capacity is not None:
            raise KVStoreError("--disk-capacity needs --disk-path")
        return None
    from kvstore.memory.disk import DiskConfig

    if args.disk_capacity is None:
        raise KVStoreError("--disk-path needs --disk-capacity (e.g. 200GiB)")
    # stall_s: an eviction runs on the daemon's loop, so it never waits for a writer that is a whole staging
    # area behind (a slow disk): the object is dropped from the disk tier (counted: disk_behind) rather than
    # stall every client's requests
    return DiskConfig(args.disk_path, parse_size(args.disk_capacity), args.disk_policy, args.disk_promote_after,
                      stall_s=0.0)


def _client(args: argparse.Namespace):
    from kvstore.api import connect

    token = read_token_file(args.token_file) if getattr(args, "token_file", None) else None
    return connect(args.url, timeout=args.timeout, token=token, transport=args.transport, client_name="kvstore-cli")


def _stats(args: argparse.Namespace) -> int:
    with _client(args) as store:
        stats = store.stats()
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
        return 0
    used, cap = stats["used_bytes"], stats["capacity_bytes"]
    print(f"capacity      {format_size(cap)}\nused          {format_size(used)} ({100 * used / max(cap, 1):.1f} %)")
    for name in ("objects", "pending", "leases", "pinned_objects", "evictions", "expirations", "clients",
                 "fragmentation", "relocations", "refusals"):
        print(f"{name:<14}{stats.get(name, '-')}")  # a cluster client's totals lack the per-daemon ones
    if "disk_capacity_bytes" in stats:
        dused, dcap = stats["disk_used_bytes"], stats["disk_capacity_bytes"]
        print(f"disk tier     {stats['disk_path']} ({stats['disk_policy']})\n"
              f"disk used     {format_size(dused)} of {format_size(dcap)} ({100 * dused / max(dcap, 1):.1f} %)")
        for name in ("disk_objects", "demotions", "promotions", "disk_reads", "disk_errors", "disk_dropped"):
            print(f"{name:<14}{stats[name]}")
    for conn in stats.get("connections", []):  # names are the clients' own: shown escaped
        print(f"client        {printable(conn['client'])} via {conn['transport']} ({printable(conn['peer'])})")
    cluster = stats.get("cluster") or {}
    if cluster:
        print(f"cluster node  {cluster.get('node') or cluster.get('home')}; members "
              f"{', '.join(printable(m) for m in cluster.get('members', []))}")
    for node, why in sorted(cluster.get("refused", {}).items()):  # another token, or not the node it claims
        print(f"REFUSED peer  {printable(node)}: {printable(why)}")
    return 0


def printable(key: str) -> str:
    """``key`` safe for a terminal: control and format characters (escape sequences, a newline that forges
    another line, bidi overrides) and the backslash written as Python escapes; the rest as is."""
    out = []
    for ch in key:
        if ch == "\\":
            out.append("\\\\")
        elif unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Zl", "Zp"):
            out.append(ascii(ch)[1:-1])  # \n, \x1b, \u202e
        else:
            out.append(ch)
    return "".join(out)


def _ls(args: argparse.Namespace) -> int:
    with _client(args) as store:
        for key in store.keys(args.prefix):
            print(printable(key))
    return 0


def _inspect(args: argparse.Namespace) -> int:
    with _client(args) as store:
        info = store.inspect(args.key)
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True))
    else:
        for name, value in info.items():  # the key, producer and metadata are any client's: shown escaped
            print(f"{name:<18}{printable(str(value))}")
    return 0


def _put(args: argparse.Namespace) -> int:
    with open(args.file, "rb") as f:
        data = f.read()
    with _client(args) as store:
        meta = store.put(args.key, data, ttl=args.ttl)
    print(f"stored {args.key} ({format_size(meta.size)}, xxh3 {meta.checksum:016x})")
    return 0


def _get(args: argparse.Namespace) -> int:
    with _client(args) as store:
        obj = store.get(args.key, verify=True)
        data = bytes(obj)
    if args.file == "-":
        _write_stdout(data)
    else:
        with open(args.file, "wb") as f:
            f.write(data)
    return 0


def _write_stdout(data: bytes) -> None:
    if sys.stdout is None:  # started with stdout closed
        raise InvalidArgumentError("stdout is closed; name a file to write the bytes to")
    try:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    except BrokenPipeError:
        # the reader went away: say so once, and keep the interpreter's own flush at exit from failing again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise InvalidArgumentError("stdout was closed before all the bytes were written") from None


def _rm(args: argparse.Namespace) -> int:
    with _client(args) as store:
        removed = store.remove(args.key)
    if not removed:
        print(f"{printable(args.key)}: not found", file=sys.stderr)
        return 1
    return 0


def _requests(args: argparse.Namespace) -> int:
    from kvstore.handoff_status import list_requests  # without torch: the listing starts at once

    with _client(args) as store:
        records = list_requests(store)
    if args.json:
        print(json.dumps(records, indent=2, sort_keys=True))
        return 0
    print(f"{'request':<24} {'state':<11} {'bytes':>10} {'chunks':>6} {'tokens':>7} {'age s':>8}  layout")
    for r in sorted(records, key=lambda r: r["created"]):
        # a record is any client's bytes (kvstore.handoff_status.parse_status): shown escaped
        what = f"{r['model_id']} {r['layout']} {r['fingerprint'][:12]}" if r["state"] != "invalid" else r["error"]
        print(f"{printable(r['request_id'][:24]):<24} {r['state']:<11} {format_size(r['bytes']):>10} {r['chunks']:>6} "
              f"{r['num_tokens']:>7} {r['age_s']:>8.1f}  {printable(what)}")
    return 0


def _client_parser(sub, name: str, help_text: str, handler: Callable[[argparse.Namespace], int]):
    p = sub.add_parser(name, help=help_text, description=help_text)
    p.add_argument("--url", default=DEFAULT_URL, help="daemon address (default %(default)s; env KVSTORE_URL)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per call (default %(default)s)")
    p.add_argument("--transport", default="auto", choices=["auto", "shm", "tcp", "ucx"], help="data path")
    p.add_argument("--token-file", help="file holding the daemon's token (mode 0600; default $KVSTORE_TOKEN_FILE)")
    p.set_defaults(handler=handler)
    return p


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with ``command`` (the subcommand about to run), the planner's options (numpy
    and the planner's modules: up to a quarter of a second) are only set up when that command is ``plan``."""
    parser = argparse.ArgumentParser(prog="kvstore", description="KV-cache store for LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the daemon", description="Run the kvstore daemon until SIGTERM/SIGINT.")
    p.add_argument("--listen", action="append", metavar="URL",
                   help="unix:///path or tcp://host:port (control and data), or ucx://host:port (the UCX data "
                        "endpoint; needs ucxx; clients choose it with transport='ucx'); repeatable "
                        f"(default {default_socket_url()}: $XDG_RUNTIME_DIR, else a 0700 /tmp/kvstore-UID)")
    p.add_argument("--capacity", default="1GiB", help="host memory for objects, e.g. 8GiB (default %(default)s)")
    p.add_argument("--gpu-capacity", default="0", metavar="SIZE",
                   help="GPU memory for objects put from CUDA tensors, e.g. 8GiB: same-host clients reach it by "
                        "CUDA IPC (transport cuda_ipc); needs a CUDA GPU (default 0: none)")
    p.add_argument("--device", type=int, metavar="N", help="CUDA device of --gpu-capacity (default 0)")
    p.add_argument("--disk-path", metavar="DIR", help="a disk tier in this directory: objects evicted from memory "
                   "go there (an existing, writable directory, one daemon at a time)")
    p.add_argument("--disk-capacity", metavar="SIZE", help="bytes the disk tier may use, e.g. 200GiB")
    p.add_argument("--disk-policy", default="demote", choices=["demote", "write-through"],
                   help="demote: write objects when memory evicts them; write-through: also at every commit, "
                   "so they survive a restart (default %(default)s)")
    p.add_argument("--disk-promote-after", type=int, default=2, metavar="N",
                   help="the N-th read of a disk object copies it back into memory (default %(default)s)")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on 127.0.0.1:PORT")
    p.add_argument("--token-file", help="require the token in this file (mode 0600) from every client; needed "
                   "for tcp:// and ucx:// listeners")
    p.add_argument("--insecure", action="store_true", help="allow tcp:// and ucx:// listeners without a token "
                   "(logs a warning: any local user can then read and write every object)")
    p.add_argument("--high-watermark", type=float, default=0.9, help="start evicting above this fill fraction")
    p.add_argument("--low-watermark", type=float, default=0.8, help="evict down to this fill fraction")
    p.add_argument("--no-relocate", action="store_true", help="never move objects to join free space (evict "
                   "instead; the allocator's own fill, as a baseline)")
    p.add_argument("--heartbeat-timeout", type=float, default=30.0,
                   help="drop a client silent this many seconds (default %(default)s)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--exit-with", type=int, metavar="PID",
                   help="stop gracefully (as on SIGTERM) when process PID exits: a daemon started by a supervisor, "
                        "a serving process or a test run never outlives it")
    _add_limit_arguments(p)
    from kvstore.cli.cluster import add_serve_arguments

    add_serve_arguments(p)
    p.set_defaults(handler=_serve)

    p = _client_parser(sub, "stats", "show the daemon's capacity, usage and clients", _stats)
    p.add_argument("--json", action="store_true", help="print JSON")
    p = _client_parser(sub, "ls", "list keys", _ls)
    p.add_argument("prefix", nargs="?", default="", help="only keys starting with this")
    p = _client_parser(sub, "inspect", "show one object's size, dtype/shape, checksum, state, leases, age, TTL, "
                       "segment and offset", _inspect)
    p.add_argument("key")
    p.add_argument("--json", action="store_true", help="print JSON")
    p = _client_parser(sub, "put", "store a file's bytes under KEY", _put)
    p.add_argument("key")
    p.add_argument("file")
    p.add_argument("--ttl", type=float, help="expire after this many seconds")
    p = _client_parser(sub, "get", "write KEY's bytes to FILE ('-' for stdout), checksum verified", _get)
    p.add_argument("key")
    p.add_argument("file")
    p = _client_parser(sub, "rm", "remove KEY (exit 1 if absent)", _rm)
    p.add_argument("key")
    p = _client_parser(sub, "requests", "list prefill->decode hand-offs: published / publishing / fetched / "
                       "cancelled / aborted / expired, bytes, chunks, layout, age", _requests)
    p.add_argument("--json", action="store_true", help="print JSON")
    _add_optional_commands(sub, planner=command in (None, "plan"))
    return parser


def _add_optional_commands(sub, planner: bool = True) -> None:
    """Commands whose modules may be absent in a trimmed install. ``planner=False``: ``plan`` is listed but
    its options are not set up (another command runs)."""
    from kvstore.cli import router as router_cli

    p = sub.add_parser("router", help="serve the OpenAI API in front of prefill/decode/colocated vLLM servers",
                       description="The front door of a prefill/decode fleet (docs/router.md).")
    router_cli.add_arguments(p)
    p.set_defaults(handler=router_cli.run)
    from kvstore.cli import pd as pd_cli

    p = sub.add_parser("pd", help="a local prefill/decode fleet: `kvstore pd up --model DIR` (Ctrl-C stops it)",
                       description="A local prefill/decode fleet behind kvstore router.")
    pd_cli.add_arguments(p)
    if not planner:
        sub.add_parser("plan", help="simulate the three deployments on hardware this machine does not have")
        return
    try:
        from kvstore.planner import cli as planner_cli
    except ImportError:
        return
    p = sub.add_parser("plan", help="simulate the three deployments on hardware this machine does not have",
                       description="Discrete-event planner: colocated vs chunked vs disaggregated.")
    planner_cli.add_arguments(p)
    p.set_defaults(handler=planner_cli.run)


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    command = given[0] if given and not given[0].startswith("-") else None
    args = build_parser(command).parse_args(argv)
    try:
        return args.handler(args)
    except KVStoreError as exc:
        print(f"kvstore {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"kvstore {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
