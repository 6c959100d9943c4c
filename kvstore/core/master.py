"""Master: the store's metadata, as pure logic (no I/O, no payload bytes).

Key -> replica (segment, offset, length, state). Two-phase puts (PENDING -> COMPLETE), read leases, pins,
TTLs, eviction between a high and a low watermark behind a small policy interface, and client liveness
(a client that goes away loses its pending puts and its leases; with ``quarantine`` their space stays taken
until ``release_quarantine``, for a client whose process may still touch it), and per-client limits
(:class:`~kvstore.core.quota.ClientQuota`). When the free space is enough for a put but split in pieces, a
master given a ``mover`` relocates a few unheld objects of a host segment to join them
(:mod:`kvstore.core.relocation`) before it evicts anything. Callers serialise access (the daemon runs
it on one event loop; the embedded store holds a lock).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from kvstore.core.allocator import Allocator
from kvstore.core.arena import Arena, ArenaLedger, ArenaPut
from kvstore.core.meta import ObjectMeta
from kvstore.core.quota import ClientQuota
from kvstore.core.relocation import open_extent
from kvstore.errors import (
    InvalidArgumentError,
    KeyExistsError,
    KeyNotFoundError,
    LeaseError,
    ObjectBusyError,
    ObjectTooLargeError,
    StoreFullError,
)


class ReplicaState(Enum):
    PENDING = "pending"
    COMPLETE = "complete"


class Tier(Enum):
    """The kind of memory a segment is. Each tier has its own capacity, watermarks and eviction: a put names
    the tier it needs, and only objects of that tier make room for it."""

    HOST = "host"  # shared host memory (the shm segments)
    GPU = "gpu"  # device memory of the daemon's GPU (exported to same-host clients by CUDA IPC)


@dataclass(slots=True, eq=False)
class Replica:
    id: int
    meta: ObjectMeta
    segment: int
    offset: int
    reserved: int
    client: int
    state: ReplicaState = ReplicaState.PENDING
    pinned: bool = False
    if_absent: bool = False
    ephemeral: bool = False  # removed when the client that put it goes away
    expires_at: float | None = None
    leases: int = 0
    held: int = 0  # quarantine holds: a revoked client's process may still touch this space
    live: bool = False  # the key's visible version
    created: float = field(default_factory=time.monotonic)

    @property
    def key(self) -> str:
        return self.meta.key

    @property
    def size(self) -> int:
        return self.meta.size


@dataclass(slots=True, eq=False)
class Lease:
    id: int
    replica: Replica
    client: int


class EvictionPolicy(Protocol):
    """Orders evictable keys. The master tells it about accesses; it proposes victims, oldest first."""

    def add(self, key: str) -> None: ...
    def touch(self, key: str) -> None: ...
    def discard(self, key: str) -> None: ...
    def victims(self) -> Iterator[str]: ...


class LRUPolicy:
    """Least recently used first. ``recency_hint(key)`` may report reads the master did not see (the
    daemon's shared-memory index records clients' lock-free reads) as CLOCK_MONOTONIC ns; a victim read
    more recently than the master last saw it gets a second chance."""

    def __init__(self, recency_hint: Callable[[str], int] | None = None) -> None:
        self._order: OrderedDict[str, int] = OrderedDict()
        self._hint = recency_hint

    def add(self, key: str) -> None:
        self._order[key] = time.monotonic_ns()
        self._order.move_to_end(key)

    def touch(self, key: str) -> None:
        if key in self._order:
            self._order[key] = time.monotonic_ns()
            self._order.move_to_end(key)

    def discard(self, key: str) -> None:
        self._order.pop(key, None)

    def victims(self) -> Iterator[str]:
        for key, seen in list(self._order.items()):
            if self._hint is not None and key in self._order:
                read = self._hint(key)
                if read > seen:
                    self._order[key] = read
                    self._order.move_to_end(key)
                    continue
            yield key


class MasterListener(Protocol):
    """Told when a version becomes visible or stops being visible, and around a relocation of a visible one:
    ``moving`` before its bytes are copied (``replica.offset`` still the old place: stop lock-free readers from
    trusting it), ``moved`` after (``replica.offset`` the new place, its bytes already there)."""

    def published(self, replica: Replica) -> None: ...
    def unpublished(self, replica: Replica) -> None: ...
    def moving(self, replica: Replica) -> None: ...
    def moved(self, replica: Replica) -> None: ...


#: ``mover(segment, src, dst, nbytes)`` copies ``nbytes`` from offset ``src`` to ``dst`` of ``segment``
#: (the two ranges may overlap: a memmove)
Mover = Callable[[int, int, int, int], None]


class _NoListener:
    def published(self, replica: Replica) -> None:
        pass

    def unpublished(self, replica: Replica) -> None:
        pass

    def moving(self, replica: Replica) -> None:
        pass

    def moved(self, replica: Replica) -> None:
        pass


@dataclass(slots=True)
class _Client:
    id: int
    name: str
    last_seen: float
    peer: str = ""  # whose sessions share its quota (one process), "" for none
    puts: set[int] = field(default_factory=set)
    leases: set[int] = field(default_factory=set)
    ephemeral: dict[str, int] = field(default_factory=dict)  # key -> replica id
    pending_bytes: int = 0
    leased: dict[int, int] = field(default_factory=dict)  # replica id -> leases on it
    leased_bytes: int = 0  # reserved bytes of the distinct replicas in ``leased``

    @property
    def held_bytes(self) -> int:
        return self.pending_bytes + self.leased_bytes


class Master:
    replica_type = Replica  # what the arena ledger builds
    #: arenas one client may hold at once (its quota bounds their bytes)
    MAX_ARENAS = ArenaLedger.MAX_ARENAS

    def __init__(self, segment_sizes: list[int], *, high_watermark: float = 0.9, low_watermark: float = 0.8,
                 policy: EvictionPolicy | None = None, alignment: int = 64,
                 clock: Callable[[], float] = time.monotonic, listener: MasterListener | None = None,
                 tiers: Sequence[Tier] | None = None, quota: ClientQuota | None = None,
                 on_evict: Callable[[Replica], None] | None = None, mover: Mover | None = None):
        """``tiers[i]`` is the memory kind of segment ``i`` (all host when omitted); ``quota`` limits each client
        (unlimited when omitted). ``on_evict(replica)`` is called for each object the cache evicts (``evict`` or
        to make room), while its bytes are still in place: the owner of the memory may copy them elsewhere (a
        disk tier demotes them). With ``mover`` (see :data:`Mover`) objects of host segments that nobody holds
        may be relocated to join free space that a put needs; without it nothing ever moves."""
        if not 0 < low_watermark <= high_watermark <= 1:
            raise ValueError(f"need 0 < low <= high <= 1, got low={low_watermark} high={high_watermark}")
        self.allocators = [Allocator(size, alignment) for size in segment_sizes]
        self.tiers = list(tiers) if tiers is not None else [Tier.HOST] * len(self.allocators)
        if len(self.tiers) != len(self.allocators) or not all(isinstance(t, Tier) for t in self.tiers):
            raise ValueError(f"need one Tier per segment: {len(self.allocators)} segments, tiers {tiers!r}")
        self._tier_segments = {t: tuple(i for i, s in enumerate(self.tiers) if s is t) for t in set(self.tiers)}
        self.capacity = sum(a.capacity for a in self.allocators)
        self.high, self.low = high_watermark, low_watermark
        self.policy: EvictionPolicy = policy or LRUPolicy()
        self.listener: MasterListener = listener or _NoListener()
        self.on_evict = on_evict
        self.mover = mover
        self.clock = clock
        self._live: dict[str, Replica] = {}
        self._pending: dict[int, Replica] = {}
        self._leases: dict[int, Lease] = {}
        self._clients: dict[int, _Client] = {}
        self._peers: dict[str, set[int]] = {}  # peer -> its registered clients (sessions)
        self._quarantine: dict[int, list[Replica]] = {}  # revoked client -> replicas it may still touch
        self.quota = quota or ClientQuota()
        self._expiry: list[tuple[float, int, str]] = []
        self._ids = itertools.count(1)
        self.evictions = 0
        self.expirations = 0
        self.unpins = 0
        self._pinned_objects = 0   # live pinned objects, and their reserved bytes
        self._pinned_bytes = 0
        self.relocations = 0
        self.relocated_bytes = 0
        self.refusals = 0  # StoreFullError raised for lack of space
        self.fill_at_first_eviction: float | None = None  # used / capacity of the tier when it first evicted
        self.fill_at_first_refusal: float | None = None  # ... when it first raised StoreFullError
        self.arenas = ArenaLedger(self)  # same-host clients' arenas (kvstore.core.arena)

    # ---- clients ------------------------------------------------------------------------------------
    def register_client(self, name: str = "", peer: str = "") -> int:
        """A new client; ``peer`` names whose clients share the quota as well as each having it (the sessions of
        one process): the limits apply to each client and to the sum over its peer's."""
        cid = next(self._ids)
        self._clients[cid] = _Client(cid, name, self.clock(), peer)
        if peer:
            self._peers.setdefault(peer, set()).add(cid)
        return cid

    def heartbeat(self, client: int) -> None:
        if client in self._clients:
            self._clients[client].last_seen = self.clock()

    def drop_client(self, client: int, *, quarantine: bool = False) -> tuple[int, int]:
        """Revoke the client's pending puts, release its leases and remove its ephemeral objects;
        returns (puts aborted, leases released). With ``quarantine`` (a client whose process is alive and maps
        the segments) the space of those puts and leased objects is not handed out again until
        ``release_quarantine(client)``: nothing can stop a live process's memcpy."""
        state = self._clients.pop(client, None)
        if state is None:
            return 0, 0
        group = self._peers.get(state.peer)
        if group is not None:
            group.discard(client)
            if not group:
                del self._peers[state.peer]
        held: list[Replica] = []
        for put_id in list(state.puts):
            if quarantine:
                replica = self._take_pending(put_id)
                replica.held += 1
                held.append(replica)
            else:
                self.abort(put_id)
        for lease_id in list(state.leases):
            if quarantine:
                replica = self._leases[lease_id].replica
                replica.held += 1
                held.append(replica)
            self.release(lease_id)
        held.extend(self.arenas.drop_arenas(client, quarantine))
        if held:
            self._quarantine.setdefault(client, []).extend(held)
        for key, rid in state.ephemeral.items():
            live = self._live.get(key)
            if live is not None and live.id == rid:
                self._unlink(live)
        return len(state.puts), len(state.leases)

    def release_quarantine(self, client: int) -> int:
        """The revoked ``client``'s process is gone: free what it held. Returns the bytes freed."""
        freed = 0
        for replica in self._quarantine.pop(client, ()):
            replica.held -= 1
            if replica.held == 0 and replica.leases == 0 and not replica.live:
                freed += replica.reserved
                self._free(replica)
        return freed

    def is_quarantined(self, client: int) -> bool:
        return client in self._quarantine

    def quarantined_bytes(self) -> int:
        unique = {r.id: r for held in self._quarantine.values() for r in held}
        return sum(r.reserved for r in unique.values())

    def silent_clients(self, timeout: float) -> list[int]:
        now = self.clock()
        return [c.id for c in self._clients.values() if now - c.last_seen > timeout]

    # ---- arenas (the ledger's, kvstore.core.arena) -----------------------------------------------------
    def grant_arena(self, client: int, nbytes: int, need: int = 0) -> Arena:
        """See :meth:`ArenaLedger.grant_arena`."""
        return self.arenas.grant_arena(client, nbytes, need)

    def release_arenas(self, client: int, arena_ids: Sequence[int]) -> int:
        """See :meth:`ArenaLedger.release_arenas`."""
        return self.arenas.release_arenas(client, arena_ids)

    def commit_arena(self, client: int, entries: Sequence[ArenaPut | tuple[int, int | None]], *,
                     if_absent: bool = False, pin: bool = False, ephemeral: bool = False) -> list[Replica]:
        """See :meth:`ArenaLedger.commit_arena`."""
        return self.arenas.commit_arena(client, entries, if_absent=if_absent, pin=pin, ephemeral=ephemeral)

    def arenas_of(self, client: int) -> list[Arena]:
        return self.arenas.arenas_of(client)

    def arena_stats(self) -> dict[str, int]:
        return self.arenas.arena_stats()

    # ---- puts ---------------------------------------------------------------------------------------
    def begin_put(self, meta: ObjectMeta, client: int, *, if_absent: bool = False, pin: bool = False,
                  ephemeral: bool = False, tier: Tier = Tier.HOST) -> Replica:
        """Reserve space for ``meta.size`` bytes in a segment of ``tier``; the result is PENDING and invisible
        until ``commit``. ``ephemeral`` objects are removed when ``client`` goes away (e.g. a producer's
        liveness claim). Eviction to make room only drops objects of the same tier."""
        if if_absent and self._lookup_live(meta.key) is not None:
            raise KeyExistsError(f"key {meta.key!r} already exists")
        segments = self._segments_of(tier)
        reserved = self.allocators[segments[0]].aligned(meta.size)
        capacity = sum(self.allocators[i].capacity for i in segments)
        if reserved > max(self.allocators[i].capacity for i in segments):
            where = "" if len(self._tier_segments) == 1 else f" ({tier.value} tier)"
            raise ObjectTooLargeError(f"value of {meta.size} bytes exceeds the store's capacity of {capacity}{where}")
        state = self._client(client)
        usage = self.usage(client)
        for who, _, held, _ in usage:
            self.quota.check_hold(who, held, reserved, "reservation")
        may_evict = all(self.quota.may_evict_for(pending + reserved) for _, pending, _, _ in usage)
        if may_evict and self._used(segments) + reserved > self.high * capacity:
            self._evict_until(int(self.low * capacity) - reserved, segments)
        found = self._allocate(meta.size, segments, evict=may_evict)
        if found is None:
            who, pending = max(((u[0], u[1]) for u in usage), key=lambda u: u[1])
            raise self.quota.refuse_eviction(who, pending, reserved)
        segment, offset = found
        replica = Replica(next(self._ids), meta, segment, offset, self.allocators[segment].size_of(offset),
                          client, pinned=pin, if_absent=if_absent, ephemeral=ephemeral)
        self._pending[replica.id] = replica
        state.puts.add(replica.id)
        state.pending_bytes += replica.reserved
        return replica

    def commit_many(self, put_ids: list[int], checksums: list[int | None]) -> list[Replica]:
        """Commit several pending puts at once, all or nothing: if one cannot commit (unknown put, or an
        ``if_absent`` key that exists), none is committed and all of them are aborted."""
        if len(put_ids) != len(checksums) or len(set(put_ids)) != len(put_ids):
            raise InvalidArgumentError(f"commit of {len(put_ids)} puts with {len(checksums)} checksums "
                                       "(or a put named twice)")
        replicas = [self.pending(pid) for pid in put_ids]
        keys = [r.key for r in replicas]
        conflict = next((r for r in replicas if r.if_absent and (self._lookup_live(r.key) is not None
                                                                 or keys.count(r.key) > 1)), None)
        if conflict is not None:
            for pid in put_ids:
                self.abort(pid)
            raise KeyExistsError(f"key {conflict.key!r} already exists; no put of the batch was committed")
        return [self.commit(pid, c) for pid, c in zip(put_ids, checksums, strict=True)]

    def commit(self, put_id: int, checksum: int | None = None) -> Replica:
        """Make a pending put the key's visible version, atomically replacing the previous one."""
        replica = self._take_pending(put_id)
        old = self._lookup_live(replica.key)
        if replica.if_absent and old is not None:
            self._free(replica)
            raise KeyExistsError(f"key {replica.key!r} was committed by another writer first")
        replica.meta = replica.meta.with_commit(replica.meta.checksum if checksum is None else checksum, replica.id)
        replica.state = ReplicaState.COMPLETE
        if replica.meta.ttl is not None:
            replica.expires_at = self.clock() + replica.meta.ttl
            heapq.heappush(self._expiry, (replica.expires_at, replica.id, replica.key))
        if old is not None:
            self._unlink(old)
        replica.live = True
        self._live[replica.key] = replica
        if replica.ephemeral and replica.client in self._clients:
            self._clients[replica.client].ephemeral[replica.key] = replica.id
        if not replica.pinned:
            self.policy.add(replica.key)
        else:
            self._pinned_objects += 1
            self._pinned_bytes += replica.reserved
        self.listener.published(replica)
        return replica

    def abort(self, put_id: int) -> None:
        self._free(self._take_pending(put_id))

    def pending(self, put_id: int) -> Replica:
        try:
            return self._pending[put_id]
        except KeyError:
            raise LeaseError(f"no pending put {put_id} (aborted, committed or revoked)") from None

    # ---- reads --------------------------------------------------------------------------------------
    def lookup(self, key: str) -> Replica:
        replica = self._lookup_live(key)
        if replica is None:
            raise KeyNotFoundError(f"key {key!r} not found")
        self.policy.touch(key)
        return replica

    def exists(self, key: str) -> bool:
        return self._lookup_live(key) is not None

    def lease(self, key: str, client: int) -> Lease:
        state = self._client(client)
        usage = self.usage(client)
        for who, _, _, leases in usage:
            self.quota.check_lease(who, leases)
        replica = self.lookup(key)
        if replica.id not in state.leased:
            for who, _, held, _ in usage:
                self.quota.check_hold(who, held, replica.reserved, f"lease of {key!r}")
            state.leased_bytes += replica.reserved
        state.leased[replica.id] = state.leased.get(replica.id, 0) + 1
        lease = Lease(next(self._ids), replica, client)
        replica.leases += 1
        self._leases[lease.id] = lease
        state.leases.add(lease.id)
        return lease

    def release(self, lease_id: int, client: int | None = None) -> None:
        """Release a lease; with ``client`` given, only that client's own lease."""
        lease = self._leases.get(lease_id)
        if lease is None or (client is not None and lease.client != client):
            raise LeaseError(f"no lease {lease_id} held by this client (already released or revoked)")
        del self._leases[lease_id]
        replica = lease.replica
        owner = self._clients.get(lease.client)
        if owner is not None:
            owner.leases.discard(lease_id)
            left = owner.leased.pop(replica.id) - 1
            if left:
                owner.leased[replica.id] = left
            else:
                owner.leased_bytes -= replica.reserved
        replica.leases -= 1
        if replica.leases == 0 and (not replica.live or self._expired(replica)):
            if replica.live:
                self._unlink(replica)
            elif not replica.held:
                self._free(replica)

    def keys(self, prefix: str = "") -> list[str]:
        return sorted(k for k, r in self._live.items() if k.startswith(prefix) and not self._expired(r))

    def touch(self, key: str, ttl: float) -> Replica | None:
        """Keep ``key`` for at least ``ttl`` more seconds: a later expiry than it has is set (never an earlier
        one; an object without a TTL keeps none), and it counts as just used for eviction. None if absent."""
        replica = self._lookup_live(key)
        if replica is None:
            return None
        until = self.clock() + ttl
        if replica.expires_at is not None and until > replica.expires_at:
            replica.expires_at = until
            heapq.heappush(self._expiry, (until, replica.id, key))  # the earlier entry is skipped by expire()
        self.policy.touch(key)
        return replica

    # ---- removal ------------------------------------------------------------------------------------
    def evict(self, key: str) -> bool:
        """Drop ``key`` as the cache would; pinned or leased objects raise ObjectBusyError."""
        replica = self._lookup_live(key)
        if replica is None:
            return False
        if replica.pinned or replica.leases or replica.held:
            raise ObjectBusyError(f"key {key!r} is {'pinned' if replica.pinned else 'leased'}; not evicted")
        self._evict_replica(replica)
        return True

    def unpin(self, key: str) -> bool:
        """Make a pinned object an ordinary cache entry again (evictable, most recently used; its TTL still
        runs). False if ``key`` is absent or not pinned."""
        replica = self._lookup_live(key)
        if replica is None or not replica.pinned:
            return False
        replica.pinned = False
        self._pinned_objects -= 1
        self._pinned_bytes -= replica.reserved
        self.policy.add(key)
        self.unpins += 1
        return True

    def remove(self, key: str) -> bool:
        """Delete ``key`` (pinned or not); a leased object raises ObjectBusyError."""
        replica = self._lookup_live(key)
        if replica is None:
            return False
        if replica.leases:
            raise ObjectBusyError(f"key {key!r} is leased ({replica.leases}); not removed")
        self._unlink(replica)
        return True

    def expire(self) -> int:
        """Drop every object whose TTL has passed (leased ones go when released). Returns how many."""
        now, dropped = self.clock(), 0
        while self._expiry and self._expiry[0][0] <= now:
            _, rid, key = heapq.heappop(self._expiry)
            replica = self._live.get(key)
            if replica is not None and replica.id == rid and not replica.leases and self._expired(replica):
                self._unlink(replica)
                self.expirations += 1
                dropped += 1
        return dropped

    # ---- stats --------------------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return sum(a.used_bytes for a in self.allocators)

    def tier_of(self, replica: Replica) -> Tier:
        return self.tiers[replica.segment]

    def stats(self) -> dict[str, Any]:
        free = sum(a.free_bytes for a in self.allocators)
        largest = max(a.largest_free() for a in self.allocators)
        return {
            "capacity_bytes": self.capacity, "used_bytes": self.used_bytes, "objects": len(self._live),
            "pending": len(self._pending), "leases": len(self._leases), "evictions": self.evictions,
            "expirations": self.expirations, "clients": len(self._clients),
            "pinned_objects": self._pinned_objects, "pinned_bytes": self._pinned_bytes, "unpins": self.unpins,
            "relocations": self.relocations, "relocated_bytes": self.relocated_bytes, "refusals": self.refusals,
            "fill_at_first_eviction": self.fill_at_first_eviction, "fill_at_first_refusal": self.fill_at_first_refusal,
            "quarantined_bytes": self.quarantined_bytes(), "quarantined_clients": len(self._quarantine),
            "free_bytes": free, "largest_free_bytes": largest,
            "fragmentation": 0.0 if free == 0 else round(1.0 - largest / free, 6),
            "high_watermark": self.high, "low_watermark": self.low, **self.arenas.arena_stats(),
            "tiers": {t.value: {"capacity_bytes": sum(self.allocators[i].capacity for i in segs),
                                "used_bytes": self._used(segs), "segments": list(segs)}
                      for t, segs in sorted(self._tier_segments.items(), key=lambda kv: kv[1])},
        }

    def usage(self, client: int) -> list[tuple[str, int, int, int]]:
        """What the quota is checked against: (who, pending bytes, held bytes, leases) of ``client`` and, when
        other clients share its peer, of all of them together."""
        state = self._client(client)
        mine = [(state.name or str(client), state.pending_bytes, state.held_bytes, len(state.leases))]
        group = self._peers.get(state.peer) if state.peer else None
        if group is None or len(group) < 2:
            return mine
        members = [self._clients[c] for c in group]
        return mine + [(f"peer {state.peer} ({len(members)} sessions)", sum(m.pending_bytes for m in members),
                        sum(m.held_bytes for m in members), sum(len(m.leases) for m in members))]

    # ---- internals ----------------------------------------------------------------------------------
    def _client(self, client: int) -> _Client:
        try:
            return self._clients[client]
        except KeyError:
            raise LeaseError(f"client {client} is not registered (dropped after a disconnect?)") from None

    def _expired(self, replica: Replica) -> bool:
        return replica.expires_at is not None and replica.expires_at <= self.clock()

    def _lookup_live(self, key: str) -> Replica | None:
        replica = self._live.get(key)
        if replica is not None and self._expired(replica):
            if not replica.leases:
                self._unlink(replica)
                self.expirations += 1
            return None
        return replica

    def _take_pending(self, put_id: int) -> Replica:
        replica = self.pending(put_id)
        del self._pending[put_id]
        client = self._clients.get(replica.client)
        if client is not None:
            client.puts.discard(put_id)
            client.pending_bytes -= replica.reserved
        return replica

    def host_segments(self) -> tuple[int, ...]:
        return self._segments_of(Tier.HOST)

    def _segments_of(self, tier: Tier) -> tuple[int, ...]:
        try:
            return self._tier_segments[tier]
        except KeyError:
            raise InvalidArgumentError(f"this store holds no {tier.value} memory (its tiers: "
                                       f"{sorted(t.value for t in self._tier_segments)})") from None

    def _used(self, segments: Sequence[int]) -> int:
        return sum(self.allocators[i].used_bytes for i in segments)

    #: relocation attempts per allocation (each plans over the segment's blocks, O(n log n)): one before
    #: evicting anything, the rest after evictions freed enough bytes in pieces
    RELOCATE_TRIES = 3
    #: while an eviction could make room instead, pack at most this many times the request's bytes (a cache
    #: would rather drop its least recently used object than copy ten times the put); with nothing left to
    #: evict, any amount is packed before a put is refused
    PACK_FACTOR = 4
    #: a segment of more blocks than this is not planned over (evicted instead): planning is a Python loop of
    #: about 1.5 us a block, so this bounds one attempt near 25 ms
    RELOCATE_MAX_BLOCKS = 1 << 14

    def _allocate(self, nbytes: int, segments: Sequence[int], *, evict: bool = True) -> tuple[int, int] | None:
        """(segment, offset); without ``evict``, None when the free space does not fit even after relocating.
        Order: a free extent; else relocate unheld objects to join free pieces (no data lost); else evict."""
        tries = self.RELOCATE_TRIES
        while True:
            for segment in segments:
                offset = self.allocators[segment].allocate(nbytes)
                if offset is not None:
                    return segment, offset
            if tries and self._relocate_for(nbytes, segments, self.PACK_FACTOR * nbytes):
                tries -= 1
                continue
            if evict and self._evict_one(segments, room_for=nbytes):
                continue
            # nothing (more) to evict: moving any amount of bytes beats refusing
            if self._relocate_for(nbytes, segments, None):
                continue
            if not evict:
                return None
            self.refusals += 1
            if self.fill_at_first_refusal is None:
                self.fill_at_first_refusal = round(self._used(segments) / sum(self.allocators[i].capacity
                                                                             for i in segments), 6)
            raise StoreFullError(self._full_message(nbytes, segments))

    def _relocate_for(self, nbytes: int, segments: Sequence[int], max_pack: int | None) -> bool:
        """Open an extent of ``nbytes`` in one host segment whose free bytes would hold it, by moving objects
        (packing at most ``max_pack`` bytes; None: any)."""
        if self.mover is None:
            return False
        for segment in segments:
            allocator = self.allocators[segment]
            if (self.tiers[segment] is not Tier.HOST or allocator.free_bytes < allocator.aligned(nbytes)
                    or allocator.block_count > self.RELOCATE_MAX_BLOCKS):
                continue
            movable = {r.offset: r for r in self._live.values()
                       if r.segment == segment and not r.leases and not r.held}
            if open_extent(allocator, nbytes, movable, self._move, max_pack):
                return True
        return False

    def _move(self, replica: Replica, dst: int) -> None:
        self.listener.moving(replica)
        self.mover(replica.segment, replica.offset, dst, replica.size)  # type: ignore[misc]
        replica.offset = dst
        self.relocations += 1
        self.relocated_bytes += replica.reserved
        self.listener.moved(replica)

    def _full_message(self, nbytes: int, segments: Sequence[int]) -> str:
        """Why ``nbytes`` found no room: the tier's real numbers, and only the holders that really hold space."""
        allocators = [self.allocators[i] for i in segments]
        free = sum(a.free_bytes for a in allocators)
        largest = max(a.largest_free() for a in allocators)
        need = allocators[0].aligned(nbytes)
        inside = set(segments)
        leased = {x.replica.id: x.replica for x in self._leases.values() if x.replica.segment in inside}
        held = {r.id: r for rs in self._quarantine.values() for r in rs if r.segment in inside and r.id not in leased}
        holders = {
            "leased": sum(r.reserved for r in leased.values()),
            "pinned": sum(r.reserved for r in self._live.values()
                          if r.pinned and r.segment in inside and r.id not in leased and r.id not in held),
            "in pending puts": sum(r.reserved for r in self._pending.values() if r.segment in inside),
            "quarantined": sum(r.reserved for r in held.values()),
        }
        named = ", ".join(f"{b} bytes {what}" for what, b in holders.items() if b) or "no object"
        if free < need:
            why = f"the free space is smaller than the request, and the used space cannot be evicted ({named})"
        else:
            why = (f"the free space is in pieces, between objects that cannot be evicted ({named})"
                   + ("" if self.mover is not None else " or moved (this store does not relocate objects)"))
        return (f"no room for {nbytes} bytes: {self._used(segments)} of {sum(a.capacity for a in allocators)} "
                f"bytes used, {free} free, largest free extent {largest} (fragmentation "
                f"{0.0 if not free else 1 - largest / free:.2f}); {why}")

    def _evict_until(self, target_used: int, segments: Sequence[int]) -> None:
        while self._used(segments) > target_used and self._evict_one(segments):
            pass

    #: how many of the least recently used objects an allocation looks through for one whose space, joined
    #: with the free blocks beside it, already fits the request (instead of evicting in strict LRU order
    #: until a hole big enough appears, which empties a fragmented store for one large put)
    FIT_WINDOW = 64

    def _evict_one(self, segments: Sequence[int], room_for: int | None = None) -> bool:
        """Evict one unleased, unpinned object of ``segments``: the least recently used one or, when
        ``room_for`` bytes must fit, the least recently used among the first FIT_WINDOW whose freeing
        leaves a hole that large."""
        first: Replica | None = None
        seen = 0
        for key in self.policy.victims():
            replica = self._live.get(key)
            if replica is None:
                self.policy.discard(key)
                continue
            if replica.leases or replica.held or replica.pinned or replica.segment not in segments:
                continue
            if first is None:
                first = replica
            allocator = self.allocators[replica.segment]
            seen += 1
            if room_for is None or allocator.hole_if_freed(replica.offset) >= allocator.aligned(room_for):
                first = replica
                break
            if seen >= self.FIT_WINDOW:
                break
        if first is None:
            return False
        if self.fill_at_first_eviction is None:
            self.fill_at_first_eviction = round(self._used(segments) / sum(self.allocators[i].capacity
                                                                              for i in segments), 6)
        self._evict_replica(first)
        return True

    def _evict_replica(self, replica: Replica) -> None:
        if self.on_evict is not None:
            self.on_evict(replica)
        self._unlink(replica)
        self.evictions += 1

    def _unlink(self, replica: Replica) -> None:
        """Stop showing ``replica``; free its space now, or when its last lease goes."""
        if replica.live:
            replica.live = False
            if replica.pinned:
                self._pinned_objects -= 1
                self._pinned_bytes -= replica.reserved
            if self._live.get(replica.key) is replica:
                del self._live[replica.key]
            self.policy.discard(replica.key)
            self.listener.unpublished(replica)
        if replica.leases == 0 and replica.held == 0:
            self._free(replica)

    def _free(self, replica: Replica) -> None:
        self.allocators[replica.segment].free(replica.offset)


def describe_replica(replica: Replica, now: float) -> dict[str, Any]:
    """What ``kvstore inspect`` shows for one object."""
    meta = replica.meta
    return {
        "key": meta.key, "size": meta.size, "kind": meta.kind, "dtype": meta.dtype,
        "shape": list(meta.shape) if meta.shape is not None else None,
        "checksum": f"{meta.checksum:016x}" if meta.checksum is not None else None,
        "state": replica.state.value, "version": meta.version, "leases": replica.leases, "pinned": replica.pinned,
        "age_s": round(time.time() - meta.created, 6), "ttl_s": meta.ttl,
        "expires_in_s": None if replica.expires_at is None else round(replica.expires_at - now, 6),
        "segment": replica.segment, "offset": replica.offset, "reserved": replica.reserved,
        "producer": meta.producer, "meta": meta.user,
    }
