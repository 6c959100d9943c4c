"""What the router has measured of its instances: prefill seconds per prompt token, decode step time as a
line in the batch size, and the fixed cost of a prefill hop. Admission control predicts with these; they
start from priors (options of ``kvstore router``) and follow the measurements."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(slots=True)
class Estimates:
    prefill_s_per_token: float = 1e-3
    #: step_s(batch) = step_base_s + step_per_seq_s * batch, refitted from observed token gaps.
    step_base_s: float = 0.02
    step_per_seq_s: float = 0.0
    #: A prefill hop's cost beyond computing the prompt: two HTTP round trips, scheduling, the save and load.
    hop_overhead_s: float = 0.01
    alpha: float = 0.1  # weight of one new observation in the moving averages
    # decayed sums of the step-time fit: n, batch, batch^2, step, batch*step
    _fit: tuple[float, float, float, float, float] = (0.0, 0.0, 0.0, 0.0, 0.0)

    def __post_init__(self) -> None:
        for name in ("prefill_s_per_token", "step_base_s", "hop_overhead_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"Estimates.{name} must be > 0, got {value!r}")

    def prefill_s(self, tokens: int) -> float:
        return self.prefill_s_per_token * tokens

    def step_s(self, batch: int) -> float:
        return self.step_base_s + self.step_per_seq_s * batch

    def observe_prefill(self, tokens: int, seconds: float, queued: bool) -> None:
        """A prefill hop of ``tokens`` took ``seconds``; ``queued``: others were ahead of it on the instance
        (then it says nothing about the service time)."""
        if queued or tokens <= 0 or seconds <= 0:
            return
        compute = min(seconds, self.prefill_s(tokens))
        self.hop_overhead_s = _ewma(self.hop_overhead_s, max(seconds - compute, 1e-4), self.alpha)
        self.prefill_s_per_token = _ewma(self.prefill_s_per_token, max(seconds - self.hop_overhead_s, 1e-6)
                                         / tokens, self.alpha)

    def observe_step(self, batch: int, seconds: float) -> None:
        """One output token of a request in a batch of ``batch`` decodes came ``seconds`` after the previous."""
        if batch <= 0 or not seconds > 0:
            return
        keep = 1.0 - self.alpha / 4
        n, sx, sxx, sy, sxy = (v * keep for v in self._fit)
        self._fit = (n + 1, sx + batch, sxx + batch * batch, sy + seconds, sxy + batch * seconds)
        n, sx, sxx, sy, sxy = self._fit
        spread = n * sxx - sx * sx
        if n >= 8 and spread > 1e-6 * n * n:  # batch sizes seen vary: fit the line
            slope = max((n * sxy - sx * sy) / spread, 0.0)
            self.step_per_seq_s, self.step_base_s = slope, max((sy - slope * sx) / n, 1e-4)
        else:  # one batch size so far: the level moves, the slope stays
            self.step_base_s = max(sy / n - self.step_per_seq_s * sx / n, 1e-4)

    def describe(self) -> dict:
        return {"prefill_s_per_token": self.prefill_s_per_token, "step_base_s": self.step_base_s,
                "step_per_seq_s": self.step_per_seq_s, "hop_overhead_s": self.hop_overhead_s}


def _ewma(old: float, new: float, alpha: float) -> float:
    return (1 - alpha) * old + alpha * new


def handoff_threshold(est: Estimates, block_tokens: int) -> int:
    """Prompt length below which a hand-off costs more than recomputing on the decode instance.

    A hand-off spares the decode instance the prompt's prefill (``prefill_s_per_token`` a token) and costs a
    hop (``hop_overhead_s``); below one full block the prefill instance saves nothing at all. So:
    ``max(block_tokens + 1, hop_overhead_s / prefill_s_per_token)``. (The planner's cost model can give a
    fleet-wide figure; this one follows what the router measures.)"""
    return max(block_tokens + 1, math.ceil(est.hop_overhead_s / est.prefill_s_per_token))
