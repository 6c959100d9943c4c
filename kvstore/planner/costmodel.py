"""The cost model: how long one engine step takes, what moving KV costs, what memory a worker has.

One formula covers every kind of step, so colocated, chunked and disaggregated workers are costed alike::

    compute = token_s * prompt tokens               # GEMM FLOPs of prompt tokens in the step
            + seq_s * decode sequences              # GEMM FLOPs of decode tokens (one per sequence)
            + pair_s * attention pairs of prompts   # causal attention FLOPs, quadratic in the prompt
    memory  = weight_s                              # weights read once per forward pass
            + expert_s * touched(tokens)            # MoE: the routed experts this step's tokens reach
            + ctx_s * sum(decode contexts)          # KV bytes read by decode attention
    t_step  = base_s + compute + memory - overlap * min(compute, memory)

``overlap`` = 1 is the roofline (compute hides under memory traffic or the reverse), 0 is no overlap.
Between the two is what engines achieve; it is what lets decodes "piggyback" on a prompt chunk
(Sarathi-Serve): a chunk whose compute fits under the step's weight reads costs the decodes little.
Given which of compute and memory is smaller, the formula is linear in the coefficients, which is what
:mod:`kvstore.planner.calibrate` exploits to fit it by least squares.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from kvstore.planner.specs import Efficiency, GPUSpec, LinkSpec, ModelSpec


def prefill_pairs(new_tokens: int, cached_tokens: int = 0) -> float:
    """Causal attention pairs computed when ``new_tokens`` follow ``cached_tokens`` already in the cache."""
    return new_tokens * cached_tokens + new_tokens * (new_tokens + 1) / 2


@dataclass(frozen=True, slots=True)
class CostModel:
    """Step-time coefficients (seconds per unit) and the memory of one worker (a group of ``tp`` GPUs)."""

    name: str
    base_s: float
    weight_s: float
    token_s: float
    seq_s: float
    pair_s: float
    ctx_s: float
    kv_bytes_per_token: int
    weight_bytes: float
    kv_capacity_tokens: int
    overlap: float = 0.0
    expert_s: float = 0.0
    expert_fraction: float = 0.0  # probability one token routes to a given expert (k / E)
    tp: int = 1

    COMPUTE = ("token_s", "seq_s", "pair_s")
    MEMORY = ("weight_s", "ctx_s")

    def __post_init__(self) -> None:
        for f in ("base_s", "weight_s", "token_s", "seq_s", "pair_s", "ctx_s", "expert_s", "weight_bytes"):
            value = getattr(self, f)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"CostModel.{f} must be a finite number >= 0, got {value!r}")
        if self.kv_bytes_per_token <= 0:
            raise ValueError(f"CostModel.kv_bytes_per_token must be > 0, got {self.kv_bytes_per_token!r}")
        for f in ("overlap", "expert_fraction"):
            if not 0 <= getattr(self, f) <= 1:
                raise ValueError(f"CostModel.{f} must be in [0, 1], got {getattr(self, f)!r}")

    def parts(self, decode_seqs: int = 0, decode_ctx: float = 0, prefill_tokens: int = 0,
              prefill_pair_count: float = 0) -> tuple[float, float]:
        """(compute seconds, memory seconds) of a step; see the module docstring."""
        compute = self.token_s * prefill_tokens + self.seq_s * decode_seqs + self.pair_s * prefill_pair_count
        memory = self.weight_s + self.ctx_s * decode_ctx
        tokens = decode_seqs + prefill_tokens
        if self.expert_s and tokens:
            memory += self.expert_s * (1.0 - (1.0 - self.expert_fraction) ** tokens)
        return compute, memory

    def step_s(self, decode_seqs: int = 0, decode_ctx: float = 0, prefill_tokens: int = 0,
               prefill_pair_count: float = 0) -> float:
        """Duration of one forward pass over ``decode_seqs`` decoding sequences whose contexts sum to
        ``decode_ctx`` tokens, plus prompt chunks totalling ``prefill_tokens`` tokens and
        ``prefill_pair_count`` attention pairs (see :func:`prefill_pairs`)."""
        compute, memory = self.parts(decode_seqs, decode_ctx, prefill_tokens, prefill_pair_count)
        return self.base_s + compute + memory - self.overlap * min(compute, memory)

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """One prompt prefilled alone in one step."""
        return self.step_s(prefill_tokens=new_tokens, prefill_pair_count=prefill_pairs(new_tokens, cached_tokens))

    def decode_s(self, batch: int, total_ctx: float) -> float:
        """One decode step of ``batch`` sequences whose contexts sum to ``total_ctx`` tokens."""
        return self.step_s(decode_seqs=batch, decode_ctx=total_ctx)

    def decode_linear(self, batch: int) -> tuple[float, float]:
        """(a, c) with decode_s(batch, ctx) = a + c * ctx, valid while the step's regime does not change
        (the simulator re-plans at every event, so the error is second order). Used for spans of steps."""
        compute, memory = self.parts(decode_seqs=batch)
        if self.overlap and compute > memory:  # compute-bound: ctx bytes hide under compute first
            return self.base_s + compute + (1 - self.overlap) * memory, (1 - self.overlap) * self.ctx_s
        return self.base_s + memory + (1 - self.overlap) * compute, self.ctx_s

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown CostModel fields {sorted(unknown)}; expected a subset of {sorted(known)}")
        return cls(**data)


def decode_span_s(a: float, c: float, ctx0: float, batch: int, k: int) -> float:
    """Duration of ``k`` decode steps: step i costs ``a + c * (ctx0 + i * batch)``."""
    return k * a + c * (k * ctx0 + batch * k * (k - 1) / 2)


def steps_to_cover(a: float, c: float, ctx0: float, batch: int, dt: float) -> int:
    """Smallest k >= 1 whose span reaches ``dt`` (the boundary at or after ``dt``)."""
    first = a + c * ctx0
    if first <= 0:
        raise ValueError(f"decode step time must be > 0, got {first!r} (check the cost model)")
    if dt <= first:
        return 1
    half = c * batch / 2
    if half <= 0:
        k = math.ceil(dt / first)
    else:
        lin = first - half
        k = math.ceil((-lin + math.sqrt(lin * lin + 4 * half * dt)) / (2 * half))
    k = max(1, k)
    while k > 1 and decode_span_s(a, c, ctx0, batch, k - 1) >= dt:
        k -= 1
    while decode_span_s(a, c, ctx0, batch, k) < dt:
        k += 1
    return k


@dataclass(frozen=True, slots=True)
class TransferModel:
    """KV hand-off time = ``latency_s`` + bytes / ``bytes_per_s``.

    ``publish_share`` = 0 (default): a one-sided pull over the link (NIXL, Mooncake Transfer Engine); the
    prefill worker keeps the KV until the copy is done and neither worker's compute waits for it.
    ``publish_share`` > 0: a hand-off staged through a store, as the small engine does: the prefill worker
    spends that share of the time publishing inside its step loop (its next step waits), then the KV
    lives in the store; the decode worker spends the rest fetching inside one of its steps.
    """

    name: str
    latency_s: float
    bytes_per_s: float
    publish_share: float = 0.0

    def __post_init__(self) -> None:
        if not self.bytes_per_s > 0:
            raise ValueError(f"TransferModel.bytes_per_s must be > 0, got {self.bytes_per_s!r}")
        if self.latency_s < 0:
            raise ValueError(f"TransferModel.latency_s must be >= 0, got {self.latency_s!r}")
        if not 0 <= self.publish_share <= 1:
            raise ValueError(f"TransferModel.publish_share must be in [0, 1], got {self.publish_share!r}")

    @property
    def staged(self) -> bool:
        return self.publish_share > 0

    def time_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bytes_per_s

    def publish_s(self, nbytes: float) -> float:
        return self.publish_share * self.time_s(nbytes)

    def fetch_s(self, nbytes: float) -> float:
        return (1 - self.publish_share) * self.time_s(nbytes)

    @classmethod
    def from_link(cls, link: LinkSpec, tp: int = 1) -> TransferModel:
        lanes = tp if link.per_gpu else 1
        return cls(name=link.name, latency_s=link.latency_s, bytes_per_s=link.bytes_per_s * lanes,
                   publish_share=link.publish_share)

    def to_dict(self) -> dict:
        return asdict(self)


def kv_capacity_tokens(model: ModelSpec, gpu: GPUSpec, tp: int, eff: Efficiency) -> int:
    """Tokens of KV cache one worker of ``tp`` GPUs can hold next to its weights (may be <= 0: no fit)."""
    free = tp * gpu.memory_bytes * eff.memory_fraction - model.weight_bytes
    return int(free // model.kv_bytes_per_token)


def from_specs(model: ModelSpec, gpu: GPUSpec, tp: int = 1, eff: Efficiency | None = None) -> CostModel:
    """Derive step-time coefficients from datasheet figures and the efficiency assumptions.

    Raises ValueError if ``tp`` is not a positive integer or the weights do not fit in ``tp`` GPUs.
    """
    eff = eff or Efficiency()
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    scale = tp * (eff.tp_efficiency if tp > 1 else 1.0)
    flops = gpu.bf16_flops * eff.mfu * scale
    bandwidth = gpu.hbm_bytes_per_s * eff.mbu * scale
    capacity = kv_capacity_tokens(model, gpu, tp, eff)
    if capacity <= 0:
        raise ValueError(
            f"{model.name} weights ({model.weight_bytes / 1e9:.0f} GB) do not fit in tp={tp} x {gpu.name} "
            f"({tp * gpu.memory_bytes * eff.memory_fraction / 1e9:.0f} GB usable); use more GPUs per worker")
    per_token_flops = 2.0 * model.active_params
    return CostModel(
        name=f"{model.name}@{gpu.name}x{tp}",
        base_s=eff.step_overhead_s,
        weight_s=model.dense_weight_bytes / bandwidth,
        token_s=per_token_flops / flops,
        seq_s=per_token_flops / flops,
        pair_s=model.attn_flops_per_pair / flops,
        ctx_s=model.kv_bytes_per_token / bandwidth + model.attn_flops_per_pair / flops,
        kv_bytes_per_token=model.kv_bytes_per_token,
        weight_bytes=model.weight_bytes,
        kv_capacity_tokens=capacity,
        expert_s=model.expert_weight_bytes / bandwidth,
        expert_fraction=(model.experts_per_token / model.experts) if model.experts else 0.0,
        overlap=eff.overlap,
        tp=tp,
    )


def min_tp(model: ModelSpec, gpu: GPUSpec, min_kv_tokens: int, eff: Efficiency | None = None,
           max_tp: int = 64) -> int:
    """Smallest power-of-two GPU count per worker that holds the weights and ``min_kv_tokens`` of KV."""
    eff = eff or Efficiency()
    tp = 1
    while tp <= max_tp:
        if kv_capacity_tokens(model, gpu, tp, eff) >= min_kv_tokens:
            return tp
        tp *= 2
    raise ValueError(f"{model.name} with {min_kv_tokens} KV tokens does not fit in {max_tp} x {gpu.name}")
