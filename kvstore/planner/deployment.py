"""How GPUs are arranged into workers for one of the three serving architectures."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.workloads.arch import Arch
from kvstore.workloads.runlog import RunLog

__all__ = ["Arch", "Deployment", "deployment_of"]


@dataclass(frozen=True, slots=True)
class Deployment:
    """``gpus`` GPUs in workers of ``tp`` GPUs each (tensor parallel inside a worker, data parallel across).

    ``prefill_workers`` only applies to DISAGGREGATED (the rest are decode workers); ``chunk_tokens`` only
    to CHUNKED. ``max_prefill_tokens`` caps the prompt tokens one prefill step batches (a longer prompt
    still runs, alone). ``prefix_cache_tokens`` is each prefill-capable worker's prefix cache (0: none).
    """

    arch: Arch
    gpus: int
    tp: int = 1
    prefill_workers: int = 0
    chunk_tokens: int = 512
    max_batch: int = 256
    max_prefill_tokens: int = 16384
    prefix_cache_tokens: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.arch, Arch):
            raise TypeError(f"arch must be an Arch, got {type(self.arch).__name__} {self.arch!r}")
        for name in ("gpus", "tp", "chunk_tokens", "max_batch", "max_prefill_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Deployment.{name} must be a positive integer, got {value!r}")
        if self.gpus % self.tp:
            raise ValueError(f"gpus ({self.gpus}) must be a multiple of tp ({self.tp})")
        if self.prefix_cache_tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be >= 0, got {self.prefix_cache_tokens!r}")
        if self.arch is Arch.DISAGGREGATED:
            if self.workers < 2:
                raise ValueError(f"disaggregated needs at least 2 workers of tp={self.tp}, got gpus={self.gpus}")
            if not 1 <= self.prefill_workers <= self.workers - 1:
                raise ValueError(f"prefill_workers must be in 1..{self.workers - 1} for {self.workers} workers, "
                                 f"got {self.prefill_workers!r}")
        elif self.prefill_workers:
            raise ValueError(f"prefill_workers only applies to disaggregated, got {self.prefill_workers} "
                             f"for {self.arch.value}")

    @property
    def workers(self) -> int:
        return self.gpus // self.tp

    @property
    def decode_workers(self) -> int:
        return self.workers - self.prefill_workers if self.arch is Arch.DISAGGREGATED else 0

    @property
    def label(self) -> str:
        tp = f" tp{self.tp}" if self.tp > 1 else ""
        if self.arch is Arch.DISAGGREGATED:
            return f"disaggregated {self.prefill_workers}P+{self.decode_workers}D{tp}"
        if self.arch is Arch.CHUNKED:
            return f"chunked x{self.workers}{tp} ({self.chunk_tokens} tok/step)"
        return f"colocated x{self.workers}{tp}"


def deployment_of(run: RunLog) -> Deployment:
    """A measured run's deployment as its summary.json describes it (engine defaults where it is silent)."""
    if run.arch is None:
        raise ValueError(f"{run.path}: summary.json does not say the arch (colocated/chunked/disaggregated)")
    workers = run.find_list("workers")
    if workers and all(isinstance(w, dict) for w in workers):
        total = len(workers)
        prefill = sum(1 for w in workers if str(w.get("role", "")).startswith("prefill-only"))
    else:
        total = int(run.find("workers", "num_workers", "n_workers") or 2)
        prefill = int(run.find("prefill_workers", "num_prefill_workers") or 1)
    common = dict(max_batch=int(run.find("max_running", "max_batch") or 256),
                  max_prefill_tokens=int(run.find("prefill_batch_tokens", "max_prefill_tokens") or 16384))
    if run.arch is Arch.DISAGGREGATED:
        return Deployment(Arch.DISAGGREGATED, gpus=total, prefill_workers=max(1, prefill), **common)
    chunk = int(run.find("chunk_budget", "chunk_tokens", "token_budget") or 512)
    return Deployment(run.arch, gpus=total, chunk_tokens=chunk, **common)
