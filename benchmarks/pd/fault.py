"""Fault injection: ``decode-crash@T`` SIGKILLs a decode-capable worker ``T`` seconds into a run.

Which worker: the decode-capable one (``decode-only`` in a disaggregated deployment; either replica when
collocated or chunked) with the most requests generating at ``T`` (ties: the highest index). What happens
next is the router's business (see router.py): the loss is detected from the dead process's pipe, a
replacement process is started with the same role, and the victim's requests are re-fetched from the store
(disaggregated: prefix-keyed KV chunks outlive the fetch) or re-prefilled on a live worker.

:class:`FaultLog` records the timeline; :func:`recovery_report` turns it and the request rows into the
summary's ``fault`` block. Definitions:

- ``requests_lost``: requests that never completed (must be 0).
- ``requests_recomputed``: re-prefills caused by the fault; ``requests_refetched``: KV fetched again from the
  store instead.
- ``recovery_s``: from the kill until every interrupted request has its first token again (from the attempt
  that completed it); ``replacement_ready_s``: from the kill until the replacement worker is serving.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from benchmarks.pd.scheduler import Policy

DECODE_ROLES = (Policy.DECODE_ONLY, Policy.PREFILL_FIRST, Policy.CHUNKED)


class FaultKind(Enum):
    DECODE_CRASH = "decode-crash"


@dataclass(frozen=True, slots=True)
class FaultSpec:
    kind: FaultKind
    at_s: float

    def __post_init__(self) -> None:
        if not isinstance(self.kind, FaultKind):
            raise TypeError(f"kind must be a FaultKind, got {self.kind!r}")
        if not self.at_s >= 0:
            raise ValueError(f"fault time must be >= 0 s, got {self.at_s!r}")

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        """``decode-crash@2.5`` -> decode crash 2.5 s into the run."""
        kind, _, at = text.partition("@")
        try:
            return cls(FaultKind(kind), float(at))
        except ValueError:
            raise ValueError(f"bad fault {text!r}: expected KIND@SECONDS with KIND one of "
                             f"{[k.value for k in FaultKind]}, e.g. decode-crash@3") from None

    def __str__(self) -> str:
        return f"{self.kind.value}@{self.at_s:g}"


@dataclass(slots=True)
class FaultLog:
    spec: FaultSpec
    victim: int | None = None
    killed_at_s: float | None = None
    detected_at_s: float | None = None
    replacement_ready_at_s: float | None = None
    interrupted: list[str] = field(default_factory=list)  # request ids on the victim when it died
    refetched: list[str] = field(default_factory=list)
    recomputed: list[str] = field(default_factory=list)

    @property
    def injected(self) -> bool:
        return self.killed_at_s is not None


def choose_victim(roles: dict[int, Policy], decoding: dict[int, int]) -> int | None:
    """The live decode-capable worker with the most generating requests (``decoding``: worker -> count)."""
    candidates = [i for i, role in roles.items() if role in DECODE_ROLES]
    if not candidates:
        return None
    return max(candidates, key=lambda i: (decoding.get(i, 0), i))


def recovery_report(log: FaultLog | None, rows: list[dict]) -> dict | None:
    """The summary's ``fault`` block, or None when no fault was asked for."""
    if log is None:
        return None
    out = {"fault": str(log.spec), "injected": log.injected, "victim_worker": log.victim,
           "requests_lost": sum(1 for r in rows if r["lost"]),
           "requests_recomputed": sum(r["recomputed"] for r in rows),
           "requests_recomputed_by_fault": len(log.recomputed), "requests_refetched": len(log.refetched),
           "requests_interrupted": len(log.interrupted), "killed_at_s": log.killed_at_s,
           "detected_after_s": None, "replacement_ready_s": None, "recovery_s": None}
    if not log.injected:
        out["note"] = "the run ended before the fault time; nothing was killed"
        return out
    if log.detected_at_s is not None:
        out["detected_after_s"] = round(log.detected_at_s - log.killed_at_s, 6)
    if log.replacement_ready_at_s is not None:
        out["replacement_ready_s"] = round(log.replacement_ready_at_s - log.killed_at_s, 6)
    by_id = {r["id"]: r for r in rows}
    firsts = [by_id[rid]["token_times_s"][0] for rid in log.interrupted
              if rid in by_id and by_id[rid]["token_times_s"]]
    out["recovery_s"] = round(max(firsts) - log.killed_at_s, 6) if firsts else 0.0
    return out
