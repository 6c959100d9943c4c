"""``kvstore pd up``: a local prefill/decode fleet in one command — a ``kvstore serve`` daemon, vLLM OpenAI
servers with the kvstore connector (prefill: kv_producer, decode: kv_consumer, colocated: kv_both) and
``kvstore router`` in front of them. Ctrl-C (or SIGTERM) stops everything it started."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile

from kvstore.cli import router as router_cli


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="pd_command", required=True)
    up = sub.add_parser("up", help="start a daemon, vLLM instances and the router; Ctrl-C stops them all",
                        description=__doc__)
    up.add_argument("--model", required=True, metavar="DIR", help="the model every instance serves")
    up.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill instances (default %(default)s)")
    up.add_argument("--decode", type=int, default=1, metavar="N", help="decode instances (default %(default)s)")
    up.add_argument("--colocated", type=int, default=0, metavar="N",
                    help="colocated (kv_both) instances, the fallback pool (default %(default)s)")
    up.add_argument("--base-port", type=int, default=8100, metavar="PORT",
                    help="instances listen on PORT, PORT+1, … in the order prefill, decode, colocated "
                         "(default %(default)s)")
    up.add_argument("--store", metavar="URL", help="use this running daemon instead of starting one")
    up.add_argument("--store-capacity", default="4GiB", metavar="SIZE", help="the daemon's (default %(default)s)")
    up.add_argument("--block-size", type=int, default=128, metavar="TOKENS",
                    help="the instances' KV block size (default %(default)s, vLLM-CPU's)")
    up.add_argument("--vllm-args", default="", metavar="ARGS",
                    help="more arguments for every vLLM server, one shell-quoted string "
                         "(e.g. \"--max-model-len 4096 --kv-cache-memory-bytes 1073741824\")")
    up.add_argument("--connector", default="{}", metavar="JSON",
                    help="more kv_connector_extra_config entries, e.g. '{\"transport\": \"tcp\"}'")
    up.add_argument("--start-timeout", type=float, default=600.0, metavar="S",
                    help="how long the instances may take to start (default %(default)s)")
    up.add_argument("--workdir", help="logs and the daemon's socket (default: a new /tmp/kvstore-pd-* directory)")
    router_cli.add_policy_arguments(up)
    up.set_defaults(handler=up_fleet)


def up_fleet(args: argparse.Namespace) -> int:
    import json

    from kvstore.router.fleet import Fleet, project_env, vllm_command, wait_http

    if min(args.prefill, args.decode, args.colocated) < 0 or not (args.decode or args.colocated):
        raise ValueError("pd up needs --decode N >= 1 (with --prefill N >= 1) or --colocated N >= 1")
    workdir = args.workdir or tempfile.mkdtemp(prefix="kvstore-pd-")
    extra = json.loads(args.connector)
    vllm_args = ("--block-size", str(args.block_size), *shlex.split(args.vllm_args))
    with Fleet(workdir, project_env()) as fleet:
        store = args.store or fleet.daemon(os.path.join(workdir, "kvstore.sock"), args.store_capacity)
        pools: dict[str, list[str]] = {"prefill": [], "decode": [], "colocated": []}
        started = []
        for pool, role in (("prefill", "kv_producer"), ("decode", "kv_consumer"), ("colocated", "kv_both")):
            for i in range(getattr(args, pool)):
                port = args.base_port + len(started)
                child = fleet.start(f"{pool}-{i}", vllm_command(args.model, port, role, store,
                                                                connector_extra=extra, args=vllm_args))
                pools[pool].append(f"http://127.0.0.1:{port}")
                started.append((child, pools[pool][-1]))
        print(f"kvstore pd: daemon {store}; logs in {workdir}; starting {len(started)} vLLM instance(s)",
              file=sys.stderr, flush=True)
        for child, url in started:
            wait_http(child, url + "/health", args.start_timeout)
            print(f"kvstore pd: {child.name} ready at {url}", file=sys.stderr, flush=True)
        config = router_cli.config_from(args, store=store, **{k: tuple(v) for k, v in pools.items()})
        print(f"kvstore pd: router on http://{config.host}:{config.port} (Ctrl-C stops everything)",
              file=sys.stderr, flush=True)
        return router_cli.run(args, config)
