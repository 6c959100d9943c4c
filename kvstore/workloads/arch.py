"""The three serving architectures a run or a plan is about."""

from __future__ import annotations

from enum import Enum


class Arch(Enum):
    """Serving architecture.

    - ``COLOCATED``: every worker prefills and decodes; a waiting prefill runs before the next decode step
      (prefill-first continuous batching, vLLM's classic scheduler).
    - ``CHUNKED``: every worker runs steps of at most ``chunk_tokens`` tokens: all running decodes plus
      chunks of waiting prompts (Sarathi-Serve).
    - ``DISAGGREGATED``: prefill workers and decode workers; the KV cache moves over the link between them
      (DistServe, Mooncake).
    """

    COLOCATED = "colocated"
    CHUNKED = "chunked"
    DISAGGREGATED = "disaggregated"

    @classmethod
    def parse(cls, value: str | Arch) -> Arch:
        if isinstance(value, cls):
            return value
        if not isinstance(value, str):
            raise TypeError(f"arch must be a string or Arch, got {type(value).__name__} {value!r}")
        try:
            return cls(value.strip().lower())
        except ValueError:
            raise ValueError(f"unknown arch {value!r}; choose one of {', '.join(a.value for a in cls)}") from None
