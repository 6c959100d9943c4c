"""The ``compare --engine vllm`` options and their configuration (cli.py stays the small engine's)."""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.pd.deployment import Arch
from benchmarks.pd.fault import FaultSpec
from benchmarks.pd.make_model import LlamaShape, make_model
from benchmarks.pd.vllm_compare import VllmCompareConfig
from benchmarks.pd.vllm_deployment import VllmConfig
from kvstore.units import parse_size
from kvstore.workloads.slo import SLO


def add_vllm_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--engine vllm")
    g.add_argument("--max-model-len", type=int, default=4096, help="tokens per request (prompt + output)")
    g.add_argument("--kv-cache-size", default="256MiB", help="KV cache per vLLM instance")
    g.add_argument("--store-capacity", default="2GiB",
                   help="memory of the run's kvstore daemon (it populates every page at start)")
    g.add_argument("--vllm-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    g.add_argument("--cores", default="0,1", help="the two cores the two instances are bound to")
    g.add_argument("--start-timeout", type=float, default=900.0, metavar="S",
                   help="how long a vLLM instance may take to start (default %(default)s; minutes on a loaded machine)")
    g.add_argument("--via", choices=["router", "inprocess"], default="router",
                   help="router: vLLM OpenAI servers behind `kvstore router`, the trace sent over HTTP and timed at "
                        "the client (benchmarks/pd/http_run.py); inprocess: engines in worker processes driven "
                        "step by step (per-step timeline, interference and connector attribution)")
    g.add_argument("--link", metavar="GBIT[,GBIT...]",
                   help="with --via router: run the disaggregated pair on two namespace hosts across a link shaped "
                        "to each rate in Gbit/s (e.g. 1,10,25; needs root), the planner checked against it "
                        "(benchmarks/pd/link.py); colocated and chunked stay on one host")


def _cores(text: str) -> tuple[int, int]:
    try:
        cores = tuple(int(c) for c in text.split(","))
    except ValueError:
        cores = ()
    if len(cores) != 2 or min(cores) < 0:
        raise ValueError(f"--cores wants two core ids like 0,1, got {text!r}")
    return cores  # type: ignore[return-value]


def vllm_compare_config(args: argparse.Namespace, sources: tuple, archs: tuple[Arch, ...]) -> VllmCompareConfig:
    """The comparison's configuration from ``compare --engine vllm`` arguments (ValueError on bad input)."""
    parse_size(args.store_capacity)  # a bad size is a usage error before anything starts
    model = args.model
    if model is None:
        model = str(make_model(LlamaShape(seed=args.seed, dtype=args.vllm_dtype), Path(args.out) / "model"))
    engine = VllmConfig(model=model, block_size=args.block_size or 128, chunk_budget=args.chunk_budget,
                        max_model_len=args.max_model_len, kv_cache_bytes=parse_size(args.kv_cache_size),
                        dtype=args.vllm_dtype, transport=args.transport, cores=_cores(args.cores),
                        start_timeout_s=args.start_timeout, store_capacity=args.store_capacity)
    return VllmCompareConfig(sources=sources, out_dir=args.out, engine=engine, archs=archs,
                             num_requests=args.num_requests, seed=args.seed, rate_scale=args.rate_scale,
                             slo=SLO(args.slo_ttft, args.slo_tpot, args.slo_attainment),
                             fault=FaultSpec.parse(args.inject_fault) if args.inject_fault else None)
