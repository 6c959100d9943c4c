"""One vLLM engine (CPU, single process) run as a test subprocess: generate greedily, report as JSON.

    python vllm_child.py --model DIR --prompts P.json --out R.json [--url URL --role kv_both] [--batches N]

With ``--batches N`` the prompts run in N batches; between two batches the child prints ``BATCH <i>`` and
waits for a line on stdin, so a test can act (kill the daemon...) at a known point. The JSON holds, per
prompt, the generated token ids, ``num_cached_tokens`` and what the connector moved for it (``transfers``: its
per-request record), and the connectors' summed counters.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def build_llm(args):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw = {}
    if args.url:
        extra = {"url": args.url, "timeout_s": 5.0, "retry_s": 0.5}
        extra.update(json.loads(args.extra))
        kw["kv_transfer_config"] = KVTransferConfig(kv_connector="KVStoreConnector",
                                                    kv_connector_module_path="kvstore.integrations.vllm",
                                                    kv_role=args.role, kv_connector_extra_config=extra)
    return LLM(model=args.model, skip_tokenizer_init=True, dtype=args.dtype, block_size=args.block_size,
               kv_cache_memory_bytes=args.kv_bytes, max_model_len=args.max_model_len, enforce_eager=True,
               enable_prefix_caching=not args.no_prefix_cache, seed=0, **kw)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--url", default="")
    p.add_argument("--role", default="kv_both")
    p.add_argument("--extra", default="{}")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-bytes", type=int, default=64 << 20)
    p.add_argument("--batches", type=int, default=1)
    p.add_argument("--no-prefix-cache", action="store_true", help="disable vLLM's own prefix cache")
    args = p.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import SamplingParams

    with open(args.prompts) as f:
        prompts = json.load(f)
    llm = build_llm(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    results = []
    size = -(-len(prompts) // args.batches)
    for i in range(0, len(prompts), size):
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts[i:i + size]], params, use_tqdm=False)
        results += [{"id": o.request_id, "tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens}
                    for o in outs]
        if i + size < len(prompts):
            if args.url:
                from kvstore.integrations.vllm import live_connectors

                for conn in live_connectors():  # the batch's saves are in the store before the test acts
                    conn.wait_for_saves(30.0)
            print(f"BATCH {i // size}", flush=True)
            sys.stdin.readline()
    counters = {}
    if args.url:
        from kvstore.integrations.vllm import live_connectors

        for conn in live_connectors():
            assert conn.wait_for_saves(30.0), "asynchronous saves still queued after 30 s"
        for _ in range(100):  # an idle offline engine takes no step: step it so vLLM frees the held blocks
            if not any(conn.has_pending_push_work() for conn in live_connectors()):
                break
            llm.llm_engine.step()
        assert not any(conn.has_pending_push_work() for conn in live_connectors()), "blocks still held"
        for conn in live_connectors():
            for k, v in conn.counters.as_dict().items():
                counters[k] = counters.get(k, 0) + v
            # what the connector moved for each request (vLLM's internal request id is "<ours>-<suffix>")
            for rid in conn.request_transfer_ids():
                record = conn.request_transfers(rid)
                for r in results:
                    if rid == r["id"] or rid.startswith(r["id"] + "-"):
                        mine = r.setdefault("transfers", {})
                        for k, v in record.items():
                            mine[k] = mine.get(k, 0) + v
    with open(args.out, "w") as f:
        json.dump({"results": results, "counters": counters}, f)
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
