"""Hardware and model descriptions the planner's cost model is built from.

Units are SI throughout: bytes, bytes per second, FLOP per second, seconds. Sizes that users type ("80GB")
are parsed at the CLI edge, never here.
"""

from __future__ import annotations

from dataclasses import dataclass


def _positive(owner: str, **values: float) -> None:
    for name, value in values.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise TypeError(f"{owner}.{name} must be a number, got {type(value).__name__} {value!r}")
        if not value > 0:
            raise ValueError(f"{owner}.{name} must be > 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Geometry of a decoder-only transformer, enough for FLOP, weight and KV-cache arithmetic.

    ``params`` is every weight held in memory; ``active_params`` the weights one token multiplies through
    (equal for dense models, smaller for MoE). ``expert_params`` is the routed-expert part of ``params``
    (0 for dense models): a decode step only reads the experts its tokens are routed to.
    MLA models (DeepSeek-V3) cache one compressed latent of ``mla_latent_dim`` plus a shared RoPE key of
    ``mla_rope_dim`` per layer and token instead of per-head K and V.
    """

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    params: float
    active_params: float
    weight_dtype_bytes: float = 2.0
    kv_dtype_bytes: float = 2.0
    qk_head_dim: int = 0  # attention score dim per head; 0 means head_dim
    v_head_dim: int = 0  # value dim per head; 0 means head_dim
    mla_latent_dim: int = 0  # 0 means not MLA
    mla_rope_dim: int = 0
    experts: int = 0
    experts_per_token: int = 0
    expert_params: float = 0.0
    ffn_dim: int = 0  # dense MLP width (config intermediate_size); for cross-checking params only
    vocab: int = 0
    max_context: int = 8192
    source: str = ""

    def __post_init__(self) -> None:
        _positive(f"ModelSpec({self.name})", layers=self.layers, hidden=self.hidden, heads=self.heads,
                  kv_heads=self.kv_heads, head_dim=self.head_dim, params=self.params,
                  active_params=self.active_params, weight_dtype_bytes=self.weight_dtype_bytes,
                  kv_dtype_bytes=self.kv_dtype_bytes, max_context=self.max_context)
        if self.active_params > self.params:
            raise ValueError(f"{self.name}: active_params {self.active_params} > params {self.params}")
        if self.experts and not 0 < self.experts_per_token <= self.experts:
            raise ValueError(f"{self.name}: experts_per_token {self.experts_per_token} not in 1..{self.experts}")
        if not 0 <= self.expert_params < self.params:
            raise ValueError(f"{self.name}: expert_params {self.expert_params} not in [0, params)")

    @property
    def is_mla(self) -> bool:
        return self.mla_latent_dim > 0

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache one token occupies across all layers (and all TP ranks together)."""
        if self.is_mla:
            per_layer = self.mla_latent_dim + self.mla_rope_dim
        else:
            per_layer = 2 * self.kv_heads * self.head_dim
        return int(self.layers * per_layer * self.kv_dtype_bytes)

    @property
    def weight_bytes(self) -> float:
        """Bytes of one full copy of the weights."""
        return self.params * self.weight_dtype_bytes

    @property
    def dense_weight_bytes(self) -> float:
        """Weights every forward pass reads whatever the batch (everything but routed experts)."""
        return (self.params - self.expert_params) * self.weight_dtype_bytes

    @property
    def expert_weight_bytes(self) -> float:
        return self.expert_params * self.weight_dtype_bytes

    @property
    def attn_flops_per_pair(self) -> float:
        """FLOPs of attention for one (query token, key token) pair across all layers and heads:
        2 FLOP per multiply-add for QK^T (qk dim) and for PV (v dim)."""
        qk = self.qk_head_dim or self.head_dim
        v = self.v_head_dim or self.head_dim
        return 2.0 * self.layers * self.heads * (qk + v)


@dataclass(frozen=True, slots=True)
class GPUSpec:
    """One accelerator: memory, HBM bandwidth and dense BF16 tensor throughput (no sparsity)."""

    name: str
    memory_bytes: float
    hbm_bytes_per_s: float
    bf16_flops: float
    source: str = ""

    def __post_init__(self) -> None:
        _positive(f"GPUSpec({self.name})", memory_bytes=self.memory_bytes,
                  hbm_bytes_per_s=self.hbm_bytes_per_s, bf16_flops=self.bf16_flops)


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """The path KV takes from a prefill worker to a decode worker.

    ``bytes_per_s`` is one direction's payload rate. ``per_gpu`` says whether every GPU has its own such
    link (NVLink, one RDMA NIC per GPU as in DGX H100) so a tensor-parallel worker of ``tp`` GPUs gets ``tp``
    of them, or whether the link is shared by the node (one 10 GbE port).
    """

    name: str
    bytes_per_s: float
    latency_s: float
    per_gpu: bool = True
    publish_share: float = 0.0  # > 0: hand-off staged through a store (see costmodel.TransferModel)
    source: str = ""

    def __post_init__(self) -> None:
        _positive(f"LinkSpec({self.name})", bytes_per_s=self.bytes_per_s)
        if not 0 <= self.publish_share <= 1:
            raise ValueError(f"LinkSpec({self.name}).publish_share must be in [0, 1], got {self.publish_share!r}")
        if self.latency_s < 0:
            raise ValueError(f"LinkSpec({self.name}).latency_s must be >= 0, got {self.latency_s!r}")

    @property
    def gbit_per_s(self) -> float:
        return self.bytes_per_s * 8 / 1e9


@dataclass(frozen=True, slots=True)
class Efficiency:
    """What fraction of the datasheet a serving engine achieves. These are assumptions, not measurements;
    calibration against measured runs replaces them.

    - ``mfu``: model-FLOPs utilisation of prefill GEMMs (0.4-0.6 is typical of vLLM/SGLang on Hopper).
    - ``mbu``: memory-bandwidth utilisation of decode steps (0.7-0.85 typical).
    - ``step_overhead_s``: scheduler, sampling and launch cost per engine step.
    - ``tp_efficiency``: throughput kept per GPU when a worker spans several GPUs (all-reduce cost).
    - ``memory_fraction``: share of GPU memory the engine may use for weights plus KV cache.
    - ``overlap``: how much of the smaller of a step's compute and memory time hides under the larger
      (1: roofline, 0: none); see :mod:`kvstore.planner.costmodel`.
    """

    mfu: float = 0.5
    mbu: float = 0.8
    step_overhead_s: float = 0.5e-3
    tp_efficiency: float = 0.85
    memory_fraction: float = 0.9
    overlap: float = 0.8

    def __post_init__(self) -> None:
        if not 0 <= self.overlap <= 1:
            raise ValueError(f"Efficiency.overlap must be in [0, 1], got {self.overlap!r}")
        for name in ("mfu", "mbu", "tp_efficiency", "memory_fraction"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"Efficiency.{name} must be in (0, 1], got {value!r}")
        if self.step_overhead_s < 0:
            raise ValueError(f"Efficiency.step_overhead_s must be >= 0, got {self.step_overhead_s!r}")
