"""Decode stall: the inter-token time (TPOT) of running streams while long prompts arrive, vs without arrivals.

Run inside a benchmark engine child (``bench_vllm``): ``streams`` short requests decode ``stream_tokens`` tokens
each, stepping vLLM's engine directly so that every token's arrival time is seen; in the "arrivals" case the
``arrivals`` prompts (hits in the store for a connector, computed otherwise) are added a few steps in. Every
gap between two tokens of a stream is one TPOT sample; p50/p99 over all streams and repeats.
"""

from __future__ import annotations

import itertools
import time

_IDS = itertools.count()


def run_streams(llm, prompts: list[list[int]], arrivals: list[list[int]], stream_tokens: int,
                arrive_at_step: int = 3) -> list[float]:
    """One round: returns the streams' inter-token gaps (seconds)."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    stream_params = SamplingParams(max_tokens=stream_tokens, temperature=0.0, ignore_eos=True)
    arrival_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    streams = set()
    for p in prompts:
        rid = f"stream-{next(_IDS)}"
        streams.add(rid)
        engine.add_request(rid, {"prompt_token_ids": p}, stream_params)
    last: dict[str, float] = {}
    gaps: list[float] = []
    step = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.request_id in streams:
                if out.request_id in last:
                    gaps.append(now - last[out.request_id])
                last[out.request_id] = now
        step += 1
        if step == arrive_at_step:
            for p in arrivals:
                engine.add_request(f"arrival-{next(_IDS)}", {"prompt_token_ids": p}, arrival_params)
    return gaps


def decode_stall(llm, make_prompt, arrivals: list[list[int]], repeats: int, streams: int = 4,
                 stream_tokens: int = 32, before_round=None) -> dict[str, list[float]]:
    """``quiet`` and ``arrivals`` gaps over ``repeats`` rounds each, interleaved. ``before_round`` runs before
    each round (reset vLLM's prefix cache, so that arrivals come from the connector or are computed)."""
    out: dict[str, list[float]] = {"quiet": [], "arrivals": []}
    for _ in range(repeats):
        for case in ("quiet", "arrivals"):
            if before_round is not None:
                before_round()
            prompts = [make_prompt(64) for _ in range(streams)]
            out[case] += run_streams(llm, prompts, arrivals if case == "arrivals" else [], stream_tokens)
    return out
