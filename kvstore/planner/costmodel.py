"""The cost model: how long one engine step takes, what moving KV costs, what memory a worker has.

One formula covers every kind of step, so colocated, chunked and disaggregated workers are costed alike::

    t_step = base_s                                   # weights read once per forward + fixed overhead
           + expert_s * touched(tokens)               # MoE: routed experts actually read this step
           + token_s * sum(prefill tokens)            # GEMM FLOPs of prompt tokens
           + seq_s * decode_seqs                      # GEMM FLOPs of decode tokens (one per sequence)
           + pair_s * sum(attention pairs of prompts) # causal attention FLOPs, quadratic in the prompt
           + ctx_s * sum(decode contexts)             # KV bytes read by decode attention

Compute and memory time are *added*, not overlapped (a roofline ``max``): real engines overlap them only
partly, and the sum keeps the model linear in its coefficients, which is what lets
:mod:`kvstore.planner.calibrate` fit it by least squares.
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
    token_s: float
    seq_s: float
    pair_s: float
    ctx_s: float
    kv_bytes_per_token: int
    weight_bytes: float
    kv_capacity_tokens: int
    expert_s: float = 0.0
    expert_fraction: float = 0.0  # probability one token routes to a given expert (k / E)
    tp: int = 1

    def __post_init__(self) -> None:
        for f in ("base_s", "token_s", "seq_s", "pair_s", "ctx_s", "expert_s", "weight_bytes"):
            value = getattr(self, f)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"CostModel.{f} must be a finite number >= 0, got {value!r}")
        if self.kv_bytes_per_token <= 0:
            raise ValueError(f"CostModel.kv_bytes_per_token must be > 0, got {self.kv_bytes_per_token!r}")
        if not 0 <= self.expert_fraction <= 1:
            raise ValueError(f"CostModel.expert_fraction must be in [0, 1], got {self.expert_fraction!r}")

    def step_s(self, decode_seqs: int = 0, decode_ctx: float = 0, prefill_tokens: int = 0,
               prefill_pair_count: float = 0) -> float:
        """Duration of one forward pass over ``decode_seqs`` decoding sequences whose contexts sum to
        ``decode_ctx`` tokens, plus prompt chunks totalling ``prefill_tokens`` tokens and
        ``prefill_pair_count`` attention pairs (see :func:`prefill_pairs`)."""
        tokens = decode_seqs + prefill_tokens
        t = (self.base_s + self.token_s * prefill_tokens + self.seq_s * decode_seqs
             + self.pair_s * prefill_pair_count + self.ctx_s * decode_ctx)
        if self.expert_s and tokens:
            t += self.expert_s * (1.0 - (1.0 - self.expert_fraction) ** tokens)
        return t

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """One prompt prefilled alone in one step."""
        return self.step_s(prefill_tokens=new_tokens, prefill_pair_count=prefill_pairs(new_tokens, cached_tokens))

    def decode_s(self, batch: int, total_ctx: float) -> float:
        """One decode step of ``batch`` sequences whose contexts sum to ``total_ctx`` tokens."""
        return self.step_s(decode_seqs=batch, decode_ctx=total_ctx)

    @staticmethod
    def features(decode_seqs: float, decode_ctx: float, prefill_tokens: float, pair_count: float) -> list[float]:
        """The regressors of a step, in the order of :attr:`COEFFICIENTS` (for least-squares fitting)."""
        return [1.0, prefill_tokens, decode_seqs, pair_count, decode_ctx]

    COEFFICIENTS = ("base_s", "token_s", "seq_s", "pair_s", "ctx_s")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "CostModel":
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown CostModel fields {sorted(unknown)}; expected a subset of {sorted(known)}")
        return cls(**data)


@dataclass(frozen=True, slots=True)
class TransferModel:
    """KV transfer time = ``latency_s`` + bytes / ``bytes_per_s`` over one worker's link."""

    name: str
    latency_s: float
    bytes_per_s: float

    def __post_init__(self) -> None:
        if not self.bytes_per_s > 0:
            raise ValueError(f"TransferModel.bytes_per_s must be > 0, got {self.bytes_per_s!r}")
        if self.latency_s < 0:
            raise ValueError(f"TransferModel.latency_s must be >= 0, got {self.latency_s!r}")

    def time_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bytes_per_s

    @classmethod
    def from_link(cls, link: LinkSpec, tp: int = 1) -> "TransferModel":
        lanes = tp if link.per_gpu else 1
        return cls(name=link.name, latency_s=link.latency_s, bytes_per_s=link.bytes_per_s * lanes)

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
        base_s=eff.step_overhead_s + model.dense_weight_bytes / bandwidth,
        token_s=per_token_flops / flops,
        seq_s=per_token_flops / flops,
        pair_s=model.attn_flops_per_pair / flops,
        ctx_s=model.kv_bytes_per_token / bandwidth + model.attn_flops_per_pair / flops,
        kv_bytes_per_token=model.kv_bytes_per_token,
        weight_bytes=model.weight_bytes,
        kv_capacity_tokens=capacity,
        expert_s=model.expert_weight_bytes / bandwidth,
        expert_fraction=(model.experts_per_token / model.experts) if model.experts else 0.0,
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
