"""A planner's router configuration (``kvstore plan --search --router-config PATH``) read by ``kvstore router
--plan PATH``: the SLO budgets and the skip-the-prefill-pool rule of the planner's cost model.

The rule is :class:`kvstore.planner.thresholds.HandoffThresholds`, rebuilt from the file's ``thresholds``: a
prompt with nothing in the store skips the prefill pool when ``prompt_tokens < min_prefill_tokens``; with
``--store`` the router also asks what the store holds of a prompt and applies ``skip_prefill(prompt, held)``
(kvstore.router.router.Router.skips_held)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from kvstore.errors import InvalidArgumentError
from kvstore.planner.thresholds import HandoffThresholds

#: Where the short-prompt threshold in force came from (``/health``, ``kvstore_router_skip_prefill_source``).
SOURCE_OPTION, SOURCE_PLAN, SOURCE_ESTIMATE = "option", "planner", "estimate"
SOURCES = (SOURCE_OPTION, SOURCE_PLAN, SOURCE_ESTIMATE)


class PlanFileError(InvalidArgumentError):
    """The ``--plan`` file cannot be read or is not a router configuration written by ``kvstore plan``."""


@dataclass(frozen=True, slots=True)
class RouterPlan:
    path: str
    slo_ttft_s: float
    slo_tpot_s: float
    thresholds: HandoffThresholds
    #: Pool sizes the planner chose (compared with the instances given; None: the file does not say).
    prefill: int | None = None
    decode: int | None = None

    def skip_prefill(self, prompt_tokens: int) -> bool:
        """The planner's rule for a prompt of which nothing is known to be in the store."""
        return self.thresholds.skip_prefill(prompt_tokens, 0)

    def threshold(self) -> int | None:
        """Prompts shorter than this skip the prefill pool (None: every prompt does)."""
        return self.thresholds.min_prefill_tokens

    def describe(self) -> dict:
        t = self.thresholds
        return {"path": self.path, "skip_prefill_below_tokens": t.min_prefill_tokens,
                "skip_prefill_hit_fraction": t.skip_hit_fraction, "cost_model": t.cost.name, "link": t.transfer.name,
                "slo_ttft_s": self.slo_ttft_s, "slo_tpot_s": self.slo_tpot_s,
                "prefill": self.prefill, "decode": self.decode}


def load_plan(path: str) -> RouterPlan:
    """The router configuration at ``path``; PlanFileError (naming the file and the problem) otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as exc:
        raise PlanFileError(f"--plan {path}: cannot read it: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlanFileError(f"--plan {path}: not JSON ({exc})") from None
    try:
        return _parse(path, doc)
    except ValueError as exc:
        raise PlanFileError(f"--plan {path}: {exc} (write it with `kvstore plan --search --router-config "
                            f"PATH`)") from None


def _parse(path: str, doc: object) -> RouterPlan:
    if not isinstance(doc, dict):
        raise ValueError(f"a router configuration is a JSON object, got {type(doc).__name__}")
    if not isinstance(doc.get("thresholds"), dict):
        raise ValueError("no 'thresholds' object")
    try:
        thresholds = HandoffThresholds.from_dict(doc["thresholds"])
    except (TypeError, KeyError, AttributeError) as exc:  # from_dict names most problems; these are the rest
        raise ValueError(f"'thresholds' is not a handoff-thresholds document: {exc!r}") from None
    low = thresholds.min_prefill_tokens
    if low is not None and not (isinstance(low, int) and not isinstance(low, bool) and low >= 1):
        raise ValueError(f"thresholds.min_prefill_tokens must be null or an integer >= 1, got {low!r}")
    if "skip_prefill_below_tokens" in doc and doc["skip_prefill_below_tokens"] != low:
        # the summary and the exact rule disagree: the file was edited by hand in one place only
        raise ValueError(f"skip_prefill_below_tokens ({doc['skip_prefill_below_tokens']!r}) differs from "
                         f"thresholds.min_prefill_tokens ({low!r})")
    counts = {k: _count(doc, k) for k in ("prefill", "decode")}
    return RouterPlan(path, _budget(doc, "slo_ttft"), _budget(doc, "slo_tpot"), thresholds, **counts)


def _budget(doc: dict, key: str) -> float:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"'{key}' must be a number of seconds > 0, got {value!r}")
    return float(value)


def _count(doc: dict, key: str) -> int | None:
    value = doc.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"'{key}' must be a worker count >= 0, got {value!r}")
    return value
