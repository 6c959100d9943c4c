"""ClientQuota: what one client may hold of a store's segment space at once (pure logic, no I/O).

Three limits, each ``None`` for unlimited (the embedded store's default):

- ``max_pending_bytes``: reserved bytes of a client's uncommitted puts that may make room by evicting others'
  committed objects. Past it a reservation may still take free space, but never evicts for it.
- ``max_held_bytes``: a client's pending bytes plus the bytes of the objects it holds leases on (one put or
  lease of any size is always allowed, so an object as large as the store can still be written and read).
  So a live but revoked client can keep at most ``max(max_held_bytes, one object)`` in quarantine
  (``kvstore.daemon.quarantine``).
- ``max_leases``: leases a client holds at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.errors import QuotaExceededError


@dataclass(frozen=True, slots=True)
class ClientQuota:
    max_pending_bytes: int | None = None
    max_held_bytes: int | None = None
    max_leases: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_pending_bytes", "max_held_bytes", "max_leases"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")

    def may_evict_for(self, pending_bytes: int) -> bool:
        """Whether a client that would then have ``pending_bytes`` pending may evict to make room."""
        return self.max_pending_bytes is None or pending_bytes <= self.max_pending_bytes

    def check_hold(self, client: str, held_bytes: int, more: int, what: str) -> None:
        """Raise QuotaExceededError when holding ``more`` bytes on top of ``held_bytes`` passes the cap."""
        cap = self.max_held_bytes
        if cap is not None and held_bytes and held_bytes + more > cap:  # one hold of any size is always allowed
            raise QuotaExceededError(f"{what} of {more} bytes refused: client {client} already holds {held_bytes} "
                                     f"bytes in pending puts and leases, and its limit is {cap} (--max-held-bytes)")

    def check_lease(self, client: str, leases: int) -> None:
        cap = self.max_leases
        if cap is not None and leases >= cap:
            raise QuotaExceededError(f"lease refused: client {client} holds {leases} leases, its limit "
                                     "(--max-leases); release some first")

    def refuse_eviction(self, client: str, pending_bytes: int, more: int) -> QuotaExceededError:
        return QuotaExceededError(
            f"reservation of {more} bytes refused: client {client} has {pending_bytes} bytes in uncommitted puts, "
            f"over its limit of {self.max_pending_bytes} (--max-pending-bytes) for puts that may evict committed "
            "data, and the free space does not fit it; commit or abort its pending puts first")
