"""The fitted step model: how long an engine step of the small engine takes, predicted from a few timed steps
of the real model (for admission control). Not the planner's analytic cost model
(:class:`kvstore.planner.costmodel.CostModel`, step times from GPU/model specs, fitted to runs by
``kvstore plan --calibrate``): this one is fitted here, at start-up, to the model it will serve.

``prefill_s(n)`` fits ``a + b*n + c*n^2`` (attention over the prompt is quadratic); ``decode_step_s(batch, ctx)``
fits ``a + b*batch + c*ctx`` where ``ctx`` is the total context of the batch. Both are least-squares fits of
steps timed in this process with one torch thread (what each worker gets); :meth:`StepModel.describe` reports
the points and the fit so the report can show how far the predictions are from the steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from kvstore.workloads.stats import median

PREFILL_POINTS = (16, 64, 128, 256, 512, 768, 1024)
DECODE_POINTS = ((1, 64), (1, 1024), (4, 512), (8, 256), (8, 2048), (16, 1024), (16, 4096), (32, 2048))


@dataclass(frozen=True, slots=True)
class StepModel:
    prefill: tuple[float, float, float]  # seconds: a + b*n + c*n^2
    decode: tuple[float, float, float]  # seconds: a + b*batch + c*total_context
    fit_error: float = 0.0  # median relative error of the fit over the timed points

    def prefill_s(self, tokens: int) -> float:
        a, b, c = self.prefill
        return max(0.0, a + b * tokens + c * tokens * tokens)

    def decode_step_s(self, batch: int, context: int) -> float:
        if batch <= 0:
            return 0.0
        a, b, c = self.decode
        return max(0.0, a + b * batch + c * context)

    def describe(self) -> dict:
        return {"prefill_s": "a + b*n + c*n^2", "prefill_coef": [float(x) for x in self.prefill],
                "decode_step_s": "a + b*batch + c*context", "decode_coef": [float(x) for x in self.decode],
                "fit_error_median": round(self.fit_error, 3)}


def _fit(rows: list[list[float]], seconds: list[float]) -> tuple[tuple[float, float, float], list[float]]:
    x, y = np.asarray(rows, dtype=np.float64), np.asarray(seconds, dtype=np.float64)
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    rel = np.abs(x @ coef - y) / np.maximum(y, 1e-9)
    return (float(coef[0]), float(coef[1]), float(coef[2])), rel.tolist()


def fit_step_model(model_config, block_size: int = 16, repeats: int = 3) -> StepModel:
    """Time prefill and decode steps of ``model_config`` here, on one torch thread, and fit the model."""
    import torch

    from benchmarks.pd.attention import AttentionBatch, SeqChunk
    from benchmarks.pd.kv_cache import CacheSpec, PagedKVCache
    from benchmarks.pd.model import LlamaModel

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = LlamaModel(model_config)
        max_len = min(model_config.max_position, 4096)
        blocks = -(-8192 // block_size)  # enough for any single point below
        cache = PagedKVCache(CacheSpec(model_config.num_layers, blocks, block_size, model_config.num_kv_heads,
                                       model_config.head_dim, model_config.torch_dtype))

        def timed(seqs: list, n_ids: int) -> float:
            ids = torch.zeros(n_ids, dtype=torch.long)
            batch = AttentionBatch.build(seqs, cache)
            model(ids, batch, cache)  # warm-up
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                model(ids, batch, cache)
                times.append(time.perf_counter() - t)
            return median(times)  # the median, not the best: workers share a busy machine

        p_rows, p_y = [], []
        for n in (n for n in PREFILL_POINTS if n < max_len):
            p_rows.append([1.0, n, n * n])
            p_y.append(timed([SeqChunk(list(range(-(-n // block_size))), 0, n)], n))
        d_rows, d_y = [], []
        for batch, ctx in DECODE_POINTS:
            length = min(ctx // batch, max_len - 1)
            per_seq = -(-(length + 1) // block_size)
            seqs = [SeqChunk(list(range(i * per_seq, (i + 1) * per_seq)), length, 1) for i in range(batch)]
            d_rows.append([1.0, batch, batch * length])
            d_y.append(timed(seqs, batch))
    finally:
        torch.set_num_threads(threads)
    prefill, p_err = _fit(p_rows, p_y)
    decode, d_err = _fit(d_rows, d_y)
    return StepModel(prefill, decode, median(p_err + d_err))
