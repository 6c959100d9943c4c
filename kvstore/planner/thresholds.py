"""When a request should skip the prefill pool: the router's two thresholds, from the planner's cost model.

A disaggregated fleet can serve a request two ways. *Hand-off*: a prefill worker computes the prompt's
KV and the decode worker pulls all of it over the link. *Recompute*: the decode worker prefills the prompt
itself, inside one of its decode steps, first loading whatever prefix the store already holds. Per the
decode worker (whose time is what the TPOT budget protects) the costs are::

    hand-off  = transfer(n)                            = latency + n * kv_bytes / bandwidth
    recompute = fetch(c) + marginal(n - c | c cached)  fetch(0) = 0, else latency + c * kv_bytes / bandwidth

where ``marginal`` is what the prompt's ``n - c`` missing tokens add to a reference decode step
(``decode_batch`` sequences of ``decode_context`` tokens): :meth:`CostModel.step_s` with and without
them. On a GPU the first prompt tokens of a step ride under its weight reads (``overlap``), so a short
prompt costs the decode worker almost nothing while its transfer still pays the link's latency. The
request is recomputed when ``recompute <= hand-off`` (equal costs: move nothing). Two numbers summarise
the rule for a router:

- ``min_prefill_tokens``: with nothing cached, prompts shorter than this are recomputed (None: the
  transfer never wins up to the model's context, e.g. over 10 GbE, where a token's KV takes longer to send
  than to compute);
- ``skip_hit_fraction``: at ``reference_prompt_tokens``, the share of the prompt found in the store at or
  above which the prefill pool is skipped (the fetch's latency then appears on both sides and cancels).

:meth:`HandoffThresholds.skip_prefill` applies the exact rule to any (prompt, cached) pair.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.planner import presets
from kvstore.planner.costmodel import CostModel, TransferModel, min_tp, prefill_pairs
from kvstore.planner.specs import Efficiency, GPUSpec, LinkSpec, ModelSpec

MIN_KV_TOKENS = 32768  # as kvstore.planner.plan: the auto tp keeps this much KV room per worker


@dataclass(frozen=True, slots=True)
class HandoffThresholds:
    """The router's skip-the-prefill-pool rule (see the module docstring). Token counts are prompt
    tokens; ``cost`` and ``transfer`` are the decode worker's step model and the prefill->decode link."""

    min_prefill_tokens: int | None
    skip_hit_fraction: float
    reference_prompt_tokens: int
    cost: CostModel
    transfer: TransferModel
    decode_batch: int
    decode_context: int
    max_prompt_tokens: int

    def recompute_s(self, prompt_tokens: int, cached_tokens: int = 0) -> float:
        """Seconds the decode worker spends loading ``cached_tokens`` from the store and computing the rest."""
        _check_counts(prompt_tokens, cached_tokens)
        missing = prompt_tokens - cached_tokens
        ctx = self.decode_batch * self.decode_context
        base = self.cost.step_s(decode_seqs=self.decode_batch, decode_ctx=ctx)
        with_prompt = self.cost.step_s(decode_seqs=self.decode_batch, decode_ctx=ctx, prefill_tokens=missing,
                                       prefill_pair_count=prefill_pairs(missing, cached_tokens))
        fetch = self.transfer.time_s(cached_tokens * self.cost.kv_bytes_per_token) if cached_tokens else 0.0
        return fetch + (with_prompt - base)

    def handoff_s(self, prompt_tokens: int) -> float:
        """Seconds of link time to move the whole prompt's KV from a prefill worker."""
        _check_counts(prompt_tokens, 0)
        return self.transfer.time_s(prompt_tokens * self.cost.kv_bytes_per_token)

    def skip_prefill(self, prompt_tokens: int, cached_tokens: int = 0) -> bool:
        """True when the decode worker should compute the prompt itself (no prefill pool, no hand-off)."""
        return self.recompute_s(prompt_tokens, cached_tokens) <= self.handoff_s(prompt_tokens)

    def to_dict(self) -> dict:
        """JSON-ready; :meth:`from_dict` rebuilds it (a router reading ``--router-config`` gets the exact rule)."""
        return {"min_prefill_tokens": self.min_prefill_tokens, "skip_hit_fraction": self.skip_hit_fraction,
                "reference_prompt_tokens": self.reference_prompt_tokens, "decode_batch": self.decode_batch,
                "decode_context": self.decode_context, "cost_model": self.cost.name,
                "link": self.transfer.name, "max_prompt_tokens": self.max_prompt_tokens,
                "cost": self.cost.to_dict(), "transfer": self.transfer.to_dict()}

    @classmethod
    def from_dict(cls, doc: dict) -> HandoffThresholds:
        """The thresholds :meth:`to_dict` wrote (e.g. ``json.load(f)["thresholds"]`` of a router config).
        Raises ValueError if a field is missing or invalid."""
        try:
            return cls(min_prefill_tokens=doc["min_prefill_tokens"], skip_hit_fraction=float(doc["skip_hit_fraction"]),
                       reference_prompt_tokens=int(doc["reference_prompt_tokens"]),
                       cost=CostModel.from_dict(doc["cost"]), transfer=TransferModel(**doc["transfer"]),
                       decode_batch=int(doc["decode_batch"]), decode_context=int(doc["decode_context"]),
                       max_prompt_tokens=int(doc["max_prompt_tokens"]))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a handoff-thresholds document: {exc!r}") from None


def _check_counts(prompt_tokens: int, cached_tokens: int) -> None:
    for name, value in (("prompt_tokens", prompt_tokens), ("cached_tokens", cached_tokens)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    if cached_tokens > prompt_tokens:
        raise ValueError(f"cached_tokens ({cached_tokens}) cannot exceed prompt_tokens ({prompt_tokens})")


def _first_false(pred, lo: int, hi: int) -> int | None:
    """Smallest n in [lo, hi] with pred(n) False, assuming pred is True then False (None: True throughout)."""
    if pred(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if pred(mid):
            lo = mid + 1
        else:
            hi = mid
    return lo


def _resolve(model, gpu, link, tp, efficiency) -> tuple[CostModel, TransferModel, int]:
    model = presets.get_model(model) if not isinstance(model, ModelSpec) else model
    gpu = presets.get_gpu(gpu) if not isinstance(gpu, GPUSpec) else gpu
    link = presets.get_link(link) if not isinstance(link, LinkSpec) else link
    if tp is None:
        tp = 1 if (model.name, gpu.name) in presets.CALIBRATED else min_tp(model, gpu, MIN_KV_TOKENS, efficiency)
    return presets.cost_model_for(model, gpu, tp, efficiency), presets.transfer_for(link, tp), model.max_context


def handoff_thresholds(model: str | ModelSpec = "llama-3-8b", link: str | LinkSpec = "rdma-100g",
                       gpu: str | GPUSpec = "h100", *, tp: int | None = None, decode_batch: int = 16,
                       decode_context: int = 1024, reference_prompt_tokens: int = 4096,
                       efficiency: Efficiency | None = None, cost: CostModel | None = None,
                       transfer: TransferModel | None = None,
                       max_prompt_tokens: int | None = None) -> HandoffThresholds:
    """The prompt length below which a hand-off costs more than recomputing, and the store-hit fraction
    above which the prefill pool is skipped, for ``model`` on ``gpu`` with KV moving over ``link``.

    ``model``, ``gpu`` and ``link`` are preset names (``kvstore plan --list-presets``) or specs; ``tp`` is
    GPUs per worker (default: the fewest that hold the weights and 32k tokens of KV). ``cost`` and
    ``transfer`` replace the preset-derived models (e.g. a calibrated ``kvstore plan --cost-model``).
    The decode step the recompute joins has ``decode_batch`` sequences of ``decode_context`` tokens.
    Returns a :class:`HandoffThresholds`; raises ValueError for unknown presets or bad counts.

    >>> t = handoff_thresholds("llama-3-8b", "rdma-100g", "h100")
    >>> t.skip_prefill(prompt_tokens=100)          # short: recompute on the decode worker
    True
    """
    if not isinstance(decode_batch, int) or decode_batch < 0 or not isinstance(decode_context, int) \
            or decode_context < 0:
        raise ValueError(f"decode_batch and decode_context must be integers >= 0, got "
                         f"{decode_batch!r}, {decode_context!r}")
    if not isinstance(reference_prompt_tokens, int) or reference_prompt_tokens < 1:
        raise ValueError(f"reference_prompt_tokens must be a positive integer, got {reference_prompt_tokens!r}")
    derived_cost, derived_transfer, context = _resolve(model, gpu, link, tp, efficiency or Efficiency())
    cost, transfer = cost or derived_cost, transfer or derived_transfer
    limit = max_prompt_tokens or max(context, reference_prompt_tokens)
    probe = HandoffThresholds(None, 1.0, reference_prompt_tokens, cost, transfer, decode_batch,
                              decode_context, limit)
    min_tokens = _first_false(lambda n: probe.skip_prefill(n), 1, limit)
    n = reference_prompt_tokens
    # fewest cached tokens from which the rest is recomputed: more cached never makes skipping worse
    # (fewer tokens to compute and link time saved), so the predicate "hand off" is True then False
    if probe.skip_prefill(n, 0):
        hit = 0.0  # recomputed even with nothing cached
    else:
        hit = _first_false(lambda c: not probe.skip_prefill(n, c), 1, n) / n
    return HandoffThresholds(min_tokens, hit, n, cost, transfer, decode_batch, decode_context, limit)
