"""A request as one engine worker sees it: its tokens, how far its KV is computed, and when things happened."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Phase(Enum):
    WAITING = "waiting"  # queued; no blocks yet
    PREFILLING = "prefilling"  # admitted, prompt KV partly computed
    DECODING = "decoding"  # prompt KV complete, generating
    FINISHED = "finished"  # all output tokens generated; blocks freed
    HANDED_OFF = "handed-off"  # prefill-only role: KV published, blocks freed
    FAILED = "failed"  # hand-off failed on this worker; blocks freed


@dataclass(slots=True)
class RequestTimes:
    """Seconds since the run's start (one clock shared by every process on the host)."""

    queued_s: float = 0.0  # entered this worker's queue
    admitted_s: float | None = None  # got its blocks on this worker
    prefill_start_s: float | None = None
    prefill_end_s: float | None = None
    publish_s: float = 0.0  # prefill role: time spent in KVHandoff.publish + ticket.wait
    fetch_s: float = 0.0  # decode role: time spent in KVHandoff.fetch
    token_times_s: list[float] = field(default_factory=list)


@dataclass(slots=True)
class Request:
    """``prompt_ids`` then ``output_ids``; the first ``num_computed`` of them have KV in this worker's cache."""

    id: str
    prompt_ids: list[int]
    max_output: int
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    phase: Phase = Phase.WAITING
    times: RequestTimes = field(default_factory=RequestTimes)
    error: str | None = None
    # decode role: the KV was fetched once already by a worker that died; fetch it again from the store's
    # prefix chunks (the hand-off's request record is gone once fetched)
    refetch: bool = False

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"request {self.id}: empty prompt")
        if self.max_output < 1:
            raise ValueError(f"request {self.id}: max_output must be >= 1, got {self.max_output}")

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def max_tokens(self) -> int:
        """Tokens whose KV the request can ever need (the last output token is never fed back)."""
        return len(self.prompt_ids) + self.max_output - 1

    @property
    def prompt_left(self) -> int:
        return max(0, self.num_prompt - self.num_computed)

    @property
    def done(self) -> bool:
        return len(self.output_ids) >= self.max_output

    def tokens(self, start: int, count: int) -> list[int]:
        """Token ids at positions ``start .. start+count-1`` of prompt + output."""
        if start < self.num_prompt:
            seq = self.prompt_ids[start:start + count]
            return seq + self.output_ids[: count - len(seq)]
        return self.output_ids[start - self.num_prompt: start - self.num_prompt + count]
