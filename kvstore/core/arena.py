"""Arenas: segment space granted to a same-host client, which allocates from it locally and commits what it
wrote there in one message: the :class:`ArenaLedger` that :class:`~kvstore.core.master.Master` owns.

An arena is one or more allocator blocks of a host segment, held by one client. The space counts in the
client's pending bytes (its ``--max-pending-bytes`` / ``--max-held-bytes`` quota) until it is committed or
released. A commit names ``(arena, offset, meta)``; the range ``[offset, offset + aligned(size))`` must lie
inside one of the arena's blocks. The allocator block is split there and the committed part becomes the
object's own block: from then on it is an ordinary object (evicted, leased, indexed and freed like any
other), and the arena is smaller by that much. A range already committed is no longer the arena's, so a
second commit of it, or a commit into another client's arena, is refused (:class:`ArenaError`).

When the client goes away its arenas go with its other holds: freed, or quarantined while its process lives
(``drop_client(quarantine=True)``): a paused client may still be copying into them. Pure logic, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstore.core.meta import ObjectMeta
from kvstore.errors import ArenaError, KeyExistsError, ObjectTooLargeError, QuotaExceededError

if TYPE_CHECKING:
    from kvstore.core.master import Master, Replica, _Client


@dataclass(slots=True, eq=False)
class Arena:
    id: int
    client: int
    segment: int
    blocks: dict[int, int] = field(default_factory=dict)  # offset -> size: allocator blocks not yet committed

    @property
    def free_bytes(self) -> int:
        return sum(self.blocks.values())

    def block_holding(self, offset: int, nbytes: int) -> int | None:
        """The start of the block that holds ``[offset, offset + nbytes)`` whole, or None."""
        for start, size in self.blocks.items():
            if start <= offset and offset + nbytes <= start + size:
                return start
        return None


@dataclass(frozen=True, slots=True)
class ArenaPut:
    """One object written into an arena: what a commit names."""

    arena: int
    offset: int
    meta: ObjectMeta
    checksum: int | None


class ArenaLedger:
    """The arenas of every client: a collaborator of its :class:`~kvstore.core.master.Master`, which owns it and
    whose allocators, quota, client records, eviction and commit it uses (the master's public arena calls
    delegate here)."""

    #: arenas one client may hold at once (its quota bounds their bytes)
    MAX_ARENAS = 4

    def __init__(self, master: Master):
        self._master = master
        self._arenas: dict[int, Arena] = {}
        self._arenas_of: dict[int, set[int]] = {}

    # ---- granting and releasing ---------------------------------------------------------------------
    def grant_arena(self, client: int, nbytes: int, need: int = 0) -> Arena:
        """Reserve up to ``nbytes`` of host memory for ``client`` to allocate from itself, and at least ``need``
        (the put that asks for it). Eviction makes room for ``need`` only, as it would for that put: the arena is
        ``nbytes`` only where that much fits below the low watermark and in the client's quota, else the put's.
        QuotaExceededError past MAX_ARENAS or the client's limits."""
        m = self._master
        state = m._client(client)
        name = state.name or str(client)
        held = self._arenas_of.setdefault(client, set())
        if len(held) >= m.MAX_ARENAS:
            raise QuotaExceededError(f"arena refused: client {name} already holds {len(held)} arenas, the most "
                                     "one client may hold; release one first")
        segments = m.host_segments()
        first = m.allocators[segments[0]]
        least = first.aligned(max(need, 1))
        if least > max(m.allocators[i].capacity for i in segments):
            raise ObjectTooLargeError(f"a put of {need} bytes exceeds the store's capacity")
        usage = m.usage(client)  # the client's and its peer's
        for who, _, held_bytes, _ in usage:
            m.quota.check_hold(who, held_bytes, least, "arena")
        may_evict = all(m.quota.may_evict_for(pending + least) for _, pending, _, _ in usage)
        most_held = max(u[2] for u in usage)
        capacity = sum(m.allocators[i].capacity for i in segments)
        full = first.aligned(max(nbytes, 1))
        # a whole arena only out of free space the cache is not evicting into, in one extent (nothing is moved or
        # evicted for it); else just the put's block, placed as the put's own would be (packing mixed sizes into
        # a full cache's holes fragments it)
        whole = full > least and m._used(segments) + full <= m.low * capacity \
            and max(m.allocators[i].largest_free() for i in segments) >= full and not (
            m.quota.max_held_bytes is not None and most_held
            and most_held + full > m.quota.max_held_bytes)
        if may_evict and m._used(segments) + least > m.high * capacity:
            m._evict_until(int(m.low * capacity) - least, segments)
        found = m._allocate(full, segments, evict=False) if whole else None
        if found is None:
            found = m._allocate(least, segments, evict=may_evict)
        if found is None:
            who, pending = max(((u[0], u[1]) for u in usage), key=lambda u: u[1])
            raise m.quota.refuse_eviction(who, pending, least)
        segment, offset = found
        size = m.allocators[segment].size_of(offset)
        arena = Arena(next(m._ids), client, segment, {offset: size})
        self._arenas[arena.id] = arena
        held.add(arena.id)
        state.pending_bytes += size
        return arena

    def release_arenas(self, client: int, arena_ids: Sequence[int]) -> int:
        """Free what is left of ``client``'s arenas ``arena_ids`` (the client no longer writes into them);
        returns the bytes freed. ArenaError (nothing freed) if one is not the client's."""
        m = self._master
        arenas = [self._own_arena(client, aid) for aid in set(arena_ids)]
        state = m._clients.get(client)
        freed = 0
        for arena in arenas:
            for offset in arena.blocks:
                freed += m.allocators[arena.segment].free(offset)
            self._forget_arena(arena)
        if state is not None:
            state.pending_bytes -= freed
        return freed

    # ---- committing ---------------------------------------------------------------------------------
    def commit_arena(self, client: int, entries: Sequence[ArenaPut | tuple[int, int | None]], *,
                     if_absent: bool = False, pin: bool = False, ephemeral: bool = False) -> list[Replica]:
        """Make objects written into ``client``'s arenas (``ArenaPut``) and pending puts of ``client`` (``(put_id,
        checksum)``) visible, in order, all or nothing. Before anything changes it checks every range (ArenaError),
        every pending put, and ``if_absent`` (KeyExistsError): a refused commit leaves arenas, pending puts and
        stored objects as they were."""
        m = self._master
        self._check_entries(client, entries, if_absent)
        state = m._client(client)
        out = []
        for entry in entries:
            if isinstance(entry, ArenaPut):
                replica = self._carve(state, entry, pin=pin, if_absent=if_absent, ephemeral=ephemeral)
                out.append(m.commit(replica.id, entry.checksum))
            else:
                out.append(m.commit(entry[0], entry[1]))
        return out

    def _check_entries(self, client: int, entries: Sequence[ArenaPut | tuple[int, int | None]],
                       if_absent: bool) -> None:
        m = self._master
        taken: dict[int, list[tuple[int, int]]] = {}  # arena -> ranges named in this commit
        keys: list[str] = []
        strict: list[bool] = []
        for entry in entries:
            if isinstance(entry, ArenaPut):
                arena = self._own_arena(client, entry.arena)
                allocator = m.allocators[arena.segment]
                nbytes = allocator.aligned(entry.meta.size)
                if entry.offset % allocator.alignment or arena.block_holding(entry.offset, nbytes) is None:
                    raise ArenaError(f"put of {entry.meta.key!r}: [{entry.offset}, +{nbytes}) is not free space of "
                                     f"arena {arena.id} (outside it, or already committed); nothing was stored")
                mine = taken.setdefault(arena.id, [])
                if any(entry.offset < o + n and o < entry.offset + nbytes for o, n in mine):
                    raise ArenaError(f"put of {entry.meta.key!r}: [{entry.offset}, +{nbytes}) overlaps another "
                                     f"object of the same commit in arena {arena.id}; nothing was stored")
                mine.append((entry.offset, nbytes))
                keys.append(entry.meta.key)
                strict.append(if_absent)
            else:
                replica = m.pending(entry[0])
                if replica.client != client:
                    raise ArenaError(f"put {entry[0]} belongs to another client; nothing was stored")
                keys.append(replica.key)
                strict.append(replica.if_absent)
        for key, must_be_new in zip(keys, strict, strict=True):
            if must_be_new and (m._lookup_live(key) is not None or keys.count(key) > 1):
                raise KeyExistsError(f"key {key!r} already exists; no put of the commit was made visible")

    def _carve(self, state: _Client, entry: ArenaPut, *, pin: bool, if_absent: bool, ephemeral: bool) -> Replica:
        """Hand ``entry``'s range over from its arena to a new pending put of the client (checked before)."""
        m = self._master
        arena = self._arenas[entry.arena]
        allocator = m.allocators[arena.segment]
        nbytes = allocator.aligned(entry.meta.size)
        start = arena.block_holding(entry.offset, nbytes)
        if start is None:  # _check_entries found it: only a bug gets here
            raise ArenaError(f"put of {entry.meta.key!r}: its range left arena {arena.id} during the commit")
        size = arena.blocks.pop(start)
        if entry.offset > start:
            allocator.split(start, entry.offset)
            arena.blocks[start] = entry.offset - start
        end = entry.offset + nbytes
        if end < start + size:
            allocator.split(entry.offset, end)
            arena.blocks[end] = start + size - end
        replica = m.replica_type(next(m._ids), entry.meta, arena.segment, entry.offset, nbytes, state.id,
                                    pinned=pin, if_absent=if_absent, ephemeral=ephemeral)
        m._pending[replica.id] = replica  # its bytes stay counted in the client's pending bytes until commit
        state.puts.add(replica.id)
        return replica

    # ---- clients going away -------------------------------------------------------------------------
    def drop_arenas(self, client: int, quarantine: bool) -> list[Replica]:
        """The client is revoked: free its arenas, or (``quarantine``) return holds on their blocks for the
        quarantine (released, like its other holds, by ``release_quarantine``)."""
        m = self._master
        holds = []
        for aid in self._arenas_of.pop(client, ()):
            arena = self._arenas.pop(aid)
            for offset, size in arena.blocks.items():
                if quarantine:
                    hold = ObjectMeta(f"arena/{aid}", size)
                    holds.append(m.replica_type(next(m._ids), hold, arena.segment, offset, size, client, held=1))
                else:
                    m.allocators[arena.segment].free(offset)
        return holds

    # ---- queries ------------------------------------------------------------------------------------
    def arena_stats(self) -> dict[str, int]:
        return {"arenas": len(self._arenas), "arena_bytes": sum(a.free_bytes for a in self._arenas.values())}

    def arenas_of(self, client: int) -> list[Arena]:
        return [self._arenas[a] for a in sorted(self._arenas_of.get(client, ()))]

    def _own_arena(self, client: int, arena_id: int) -> Arena:
        arena = self._arenas.get(arena_id)
        if arena is None or arena.client != client:
            raise ArenaError(f"arena {arena_id} is not held by this client (unknown, released, or another "
                             "client's); nothing was stored")
        return arena

    def _forget_arena(self, arena: Arena) -> None:
        del self._arenas[arena.id]
        held = self._arenas_of.get(arena.client)
        if held is not None:
            held.discard(arena.id)
            if not held:
                del self._arenas_of[arena.client]
