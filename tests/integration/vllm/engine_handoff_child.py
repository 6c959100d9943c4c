"""A vLLM engine (CPU, single process, no connector) whose paged KV cache a KVHandoff reads and writes: the
hand-off side of ``test_shared_keys.py``.

    python engine_handoff_child.py --model DIR --url URL --publish P.json --fetch Q.json --out R.json

1. Prefills the ``--publish`` prompt one engine step and, while vLLM still holds its blocks, publishes its full
   blocks with ``KVHandoff.publish`` (``chunk_blocks=1``) under the layout the vLLM connector computes for this
   engine (``CacheLayout.kv_layout()``). Prints ``PUBLISHED`` and waits for a line on stdin.
2. Prefills the ``--fetch`` prompt the same way, then ``KVHandoff.lookup`` and ``fetch_prefix`` its blocks
   (saved meanwhile by a connector engine) into spare blocks of this engine's cache, and compares them with
   the pages this engine computed itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--url", required=True)
    p.add_argument("--publish", required=True)
    p.add_argument("--fetch", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--block-size", type=int, default=128)
    args = p.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm import LLM, SamplingParams

    import kvstore
    from kvstore.handoff import KVHandoff
    from kvstore.integrations.vllm.keys import layout_from_vllm_config

    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype="bfloat16", block_size=args.block_size,
              kv_cache_memory_bytes=64 << 20, max_model_len=4096, enforce_eager=True, enable_prefix_caching=False,
              seed=0)
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    kv_cache_config = core.scheduler.kv_cache_config
    layout = layout_from_vllm_config(engine.vllm_config, kv_cache_config)
    names = list(kv_cache_config.kv_cache_groups[0].layer_names)
    context = engine.vllm_config.compilation_config.static_forward_context
    caches = [context[name].kv_cache for name in names]
    caches = [c[0] if isinstance(c, (list, tuple)) else c for c in caches]
    kv = layout.kv_layout()
    store = kvstore.connect(args.url, transport="tcp")
    handoff = KVHandoff(store, kv, chunk_blocks=1)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    def prefill(rid: str, prompt: list[int]) -> list[int]:
        """Run the prompt's prefill (one step) and return its block ids while the request still holds them."""
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        while True:  # the only request (vLLM may suffix its id)
            request = next(iter(core.scheduler.requests.values()), None)
            if request is not None and request.num_computed_tokens >= len(prompt):
                return list(core.scheduler.kv_cache_manager.get_block_ids(request.request_id)[0])
            engine.step()

    def finish() -> None:
        while engine.has_unfinished_requests():
            engine.step()

    with open(args.publish) as f:
        prompt = json.load(f)
    full = len(prompt) // kv.block_size
    blocks = prefill("publish", prompt)
    meta = handoff.publish("publish", caches, blocks[:full], num_tokens=full * kv.block_size,
                           token_ids=prompt[:full * kv.block_size], ttl=600).wait(60)
    finish()
    out = {"fingerprint": layout.fingerprint(), "kv_fingerprint": kv.fingerprint(), "published": list(meta.chunk_keys)}
    print("PUBLISHED", flush=True)
    sys.stdin.readline()

    with open(args.fetch) as f:
        prompt = json.load(f)
    full = len(prompt) // kv.block_size
    blocks = prefill("fetch", prompt)[:full]
    out["lookup"] = handoff.lookup(prompt[:full * kv.block_size])
    used = set(core.scheduler.kv_cache_manager.get_block_ids(next(iter(core.scheduler.requests)))[0])
    spare = [b for b in range(caches[0].shape[0]) if b not in used][:full]
    out["fetched"] = handoff.fetch_prefix(prompt[:full * kv.block_size], caches, spare)
    ours = torch.stack([torch.stack([c[b] for c in caches]) for b in blocks]).float()
    theirs = torch.stack([torch.stack([c[b] for c in caches]) for b in spare]).float()
    out["max_abs_diff"] = float((ours - theirs).abs().max())
    out["scale"] = float(ours.abs().max())
    finish()
    with open(args.out, "w") as f:
        json.dump(out, f)
    store.close()
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
