"""RouterConfig: the router's pools, budgets and deadlines, validated once at start."""

from __future__ import annotations

import dataclasses
from enum import Enum
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from kvstore.router.plan import RouterPlan


class AdmissionKind(Enum):
    NONE = "none"  # every request goes at once to the least-loaded instance
    BUDGET = "budget"  # two queues held against the TTFT and TPOT budgets; 429 when a budget cannot be met


INTERACTIVE, BACKGROUND = "interactive", "background"
REQUEST_CLASSES = (INTERACTIVE, BACKGROUND)
#: The header that names a request's class (default interactive).
CLASS_HEADER = "X-Request-Class"


def instance_url(url: str) -> str:
    """``http(s)://host:port`` of a vLLM OpenAI server, without a trailing slash; ValueError otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"instance URL must be http://host:port, got {url!r}")
    return url.rstrip("/")


def parse_listen(listen: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) into (host, port); ValueError otherwise."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"--listen must be HOST:PORT, got {listen!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


@dataclasses.dataclass(frozen=True, slots=True)
class RouterConfig:
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    colocated: tuple[str, ...] = ()
    #: The kvstore daemon the instances share (unix:// or tcp://); None: its health is not checked.
    store: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    admission: AdmissionKind = AdmissionKind.NONE
    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.2
    #: A background request waits at most this long for slack before it is shed (default: 10 x the TTFT SLO).
    background_max_wait_s: float | None = None
    #: Deadlines of the hops: connecting, the whole prefill hop, the whole decode hop, and the longest silence
    #: between two bytes of a response (a stuck instance costs at most this, then the hop fails).
    connect_timeout_s: float = 5.0
    prefill_timeout_s: float = 120.0
    decode_timeout_s: float = 900.0
    idle_timeout_s: float = 120.0
    health_interval_s: float = 2.0
    #: Consecutive failures (requests or health checks) that eject an instance until a health check passes.
    eject_after: int = 2
    #: Prompts shorter than this skip the prefill pool (None: the plan's rule if there is a plan, else computed
    #: from the measured costs, see kvstore.router.estimates.handoff_threshold).
    skip_prefill_below: int | None = None
    #: Prompts of which the store holds at least this fraction (leading blocks) skip the prefill pool (None: the
    #: plan's exact rule if there is a plan and no skip_prefill_below, else "the tokens the store lacks are
    #: fewer than the short-prompt threshold"). Needs ``store``.
    skip_prefill_hit: float | None = None
    #: ``kvstore router --plan PATH``: the planner's skip rule (its budgets are already in slo_ttft_s/slo_tpot_s).
    plan: RouterPlan | None = None
    #: Prefill instances tried for one request before it falls back to a colocated request on the decode pool.
    prefill_attempts: int = 2
    #: Requests waiting in one admission queue beyond which new ones are shed at once.
    max_queue: int = 1024

    def __post_init__(self) -> None:
        for name in ("prefill", "decode", "colocated"):
            object.__setattr__(self, name, tuple(instance_url(u) for u in getattr(self, name)))
        if bool(self.prefill) != bool(self.decode):
            raise ValueError("--prefill and --decode come together (a hand-off needs both pools)")
        if not (self.decode or self.colocated):
            raise ValueError("give --prefill and --decode instances, or --colocated ones")
        for name in ("slo_ttft_s", "slo_tpot_s", "connect_timeout_s", "prefill_timeout_s", "decode_timeout_s",
                     "idle_timeout_s", "health_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RouterConfig.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("eject_after", "prefill_attempts", "max_queue"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"RouterConfig.{name} must be an int >= 1, got {getattr(self, name)!r}")
        if self.skip_prefill_below is not None and self.skip_prefill_below < 0:
            raise ValueError(f"RouterConfig.skip_prefill_below must be >= 0, got {self.skip_prefill_below!r}")
        hit = self.skip_prefill_hit
        if hit is not None and not (isinstance(hit, (int, float)) and 0 < hit <= 1):
            raise ValueError(f"RouterConfig.skip_prefill_hit must be in (0, 1], got {hit!r}")
        if not isinstance(self.admission, AdmissionKind):
            raise TypeError(f"RouterConfig.admission must be an AdmissionKind, got {self.admission!r}")

    @property
    def max_wait_s(self) -> float:
        return self.background_max_wait_s if self.background_max_wait_s is not None else 10 * self.slo_ttft_s
