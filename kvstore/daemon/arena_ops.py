"""ArenaOps: the ops of same-host clients' arenas (mixed into :class:`~kvstore.daemon.session.Session`).

A shm client asks once for an arena (``arena``), allocates from it locally, copies its bytes into the mapped
segment, and makes them visible with one ``arena_commit`` (which may also commit pending region puts, all or
nothing, in order): a put is one copy and one round trip. The space rules are the master's
(:mod:`kvstore.core.arena`); the arena goes with the session like the client's other holds (freed, or
quarantined while its process lives).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstore.core.arena import ArenaPut
from kvstore.core.meta import ObjectMeta
from kvstore.errors import InvalidArgumentError

if TYPE_CHECKING:
    from kvstore.core.master import Master
    from kvstore.daemon.context import DaemonContext


class ArenaOps:
    # provided by Session
    ctx: DaemonContext
    master: Master
    client: int | None

    def arena_handlers(self) -> dict:
        return {"arena": self.op_arena, "arena_release": self.op_arena_release,
                "arena_commit": self.op_arena_commit}

    async def op_arena(self, rid: int, f: dict) -> dict:
        self._require_shm()
        most = self.ctx.config.arena_size
        if max(f["size"], f["need"]) > most:
            raise InvalidArgumentError(f"arena of {max(f['size'], f['need'])} bytes asked for; this daemon "
                                       f"grants at most {most} (--arena-size)")
        if f["retire"]:
            self.master.release_arenas(self.client, f["retire"])
        arena = self.master.grant_arena(self.client, f["size"] or most, f["need"])
        [(offset, size)] = arena.blocks.items()
        return self._ok(rid, arena=arena.id, segment=arena.segment, offset=offset, size=size,
                        alignment=self.master.allocators[arena.segment].alignment)

    async def op_arena_release(self, rid: int, f: dict) -> dict:
        return self._ok(rid, freed=self.master.release_arenas(self.client, f["arenas"]))

    async def op_arena_commit(self, rid: int, f: dict) -> dict:
        self._require_shm()
        entries: list[Any] = []
        for e in f["entries"]:
            if "arena" in e:
                entries.append(ArenaPut(e["arena"], e["offset"], ObjectMeta.from_wire(e["meta"]), e["checksum"]))
            else:
                entries.append((e["put_id"], e["checksum"]))
        pending = [e[0] for e in entries if isinstance(e, tuple)]
        if pending:
            await self._landed(pending)
        replicas = self.master.commit_arena(self.client, entries, if_absent=f["if_absent"], pin=f["pin"],
                                            ephemeral=f["ephemeral"])
        self.metrics.bytes_in(sum(r.size for r in replicas))
        return self._ok(rid, versions=[r.meta.version for r in replicas], created=[r.meta.created for r in replicas])
