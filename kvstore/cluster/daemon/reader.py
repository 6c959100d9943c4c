"""RemoteReader: how a cluster daemon serves a key it does not hold.

One directory lookup (one Redis round trip) names the live copies; the best one (same host first, replicas in
random order, nodes that just timed out skipped) is copied straight into a *scratch* region of this daemon's
segment, on a worker thread, over the peer's shared memory or its TCP stream path. The scratch copy is
committed under a private name, leased to the reader and unlinked at once: the reader then gets it like any
local object (shared-memory region or stream), and its bytes are freed when the lease is released. It is never
published, never shown in the index and never served to anyone else, so it cannot go stale.

An owner that no longer holds the key gets its entry deleted (the second round trip, only on that miss); an
owner that cannot be reached is skipped. No copy left: KeyNotFoundError, so the caller recomputes.
"""

from __future__ import annotations

import asyncio
import logging
import random
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from kvstore.cluster.directory import Entry
from kvstore.cluster.peers import PeerPool
from kvstore.core.master import Lease
from kvstore.core.meta import ObjectMeta
from kvstore.errors import (
    AuthenticationError,
    BufferTooSmallError,
    KeyNotFoundError,
    StoreConnectionError,
    TransportError,
)

if TYPE_CHECKING:
    from kvstore.cluster.daemon.context import ClusterContext

log = logging.getLogger("kvstore.cluster")


class RemoteReader:
    def __init__(self, ctx: ClusterContext, peers: PeerPool, threads: int = 8):
        self.ctx, self.peers = ctx, peers
        self.scratch: set[int] = set()  # replica ids of scratch copies (the master hooks skip them)
        self._threads = ThreadPoolExecutor(threads, thread_name_prefix="kvstore-peer")
        self.gets = self.misses = self.compressed_gets = 0
        self._met: set[tuple[str, str]] = set()  # (node, epoch) that passed the handshake

    async def probe(self, members: dict) -> None:
        """Handshake with the members not yet met in their current boot epoch, so that one refused (another
        token, or another daemon at its address) shows in stats and metrics before a read needs it."""
        live = {(n, r.epoch) for n, r in members.items()}
        self._met &= live
        todo = [r for n, r in members.items() if n != self.ctx.node_id and (n, r.epoch) not in self._met
                and not self.peers.suspected(n, r.epoch)]

        def meet(record) -> None:
            try:
                self.peers.checkin(self.peers.checkout(record.node, record.epoch, record.addr))
            except AuthenticationError as exc:
                log.error("cluster member %s at %s refused: %s", record.node, record.addr, exc)
            except (StoreConnectionError, TransportError):
                pass  # unreachable for now: marked suspect, met later
            else:
                self._met.add((record.node, record.epoch))

        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(self._threads, meet, r) for r in todo))

    async def entries(self, keys: list[str]) -> dict[str, list[Entry]] | None:
        """Live copies of ``keys`` on other nodes, best first; None when the directory cannot be reached."""
        import redis

        try:
            found = await self.ctx.directory.lookup(keys)
        except (redis.RedisError, OSError) as exc:
            log.warning("directory lookup failed: %s: %s", type(exc).__name__, exc)
            return None
        return {key: self._rank(entries) for key, entries in found.items()}

    def _rank(self, entries: list[Entry]) -> list[Entry]:
        me, host = self.ctx.node_id, self.ctx.host_id
        usable = [e for e in entries if e.node != me and not self.peers.suspected(e.node, e.epoch)]
        random.shuffle(usable)  # spread reads over replicas
        return sorted(usable, key=lambda e: e.host != host)

    async def fetch(self, key: str, client: int) -> tuple[Lease, ObjectMeta]:
        """Copy ``key`` from a node that holds it into a scratch region leased to ``client``.

        KeyNotFoundError when no live node holds it, its owners are unreachable, or the directory is down."""
        found = await self.entries([key])
        if found is None:
            raise KeyNotFoundError(f"key {key!r} is not on node {self.ctx.node_id} and the cluster directory "
                                   "is unreachable")
        problems = []
        for entry in found[key]:
            try:
                return await self._fetch_from(entry, key, client)
            except KeyNotFoundError:
                await self._forget(entry)
            except (StoreConnectionError, TransportError, AuthenticationError) as exc:
                problems.append(f"node {entry.node}: {exc}")
        self.misses += 1
        detail = f" (owners unreachable: {'; '.join(problems)})" if problems else ""
        raise KeyNotFoundError(f"key {key!r} not found in the cluster{detail}")

    async def _forget(self, entry: Entry) -> None:
        import redis

        try:
            await self.ctx.directory.forget(entry)
        except (redis.RedisError, OSError):
            pass

    async def _fetch_from(self, entry: Entry, key: str, client: int) -> tuple[Lease, ObjectMeta]:
        master, loop = self.ctx.master, asyncio.get_running_loop()
        scratch = master.register_client(f"fetch:{entry.node}")
        size, done = entry.size, False
        try:
            for attempt in (0, 1):
                replica = master.begin_put(ObjectMeta(key=f"\x00fetch/{scratch}/{attempt}", size=size), scratch,
                                           ephemeral=True)
                self.scratch.add(replica.id)
                view = self.ctx.segments[replica.segment].view(replica.offset, size)
                fut = loop.run_in_executor(self._threads, self._copy, entry, key, view)
                try:
                    meta = await asyncio.shield(fut)
                except BufferTooSmallError as exc:  # replaced by a larger version since the lookup
                    master.abort(replica.id)
                    self.scratch.discard(replica.id)
                    if exc.needed is None:
                        raise
                    size = exc.needed
                    continue
                except asyncio.CancelledError:
                    done = True  # the copy may still be writing into the region: free it only once it stops
                    fut.add_done_callback(lambda _f: master.drop_client(scratch))
                    raise
                master.commit(replica.id)
                lease = master.lease(replica.key, client)
                done = True
                master.drop_client(scratch)  # unlinks the scratch copy; the lease keeps its bytes until released
                replica.meta = meta  # unlinked: from now on it describes what it holds, for every serving path
                self.gets += 1
                return lease, meta
            raise KeyNotFoundError(f"key {key!r} kept changing size while being copied")
        finally:
            if not done:
                master.drop_client(scratch)  # aborts the pending scratch put

    def _copy(self, entry: Entry, key: str, view: memoryview) -> ObjectMeta:
        def alloc(size: int) -> memoryview:
            if size > len(view):
                raise BufferTooSmallError(f"{key!r} grew to {size} bytes", needed=size, got=len(view))
            return view

        with self.peers.use(entry.node, entry.epoch, entry.addr) as peer:
            meta = peer.fetch_into(key, alloc, entry)
            if peer.last_codec is not None:
                self.compressed_gets += 1  # under the GIL; read only by stats
            return meta

    async def evict(self, entry: Entry, key: str) -> bool:
        """Ask the owner named by ``entry`` to evict its own copy of ``key``."""
        def call() -> bool:
            with self.peers.use(entry.node, entry.epoch, entry.addr) as peer:
                return peer.evict_local(key)

        return await asyncio.get_running_loop().run_in_executor(self._threads, call)

    def close(self) -> None:
        self.peers.close()
        self._threads.shutdown(wait=False, cancel_futures=True)
