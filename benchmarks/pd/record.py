"""What happened to one request across the whole deployment: one line of ``requests.jsonl``.

Field names, units and which times are absolute: :mod:`kvstore.workloads.runschema` (the planner reads
these logs back through it). Times are seconds since the run's start. Definitions (the same for every architecture):

- ``prefill_queue_s``: arrival -> the first step that ran any of its prompt.
- ``ttft_s``: arrival -> the first output token reaches the client. Collocated: the end of the last prefill
  step. Disaggregated: the decode worker has fetched the KV (the first token travels with the hand-off and is
  emitted by the decode worker, as in vLLM / SGLang P/D), so the hand-off and the decode queue are inside TTFT.
- ``decode_queue_s``: KV ready for decoding (collocated: prefill end, so 0; disaggregated: publish done) ->
  admitted by the decode worker.
- ``transfer_s``: publish (gather + put + commit) plus fetch (wait + get + checks + scatter); 0 collocated.
- ``kv_bytes``: bytes of the prompt's KV pages; ``kv_bytes_transferred`` is that when handed off (once more
  for every re-fetch after a decode worker died), else 0.
- A request interrupted by a dead worker is timed by the attempt that completed it (the client's stream
  restarts): re-prefilled (``recomputed``) or, disaggregated, re-fetched from the store (``refetched``).
- ``tpot_s``: (last token time - first token time) / (output tokens - 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.workloads.runschema import request_row


@dataclass(slots=True)
class RequestRecord:
    id: str
    klass: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    kv_bytes: int
    dispatch_s: float | None = None
    prefill_worker: int | None = None
    decode_worker: int | None = None
    prefill_start_s: float | None = None
    prefill_end_s: float | None = None
    decode_ready_s: float | None = None
    decode_admit_s: float | None = None
    publish_s: float = 0.0
    fetch_s: float = 0.0
    handed_off: bool = False
    token_times_s: list[float] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    attempts: int = 0
    recomputed: int = 0
    refetched: int = 0
    finished: bool = False
    lost: bool = False
    errors: list[str] = field(default_factory=list)

    def on_prefill_done(self, worker: int, r: dict) -> None:
        """From a ``finished`` (collocated) or ``handed_off`` (prefill role) report."""
        self.prefill_worker = worker
        self.prefill_start_s, self.prefill_end_s = r["prefill_start_s"], r["prefill_end_s"]
        self.publish_s = r["publish_s"]
        self.output_token_ids = list(r["output_ids"])
        self.token_times_s = list(r["token_times_s"])
        self.decode_ready_s = self.prefill_end_s + self.publish_s

    def on_handed_off(self, worker: int, r: dict) -> None:
        self.on_prefill_done(worker, r)
        self.handed_off = True

    def on_decode_done(self, worker: int, r: dict) -> None:
        self.decode_worker = worker
        self.decode_admit_s, self.fetch_s = r["admitted_s"], r["fetch_s"]
        self.output_token_ids = list(r["output_ids"])
        self.token_times_s = list(r["token_times_s"])
        self.finished = True

    def on_colocated_done(self, worker: int, r: dict) -> None:
        self.on_prefill_done(worker, r)
        self.decode_worker, self.decode_admit_s = worker, self.prefill_end_s
        self.finished = True

    def restart(self, reason: str) -> None:
        """The request starts over from prefill (hand-off failed or its worker died)."""
        self.errors.append(reason)
        self.recomputed += 1
        self.handed_off = False
        self.prefill_worker = self.decode_worker = None
        self.prefill_start_s = self.prefill_end_s = self.decode_ready_s = self.decode_admit_s = None
        self.publish_s = self.fetch_s = 0.0
        self.token_times_s, self.output_token_ids = [], []

    def refetch(self, reason: str) -> None:
        """Its decode worker died after the hand-off: decoding starts over from the store's copy of the KV."""
        self.errors.append(reason)
        self.refetched += 1
        self.decode_worker = self.decode_admit_s = None
        self.fetch_s = 0.0
        self.token_times_s, self.output_token_ids = [], self.output_token_ids[:1]

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] - self.arrival_s if self.token_times_s else None

    @property
    def tpot_s(self) -> float | None:
        n = len(self.token_times_s)
        return (self.token_times_s[-1] - self.token_times_s[0]) / (n - 1) if n > 1 else None

    def to_json(self) -> dict:
        def delta(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else round(b - a, 6)

        def r6(t: float | None) -> float | None:
            return None if t is None else round(t, 6)

        transfer = self.publish_s + self.fetch_s if self.handed_off else 0.0
        return request_row({
            "id": self.id, "class": self.klass, "arrival_s": round(self.arrival_s, 6),
            "prompt_tokens": self.prompt_tokens, "output_tokens": len(self.output_token_ids),
            "target_output_tokens": self.output_tokens, "dispatch_s": r6(self.dispatch_s),
            "prefill_worker": self.prefill_worker, "decode_worker": self.decode_worker,
            "prefill_queue_s": delta(self.arrival_s, self.prefill_start_s),
            "prefill_start_s": r6(self.prefill_start_s), "prefill_end_s": r6(self.prefill_end_s),
            "ttft_s": r6(self.ttft_s),
            "tpot_s": r6(self.tpot_s),
            "e2e_s": delta(self.arrival_s, self.token_times_s[-1] if self.token_times_s else None),
            "decode_queue_s": delta(self.decode_ready_s, self.decode_admit_s),
            "decode_admit_s": r6(self.decode_admit_s), "token_times_s": [round(t, 6) for t in self.token_times_s],
            "output_token_ids": self.output_token_ids, "kv_bytes": self.kv_bytes,
            "kv_bytes_transferred": self.kv_bytes * (1 + self.refetched) if self.handed_off else 0,
            "transfer_s": round(transfer, 6), "publish_s": round(self.publish_s, 6),
            "fetch_s": round(self.fetch_s, 6), "recomputed": self.recomputed, "refetched": self.refetched,
            "lost": self.lost,
            "errors": self.errors,
        })
