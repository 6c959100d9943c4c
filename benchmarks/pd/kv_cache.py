"""The paged KV cache: one tensor per layer in the vLLM flash-attention (NHD) layout.

Each layer holds ``[2, num_blocks, block_size, num_kv_heads, head_dim]``: index 0 is K, 1 is V. A token at
position ``p`` of a request lives in block ``block_table[p // block_size]`` at offset ``p % block_size``, so
its flat *slot* is ``block_table[p // block_size] * block_size + p % block_size``. This is the layout
``kvstore.KVLayoutKind.VLLM_FLASH_NHD`` describes, so the list of layer tensors can be handed to
``KVHandoff.publish`` / ``fetch`` as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """Geometry of one worker's paged KV cache."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"CacheSpec.{name} must be a positive int, got {value!r}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"KV cache dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype}")

    @property
    def block_bytes(self) -> int:
        """Bytes one block occupies across all layers, K and V."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    @property
    def total_bytes(self) -> int:
        return self.block_bytes * self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)


class PagedKVCache:
    """Per-layer K/V pages plus the slot arithmetic to write and read them."""

    def __init__(self, spec: CacheSpec):
        self.spec = spec
        shape = (2, spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.layers: list[torch.Tensor] = [torch.zeros(shape, dtype=spec.dtype) for _ in range(spec.num_layers)]

    def slots(self, block_table: list[int], start: int, count: int) -> torch.Tensor:
        """Flat slot indices of positions ``start .. start+count-1`` of a request with ``block_table``."""
        bs = self.spec.block_size
        last = (start + count - 1) // bs if count else -1
        if last >= len(block_table):
            raise ValueError(
                f"positions up to {start + count - 1} need {last + 1} blocks, block table has {len(block_table)}"
            )
        pos = torch.arange(start, start + count)
        table = torch.tensor(block_table, dtype=torch.long)
        return table[pos // bs] * bs + pos % bs

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``, ``v`` (``[n, num_kv_heads, head_dim]``) at flat ``slots`` of ``layer``."""
        kv = self.layers[layer]
        flat = kv.view(2, -1, self.spec.num_kv_heads, self.spec.head_dim)
        flat[0].index_copy_(0, slots, k.to(self.spec.dtype))
        flat[1].index_copy_(0, slots, v.to(self.spec.dtype))

    def gather(self, layer: int, block_table: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the first ``num_tokens`` positions of a request: two ``[num_tokens, kv_heads, head_dim]``."""
        pages = self.layers[layer].index_select(1, block_table)
        flat = pages.reshape(2, -1, self.spec.num_kv_heads, self.spec.head_dim)
        return flat[0, :num_tokens], flat[1, :num_tokens]
