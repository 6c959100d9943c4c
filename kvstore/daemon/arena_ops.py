"""ArenaOps: the ops of same-host clients' arenas (a handler object that a
:class:`~kvstore.daemon.session.Session` owns).

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
from kvstore.daemon.context import client_of
from kvstore.errors import InvalidArgumentError
from kvstore.protocol.wire import ok_reply

if TYPE_CHECKING:
    from kvstore.daemon.context import SessionContext
    from kvstore.daemon.session import Handler
    from kvstore.daemon.ucx_ops import UcxOps


class ArenaOps:
    """``arena``, ``arena_release``, ``arena_commit``; a commit that also names pending puts waits for their UCX
    payloads through ``ucx``."""

    def __init__(self, session: SessionContext, ucx: UcxOps):
        self.s, self.ucx = session, ucx

    def handlers(self) -> dict[str, Handler]:
        return {"arena": self.op_arena, "arena_release": self.op_arena_release,
                "arena_commit": self.op_arena_commit}

    async def op_arena(self, rid: int, f: dict[str, Any]) -> dict[str, Any]:
        s = self.s
        s.require_shm()
        most = s.ctx.config.arena_size
        if max(f["size"], f["need"]) > most:
            raise InvalidArgumentError(f"arena of {max(f['size'], f['need'])} bytes asked for; this daemon "
                                       f"grants at most {most} (--arena-size)")
        if f["retire"]:
            s.master.release_arenas(client_of(s), f["retire"])
        arena = s.master.grant_arena(client_of(s), f["size"] or most, f["need"])
        [(offset, size)] = arena.blocks.items()
        return ok_reply(rid, arena=arena.id, segment=arena.segment, offset=offset, size=size,
                        alignment=s.master.allocators[arena.segment].alignment)

    async def op_arena_release(self, rid: int, f: dict[str, Any]) -> dict[str, Any]:
        return ok_reply(rid, freed=self.s.master.release_arenas(client_of(self.s), f["arenas"]))

    async def op_arena_commit(self, rid: int, f: dict[str, Any]) -> dict[str, Any]:
        s = self.s
        s.require_shm()
        entries: list[ArenaPut | tuple[int, int | None]] = []
        for e in f["entries"]:
            if "arena" in e:
                entries.append(ArenaPut(e["arena"], e["offset"], ObjectMeta.from_wire(e["meta"]), e["checksum"]))
            else:
                entries.append((e["put_id"], e["checksum"]))
        pending = [e[0] for e in entries if isinstance(e, tuple)]
        if pending:
            await self.ucx.landed(pending)
        replicas = s.master.commit_arena(client_of(s), entries, if_absent=f["if_absent"], pin=f["pin"],
                                         ephemeral=f["ephemeral"])
        s.metrics.bytes_in(sum(r.size for r in replicas))
        return ok_reply(rid, versions=[r.meta.version for r in replicas], created=[r.meta.created for r in replicas])
