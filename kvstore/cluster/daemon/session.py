"""ClusterSession: one client connection of a cluster daemon. A key this node holds is served exactly as by a
single daemon; any other key is resolved through the directory (``RemoteReader.fetch``) and served
from a scratch copy leased to the client, so the client sees the same API and data paths. ``peer_get`` and
``peer_evict`` are what other members send: they act on this node's own objects only.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from kvstore.core.master import Lease
from kvstore.core.meta import ObjectMeta
from kvstore.daemon.session import _INLINE_REPLY, Handler, Session, region_entry, region_error
from kvstore.errors import KeyExistsError, KeyNotFoundError, KVStoreError, StoreConnectionError
from kvstore.protocol import wire

if TYPE_CHECKING:
    from kvstore.cluster.daemon.context import ClusterContext

#: three rounds of the daemon's index heartbeat (every 0.5 s, ``Server._housekeeping``)
INDEX_LEASE_S = 1.5


class ClusterSession(Session):
    ctx: ClusterContext

    def handlers(self) -> dict[str, Handler]:
        return {**super().handlers(), "arena_commit": self.op_arena_commit, "cuda_get": self.op_cuda_get,
                "peer_get": self.op_peer_get, "peer_evict": self.op_peer_evict}

    async def op_hello(self, rid: int, f: dict) -> dict:
        reply = await super().op_hello(rid, f)
        # A same-host reader trusts our shared-memory index only this long after our last heartbeat in it: a
        # node stopped (SIGSTOP, a long pause) hears no supersede or removal, so its index must not outlive it
        reply["index_lease_s"] = INDEX_LEASE_S
        # and even within the lease it shows what we hold, not what the directory still lists (we may not have
        # heard of a removal or a newer write elsewhere yet): a plain client asks us instead of reading it, the
        # cluster client reads it only for the version its directory lookup listed -- unless the reader can
        # see from its side that we run (our process, by /proc) and that we re-checked our entries since we
        # were last stopped (the index's stop marks): then it reads the index without a round trip
        reply["index_direct"] = False
        reply["index_gate"] = self.ctx.index_gate
        return reply

    async def _dispatch(self, message: dict) -> None:
        await self.ctx.ensure_fresh()
        await super()._dispatch(message)

    async def _synced(self, reply: dict | None) -> dict | None:
        """With ``directory_sync``, a commit is acknowledged once other nodes can find it."""
        server = self.ctx
        if reply is not None and server.cluster.directory_sync and ("version" in reply or "versions" in reply):
            await server.publisher.synced(server.cluster.peer_timeout)
        return reply

    # ---- writes -------------------------------------------------------------------------------------
    async def op_put(self, rid: int, f: dict) -> dict:
        key = f["key"]
        if f["if_absent"] and not self.ctx.local(key):
            found = await self.ctx.remote.entries([key])
            if found and found.get(key):
                raise KeyExistsError(f"key {key!r} already exists on node {found[key][0].node}")
        return await self._synced(await super().op_put(rid, f))

    async def op_commit(self, rid: int, f: dict) -> dict:
        return await self._synced(await super().op_commit(rid, f))

    async def op_commit_many(self, rid: int, f: dict) -> dict:
        return await self._synced(await super().op_commit_many(rid, f))

    async def op_arena_commit(self, rid: int, f: dict) -> dict:
        if f["if_absent"]:  # the keys of objects written into an arena, checked cluster-wide as op_put does
            keys = [e["meta"].get("key") for e in f["entries"] if "arena" in e]
            keys = [k for k in keys if isinstance(k, str) and not self.ctx.local(k)]
            found = await self.ctx.remote.entries(keys) if keys else None
            taken = next((k for k, v in (found or {}).items() if v), None)
            if taken is not None:
                raise KeyExistsError(f"key {taken!r} already exists on node {found[taken][0].node}")
        return await self._synced(await self.arena.op_arena_commit(rid, f))

    # ---- reads --------------------------------------------------------------------------------------
    async def op_get(self, rid: int, f: dict) -> dict | None:
        if self.ctx.local(f["key"]):
            return await super().op_get(rid, f)
        if f["mode"] == "region":
            self.require_shm()  # before moving any bytes
        lease, meta = await self.ctx.remote.fetch(f["key"], self.client)
        return await self._serve_lease(rid, f["mode"], lease, meta)

    async def op_get_regions(self, rid: int, f: dict) -> dict:
        """``get_many`` of a plain shm client: keys this node holds are leased in place, the others copied from
        their owners into scratch regions leased to the client (concurrently); each key gets its region or its
        error, in order, as from a single daemon."""
        keys = f["keys"]
        if all(self.ctx.local(k) for k in keys):
            return await super().op_get_regions(rid, f)
        self.require_shm()  # before moving any bytes
        local = [k for k in keys if self.ctx.local(k)]
        served = (await super().op_get_regions(rid, {**f, "keys": local}))["value"] if local else []
        by_key = dict(zip(local, served, strict=True))

        async def remote(key: str) -> dict:
            try:
                lease, meta = await self.ctx.remote.fetch(key, self.client)
            except KVStoreError as exc:
                return region_error(exc)
            return region_entry(lease, meta)

        others = [k for k in keys if k not in by_key]
        by_key.update(zip(others, await asyncio.gather(*(remote(k) for k in others)), strict=True))
        return self._ok(rid, value=[by_key[k] for k in keys])

    async def op_peer_get(self, rid: int, f: dict) -> dict | None:
        if f["key"] in self.ctx.doomed:
            raise KeyNotFoundError(f"key {f['key']!r} not found on node {self.ctx.node_id}")
        return await super().op_get(rid, f)

    async def _serve_lease(self, rid: int, mode: str, lease: Lease, meta: ObjectMeta) -> dict | None:
        replica = lease.replica
        if mode == "region":
            return self._ok(rid, meta=meta.to_wire(), segment=replica.segment, offset=replica.offset, size=meta.size,
                            lease=lease.id)
        if mode == "ucx" and meta.size > _INLINE_REPLY:
            return self.ucx.get_reply(rid, lease)  # the scratch replica carries the object's own meta
        try:
            region = self.segments[replica.segment].view(replica.offset, meta.size)
            await self._send(self._ok(rid, meta=meta.to_wire(), stream=meta.size), region)
            region.release()
        finally:
            if self.client is not None:
                self.master.release(lease.id)
        return None

    async def op_cuda_get(self, rid: int, f: dict) -> dict:
        """A cuda_ipc client's get: another node's key arrives in a host scratch region it copies from."""
        if self.ctx.local(f["key"]):
            return await self.gpu.op_cuda_get(rid, f)
        self.gpu.require_gpu()  # before any bytes move
        lease, meta = await self.ctx.remote.fetch(f["key"], self.client)
        r = lease.replica
        return self._ok(rid, meta=meta.to_wire(), segment=r.segment, offset=r.offset, size=meta.size, lease=lease.id,
                        tier=self.master.tier_of(r).value)

    async def op_lease(self, rid: int, f: dict) -> dict:
        if self.ctx.local(f["key"]):
            return await super().op_lease(rid, f)
        lease, meta = await self.ctx.remote.fetch(f["key"], self.client)
        return self._ok(rid, lease=lease.id, meta=meta.to_wire())

    async def op_exists(self, rid: int, f: dict) -> dict:
        return self._ok(rid, value=(await self._exists([f["key"]]))[0])

    async def op_batch_exists(self, rid: int, f: dict) -> dict:
        return self._ok(rid, value=await self._exists(f["keys"]))

    async def _exists(self, keys: list[str]) -> list[bool]:
        present = [self.ctx.local(k) for k in keys]
        missing = [k for k, ok in zip(keys, present, strict=True) if not ok]
        if missing:
            found = await self.ctx.remote.entries(missing) or {}
            present = [ok or bool(found.get(k)) for k, ok in zip(keys, present, strict=True)]
        return present

    async def op_touch(self, rid: int, f: dict) -> dict:
        """Our copies are kept longer; of a key held by other members only, the checksum its directory entry
        names is returned (their copies keep their own TTL)."""
        found = [self.master.touch(k, f["ttl"]) if self.ctx.local(k) else None for k in f["keys"]]
        missing = [k for k, r in zip(f["keys"], found, strict=True) if r is None]
        entries = (await self.ctx.remote.entries(missing) or {}) if missing else {}
        value = [r.meta.checksum if r is not None else _entry_checksum(entries.get(k)) for k, r
                 in zip(f["keys"], found, strict=True)]
        return self._ok(rid, value=value)

    async def op_inspect(self, rid: int, f: dict) -> dict:
        key = f["key"]
        if self.ctx.local(key):
            return await super().op_inspect(rid, f)
        entries = (await self.ctx.remote.entries([key]) or {}).get(key)
        if not entries:
            raise KeyNotFoundError(f"key {key!r} not found in the cluster")
        return self._ok(rid, value=_describe_remote(entries))

    async def op_ls(self, rid: int, f: dict) -> dict:
        import redis

        keys = set(self.master.keys(f["prefix"])) - set(self.ctx.doomed)
        try:
            keys.update(await self.ctx.directory.keys(f["prefix"], f["limit"]))
        except (redis.RedisError, OSError):
            pass  # the directory is down: list what this node holds
        keys = sorted(keys)
        page, more = wire.page_of_keys(keys, f["after"], f["limit"])
        return self._ok(rid, value=page, total=len(keys), more=more)

    # ---- removal ------------------------------------------------------------------------------------
    async def op_remove(self, rid: int, f: dict) -> dict:
        """Remove the key everywhere: our copy now (a leased copy raises ObjectBusyError), the directory
        entries now, other nodes' copies when they see the removal event (theirs go when their leases end)."""
        import redis

        key, server = f["key"], self.ctx
        removed = server.master.remove(key) if server.local(key) else False
        try:
            counts = await server.remove_everywhere([key])
        except (redis.RedisError, OSError) as exc:
            if removed:
                return self._ok(rid, value=True)
            raise StoreConnectionError(f"cannot remove {key!r} from the cluster directory: {exc}") from None
        return self._ok(rid, value=removed or counts[0] > 0)

    async def op_evict(self, rid: int, f: dict) -> dict:
        key, server = f["key"], self.ctx
        if server.local(key):
            return await super().op_evict(rid, f)
        evicted = False
        for entry in (await server.remote.entries([key]) or {}).get(key, []):
            evicted = await server.remote.evict(entry, key) or evicted
        return self._ok(rid, value=evicted)

    async def op_peer_evict(self, rid: int, f: dict) -> dict:
        if self.ctx.local(f["key"]):
            return await super().op_evict(rid, f)
        return self._ok(rid, value=False)


def _entry_checksum(entries) -> int | None:
    return entries[0].meta.checksum if entries else None


def _describe_remote(entries) -> dict:
    first, meta = entries[0], entries[0].meta
    return {
        "key": meta.key, "size": meta.size, "kind": meta.kind, "dtype": meta.dtype,
        "shape": list(meta.shape) if meta.shape is not None else None,
        "checksum": f"{meta.checksum:016x}" if meta.checksum is not None else None, "state": "complete",
        "version": meta.version, "age_s": round(time.time() - meta.created, 6), "ttl_s": meta.ttl,
        "producer": meta.producer, "meta": meta.user, "node": first.node, "addr": first.addr,
        "replicas": sorted(e.node for e in entries),
    }
