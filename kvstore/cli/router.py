"""``kvstore router``: the OpenAI front door of a prefill/decode fleet (docs/router.md)."""

from __future__ import annotations

import argparse
import logging

#: The budgets when neither an option nor a --plan file gives them.
SLO_TTFT_S, SLO_TPOT_S = 2.0, 0.2


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", action="append", default=[], metavar="URL",
                   help="a prefill instance (vLLM OpenAI server, kv_producer), e.g. http://127.0.0.1:8100; repeatable")
    p.add_argument("--decode", action="append", default=[], metavar="URL",
                   help="a decode instance (kv_consumer); repeatable")
    p.add_argument("--colocated", action="append", default=[], metavar="URL",
                   help="an instance that serves whole requests (used when no prefill/decode pair can, or "
                        "when the store is down); repeatable")
    p.add_argument("--store", metavar="URL", help="the kvstore daemon the instances share: checked, and "
                   "requests are served colocated while it does not answer")
    p.add_argument("--block-size", type=int, default=16, metavar="TOKENS",
                   help="the instances' KV block size, for the default threshold (default %(default)s)")
    p.add_argument("--plan", metavar="PATH",
                   help="a `kvstore plan --search --router-config PATH` file: its SLO budgets (unless --slo-ttft/"
                        "--slo-tpot are given) and its skip-the-prefill-pool rule (unless --skip-prefill-below is)")
    add_policy_arguments(p)


def add_policy_arguments(p: argparse.ArgumentParser) -> None:
    """The router's options beyond its pools (shared with ``kvstore pd up``)."""
    p.add_argument("--listen", default="127.0.0.1:8000", metavar="HOST:PORT", help="default %(default)s")
    p.add_argument("--admission", default="none", choices=["none", "budget"],
                   help="none: least outstanding tokens at once; budget: two queues held against the TTFT and "
                        "TPOT budgets, 429 + Retry-After when they cannot be met (default %(default)s)")
    p.add_argument("--slo-ttft", type=float, metavar="S", help=f"TTFT budget (default {SLO_TTFT_S}, or --plan's)")
    p.add_argument("--slo-tpot", type=float, metavar="S", help=f"TPOT budget (default {SLO_TPOT_S}, or --plan's)")
    p.add_argument("--skip-prefill-below", type=int, metavar="TOKENS",
                   help="prompts shorter than this go straight to decode (default: --plan's rule, else computed "
                        "from the measured prefill cost and hop overhead, at least one block + 1)")
    p.add_argument("--skip-prefill-hit", type=float, metavar="FRACTION",
                   help="with --store: prompts of which the store already holds this share (leading blocks) go "
                        "straight to decode, which loads them (default: --plan's rule, else when the tokens the "
                        "store lacks are fewer than the short-prompt threshold)")
    p.add_argument("--prefill-timeout", type=float, default=120.0, metavar="S", help="default %(default)s")
    p.add_argument("--decode-timeout", type=float, default=900.0, metavar="S", help="default %(default)s")
    p.add_argument("--idle-timeout", type=float, default=120.0, metavar="S",
                   help="longest silence of an instance within a hop (default %(default)s)")
    p.add_argument("--health-interval", type=float, default=2.0, metavar="S", help="default %(default)s")
    p.add_argument("--connect-timeout", type=float, default=5.0, metavar="S", help="default %(default)s")
    p.add_argument("--eject-after", type=int, default=2, metavar="N",
                   help="consecutive failures (hops or health checks) that eject an instance (default %(default)s)")
    p.add_argument("--prefill-attempts", type=int, default=2, metavar="N",
                   help="prefill instances tried for one request before it is served by decode alone "
                        "(default %(default)s)")
    p.add_argument("--background-max-wait", type=float, metavar="S",
                   help="with --admission budget: longest a background request waits for slack before 429 "
                        "(default 10 x --slo-ttft)")
    p.add_argument("--max-queue", type=int, default=1024, metavar="N",
                   help="requests waiting in one admission queue beyond which new ones get 429 at once "
                        "(default %(default)s)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def config_from(args: argparse.Namespace, prefill=None, decode=None, colocated=None, store=None):
    """The RouterConfig of the parsed options; pools and store given explicitly override them."""
    from kvstore.router.config import AdmissionKind, RouterConfig, parse_listen

    host, port = parse_listen(args.listen)
    plan = None
    if getattr(args, "plan", None):
        from kvstore.router.plan import load_plan

        plan = load_plan(args.plan)
    ttft = args.slo_ttft if args.slo_ttft is not None else plan.slo_ttft_s if plan else SLO_TTFT_S
    tpot = args.slo_tpot if args.slo_tpot is not None else plan.slo_tpot_s if plan else SLO_TPOT_S
    pools = {"prefill": prefill, "decode": decode, "colocated": colocated}
    pools = {k: tuple(v if v is not None else getattr(args, k)) for k, v in pools.items()}
    return RouterConfig(**pools, store=store or getattr(args, "store", None), host=host, port=port,
                        admission=AdmissionKind(args.admission),
                        slo_ttft_s=ttft, slo_tpot_s=tpot, skip_prefill_below=args.skip_prefill_below, plan=plan,
                        skip_prefill_hit=args.skip_prefill_hit,
                        prefill_timeout_s=args.prefill_timeout, decode_timeout_s=args.decode_timeout,
                        idle_timeout_s=args.idle_timeout, health_interval_s=args.health_interval,
                        connect_timeout_s=args.connect_timeout, eject_after=args.eject_after,
                        prefill_attempts=args.prefill_attempts, background_max_wait_s=args.background_max_wait,
                        max_queue=args.max_queue)


def run(args: argparse.Namespace, config=None) -> int:
    """Serve until SIGINT/SIGTERM."""
    try:
        from kvstore.router.router import Router
        from kvstore.router.server import run as run_router
    except ImportError as exc:
        raise ValueError(f"kvstore router needs the router extra (pip install -e '.[router]'): {exc}") from None
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = config or config_from(args)
    _check_pool_sizes(config)
    return run_router(config, Router(config, block_tokens=args.block_size))


def _check_pool_sizes(config) -> None:
    """The plan's rule and budgets assume its pool sizes: say so when the instances given differ."""
    plan = config.plan
    if plan is None:
        return
    for pool, planned in (("prefill", plan.prefill), ("decode", plan.decode)):
        given = len(getattr(config, pool))
        if planned is not None and given != planned:
            logging.getLogger("kvstore.router").warning(
                "--plan %s sized the %s pool at %d instance(s); %d given", plan.path, pool, planned, given)
