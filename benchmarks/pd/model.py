"""A Llama-style decoder in plain torch: RMSNorm, RoPE, grouped-query attention over paged KV, SwiGLU.

Weights are random but fully determined by ``ModelConfig.seed``, so every worker process builds the same
model and greedy decoding gives the same tokens wherever a request runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from benchmarks.pd.attention import AttentionBatch, paged_attention
from benchmarks.pd.kv_cache import SUPPORTED_DTYPES, PagedKVCache

_DTYPES = {str(d).removeprefix("torch."): d for d in SUPPORTED_DTYPES}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Model geometry. The default prefills 1,000 tokens in ~0.15 s on one thread of this class of CPU."""

    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 704
    max_position: int = 8192
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    dtype: str = "float32"
    seed: int = 0
    model_id: str = "pd-tiny"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "max_position"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def kv_bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.torch_dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with cos/sin precomputed for every position up to ``max_position``."""

    def __init__(self, head_dim: int, max_position: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x``: ``[n, heads, head_dim]``; ``positions``: ``[n]``."""
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding):
        super().__init__()
        self.layer, self.rope = layer, rope
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)

    def forward(self, x: torch.Tensor, batch: AttentionBatch, cache: PagedKVCache) -> torch.Tensor:
        n = x.shape[0]
        q = self.rope(self.q_proj(x).view(n, self.num_heads, self.head_dim), batch.positions)
        k = self.rope(self.k_proj(x).view(n, self.num_kv_heads, self.head_dim), batch.positions)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        cache.write(self.layer, batch.slot_mapping, k, v)
        out = paged_attention(q, cache, self.layer, batch, self.scale)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.attn = Attention(cfg, layer, rope)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, batch: AttentionBatch, cache: PagedKVCache) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), batch, cache)
        return x + self.mlp(self.post_attn_norm(x))


class LlamaModel(nn.Module):
    """``forward(token_ids, batch, cache)`` -> logits of each chunk's last token, ``[num_chunks, vocab]``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        rope = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_theta)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rope) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._init_weights()
        self.to(cfg.torch_dtype)
        self.requires_grad_(False)
        self.eval()

    def _init_weights(self) -> None:
        """Seeded init, parameter by parameter in a fixed order, scaled so every layer's output is O(1)."""
        gen = torch.Generator().manual_seed(self.cfg.seed)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                elif name == "embed.weight":
                    param.normal_(0.0, 1.0, generator=gen)
                else:
                    param.normal_(0.0, 1.0 / math.sqrt(param.shape[1]), generator=gen)

    @property
    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, batch: AttentionBatch, cache: PagedKVCache) -> torch.Tensor:
        if token_ids.shape[0] != batch.num_tokens:
            raise ValueError(f"{token_ids.shape[0]} token ids for a batch of {batch.num_tokens} positions")
        if int(batch.positions.max()) >= self.cfg.max_position:
            raise ValueError(f"position {int(batch.positions.max())} exceeds max_position {self.cfg.max_position}")
        x = self.embed(token_ids)
        for layer in self.layers:
            x = layer(x, batch, cache)
        return self.lm_head(self.norm(x[batch.last_token_index]))


#: named sizes for the command line; ``tiny`` is for tests (milliseconds per step)
MODEL_PRESETS = {
    "default": ModelConfig(),
    "tiny": ModelConfig(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                        intermediate_size=176, max_position=4096),
}
