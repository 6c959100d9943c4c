"""ConnectionLimits: how many connections the daemon keeps, in total and per peer, and the deadlines that
bound what one connection can hold before it authenticates or while a transfer stalls.

A peer is a Unix-socket user (its uid, from ``SO_PEERCRED``) or a TCP address. Connections over a cap are
closed at accept with a log line naming the cap; every other connection is served as before.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

log = logging.getLogger("kvstore.daemon.limits")


@dataclass(frozen=True, slots=True)
class Limits:
    """The connection limits and deadlines of ``kvstore serve``."""

    max_connections: int = 1024
    max_connections_per_peer: int = 256
    auth_timeout: float = 5.0  # seconds a new connection has to say hello
    transfer_timeout: float = 30.0  # seconds a payload transfer may go without a byte moving

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_connections_per_peer"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("auth_timeout", "transfer_timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


class ConnectionLimits:
    """Counts open connections per peer; ``admit`` says whether one more may stay."""

    LOG_EVERY = 5.0  # seconds between refusal log lines of one kind (a flood must not flood the log)

    def __init__(self, limits: Limits):
        self.limits = limits
        self.total = 0
        self._per_peer: dict[str, int] = {}
        self._refused: dict[str, int] = {}
        self._logged: dict[str, float] = {}
        self.refusals = 0

    def admit(self, peer: str, described: str) -> bool:
        """Count a new connection of ``peer`` (``described``: for the log), or refuse it (returns False)."""
        lim = self.limits
        if self.total >= lim.max_connections:
            self._refuse("total", f"refusing connection from {described}: {self.total} connections open, the limit "
                                  f"(--max-connections {lim.max_connections})")
            return False
        mine = self._per_peer.get(peer, 0)
        if mine >= lim.max_connections_per_peer:
            self._refuse(peer, f"refusing connection from {described}: this peer ({peer}) has {mine} connections "
                               f"open, the limit (--max-connections-per-peer {lim.max_connections_per_peer})")
            return False
        self.total += 1
        self._per_peer[peer] = mine + 1
        return True

    def release(self, peer: str) -> None:
        left = self._per_peer.get(peer, 0) - 1
        if left > 0:
            self._per_peer[peer] = left
        else:
            self._per_peer.pop(peer, None)
        self.total -= 1

    def _refuse(self, kind: str, message: str) -> None:
        self.refusals += 1
        self._refused[kind] = self._refused.get(kind, 0) + 1
        now = time.monotonic()
        if now - self._logged.get(kind, 0.0) >= self.LOG_EVERY:
            self._logged[kind] = now
            more = self._refused.pop(kind) - 1
            log.warning("%s%s", message, f" ({more} more refused since the last such line)" if more else "")


class LogBudget:
    """A rate limit on one kind of log line, per source: at most ``burst`` lines every ``every`` seconds for one
    key; the lines held back are counted, and the count is told by the next line that goes out (a client that
    sends thousands of refused requests a second must not fill the disk with the daemon's log)."""

    def __init__(self, burst: int = 10, every: float = 5.0):
        self.burst, self.every = burst, every
        self._windows: dict[str, list[float]] = {}  # key -> [window start, lines logged in it, lines held back]
        self.held_back = 0

    def take(self, key: str) -> int | None:
        """None: do not log this one (it is counted); else log it, telling how many were held back before it."""
        now = time.monotonic()
        window = self._windows.get(key)
        if window is None or now - window[0] >= self.every:
            held = int(window[2]) if window is not None else 0
            if len(self._windows) > 4096:  # sources come and go: forget the quiet ones
                self._windows = {k: w for k, w in self._windows.items() if now - w[0] < self.every}
            self._windows[key] = [now, 1, 0]
            return held
        if window[1] < self.burst:
            window[1] += 1
            held, window[2] = int(window[2]), 0
            return held
        window[2] += 1
        self.held_back += 1
        return None


class AuthBackoff:
    """Failed authentications of one peer are answered later and later (``first`` seconds, doubling up to
    ``most``); a peer with no failure for ``forget`` seconds starts over. Guessing a token then costs seconds an
    attempt from each peer, not a round trip."""

    def __init__(self, first: float = 0.1, most: float = 2.0, forget: float = 60.0):
        self.first, self.most, self.forget = first, most, forget
        self._failures: dict[str, tuple[int, float]] = {}  # peer -> (failures in a row, when the last was)

    def failed(self, peer: str) -> float:
        """Count a failure of ``peer``; returns the seconds to wait before answering it."""
        now = time.monotonic()
        count, last = self._failures.get(peer, (0, now))
        count = 1 if now - last > self.forget else count + 1
        if len(self._failures) > 4096:
            self._failures = {k: v for k, v in self._failures.items() if now - v[1] <= self.forget}
        self._failures[peer] = (count, now)
        return min(self.most, self.first * 2.0 ** (count - 1))
