"""ClusterServer: a ``kvstore serve`` daemon that is one member of a cluster.

It keeps everything a single daemon does (its own master, segments, shared-memory index), and adds: a node
record in Redis refreshed by heartbeat (``membership.py``); its committed objects published in the directory
(``publisher.py``, from the master's hooks); the directory's event channel (``events.py``), which wakes ``wait``
callers and drops local copies that another node superseded or removed; and remote reads for its clients: a
key it does not hold is looked up in the directory (one Redis round trip) and copied from its owner
(``reader.py``) into a scratch region here, which the client reads like a local object.

Failure rules. A lapsed record after this node stalled (it stopped trying to heartbeat past its TTL while Redis
kept its data) means the cluster declared us dead: we drop our objects and rejoin under a new epoch, so nothing
stale is served. A record that expired because Redis did not answer us (Redis stalled, or we were cut off from
it) while we kept trying is not that: our entries were kept dormant, so we re-register under the same epoch and
drop only the copies that the directory says were superseded or removed meanwhile. Redis losing its data
(restart without persistence) is different again: we re-register under the same epoch and republish every
object we hold (the directory is rebuilt from the daemons' own indexes). After any stall (a SIGSTOP however
short, or the loop idle for over ``STALL_S``) requests wait until we re-checked our entries against the
directory (``_stalled``): the events of removals and newer writes elsewhere may still be unread then. The
shared-memory index shows the same thing to same-host readers: its stop count is bumped the moment we learn of
a stop (the SIGCONT handler) or a stall, and the re-check, when it finishes, records the count it started at;
readers copy from the index without asking us only while the two are equal and our process is not stopped.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import time

from kvstore.cluster.config import ClusterConfig, open_redis, redact
from kvstore.cluster.daemon.publisher import Publisher
from kvstore.cluster.daemon.reader import RemoteReader
from kvstore.cluster.daemon.session import ClusterSession
from kvstore.cluster.directory import AsyncDirectory, checksum_text, encode_entry
from kvstore.cluster.events import EventListener
from kvstore.cluster.membership import Beat, Membership, NodeRecord
from kvstore.cluster.peers import PeerPool
from kvstore.core.master import Replica
from kvstore.daemon.server import Server, ServerConfig
from kvstore.errors import ObjectBusyError
from kvstore.memory.procstate import pid_namespace, start_time

log = logging.getLogger("kvstore.cluster")
WAIT_RECHECK_S = 1.0  # a waiter re-reads the directory this often, in case an event was lost
TICK_S = 0.2  # the event loop notes it ran this often ...
STALL_S = 1.0  # ... and a gap this long means we were stopped (or starved): events may be unread


class ClusterServer(Server):
    session_class = ClusterSession

    def __init__(self, config: ServerConfig, cluster: ClusterConfig):
        super().__init__(config)
        self.cluster = cluster
        self.node_id = cluster.node_id
        self.owned: dict[str, Replica] = {}    # our published objects (what the directory lists for us)
        self.doomed: dict[str, int] = {}       # dropped while leased: key -> replica id, removed when released
        self.members: dict[str, NodeRecord] = {}
        self.remote = RemoteReader(self, PeerPool(transport=cluster.peer_transport, timeout=cluster.peer_timeout,
                                                  token=config.token, client_name=f"node-{cluster.node_id}",
                                                  suspect_s=cluster.node_ttl,
                                                  compression=cluster.peer_compression))
        self._beat_task: asyncio.Task | None = None
        self._last_beat_try = -math.inf
        self._reconcile_due = False  # events may have been missed: check our entries after the next good beat
        self._tick = time.monotonic()  # the event loop ran then (``_ticker``, and every request)
        self._catch_up: asyncio.Future | None = None  # the check of our entries after a stall, while it runs
        self._continued = False  # SIGCONT arrived: we were stopped, for however short a time
        self._old_sigcont: object = None
        self._leaving = False
        # what a same-host reader checks our process by (hello ``index_gate``; None: readers ask us instead)
        ns, start = pid_namespace(), start_time()
        self.index_gate = None if ns is None or start is None else {"pid": self.pid, "pid_ns": list(ns),
                                                                     "start": start}
        self.counters = {"superseded": 0, "removed_by_peers": 0, "lapses": 0, "rebuilds": 0,
                         "resumes": 0, "catch_ups": 0}

    # ---- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.cluster
        self.redis = open_redis(cfg.redis_url, cfg.redis_timeout, asynchronous=True)
        self.directory = AsyncDirectory(self.redis, cfg.names)
        self.membership = Membership(self.redis, cfg, self._describe)
        self.publisher = Publisher(self.redis, cfg.names, cfg.node_id, lambda: self.membership.epoch, self.poke)
        self.events = EventListener(cfg.redis_url, cfg.redis_timeout, cfg.names.channel, self._on_event,
                                    self._on_resubscribed)
        self._beat_lock, self._poke = asyncio.Lock(), asyncio.Event()
        try:
            # a plain handler, not the loop's: it runs as soon as we are continued, before the loop reads any
            # request that arrived while we were stopped
            self._old_sigcont = signal.signal(signal.SIGCONT, self._on_sigcont)
        except ValueError:
            pass  # not the main thread: only the ticker sees stalls then
        await super().start()
        try:
            await self.membership.join(timeout=cfg.node_ttl + 5 * cfg.redis_timeout)
        except BaseException:
            await self.shutdown()
            raise
        self.publisher.activate()
        for coro in (self.publisher.run(), self.events.run(), self._heartbeats(), self._upkeep(), self._ticker()):
            self._spawn(coro)
        log.info("node %s joined cluster %s (namespace %s) with epoch %s, advertising %s", self.node_id,
                 redact(cfg.redis_url), cfg.namespace, self.membership.epoch, cfg.advertise)

    async def shutdown(self) -> None:
        # Stop flags first: redis-py may swallow a cancellation that lands inside one of its reads, so our
        # loops must end on their own for the base shutdown's cancel-and-gather to finish.
        self._leaving = True  # and no heartbeat may rejoin (or "lapse") once we deregistered
        self.events.stop()
        self.publisher.stop()
        if self.membership.joined:
            try:
                await asyncio.wait_for(self.membership.leave(), self.cluster.redis_timeout)
            except Exception as exc:
                log.warning("could not remove our node record (%s); it lapses within %.1f s", exc,
                            self.cluster.node_ttl)
        await super().shutdown()
        if self._old_sigcont is not None:
            try:
                signal.signal(signal.SIGCONT, self._old_sigcont)  # type: ignore[arg-type]
            except ValueError:
                pass
        self.remote.close()
        try:
            await asyncio.wait_for(self.redis.aclose(), self.cluster.redis_timeout)
        except Exception:
            pass

    def _describe(self) -> dict:
        return {"host": self.host_id, "transports": ",".join(self.served_transports), "capacity": self.master.capacity,
                "used": self.master.used_bytes, "objects": len(self.owned)}

    # ---- membership ---------------------------------------------------------------------------------
    def poke(self) -> None:
        """Heartbeat now (the publisher was fenced off, or an event asked for it)."""
        self._poke.set()

    def _running(self) -> bool:
        task = asyncio.current_task()
        return not self._leaving and not (task is not None and task.cancelling())

    async def _heartbeats(self) -> None:
        while self._running():
            try:
                await asyncio.wait_for(self._poke.wait(), self.cluster.heartbeat_period)
            except asyncio.TimeoutError:
                pass
            self._poke.clear()
            await self.beat()

    async def ensure_fresh(self) -> None:
        """Before serving a request: if our record may have lapsed (e.g. we were stopped), heartbeat first, so
        a lapse drops our objects before anyone reads them; if we were stalled at all, re-check our entries
        first (``_stalled``). Bounded; never raises. Not while Redis is known to be failing us (we are cut off,
        not stalled: our objects stay ours, and waiting would only slow every request by the Redis timeout)."""
        if self.membership.fresh() or not self.membership.joined or self._leaving or self.membership.cut_off():
            await self._caught_up()
            return
        if (self._beat_task is None or self._beat_task.done()) and \
                time.monotonic() - self._last_beat_try >= self.cluster.heartbeat_period / 2:
            self._beat_task = asyncio.ensure_future(self.beat())
        if self._beat_task is not None and not self._beat_task.done():
            await asyncio.wait({self._beat_task}, timeout=self.cluster.redis_timeout)
        await self._caught_up()

    def _on_sigcont(self, signum: int, frame: object) -> None:
        self._continued = True
        index = getattr(self, "index", None)
        if index is not None:
            index.stopped()  # first: same-host readers stop trusting the index until the re-check finished

    async def _ticker(self) -> None:
        while self._running():
            self._stalled()
            await asyncio.sleep(TICK_S)

    def _stalled(self) -> asyncio.Future | None:
        """The check of our entries against the directory that a stall calls for, while it runs. A node that
        was stopped (SIGSTOP, a long pause) may hold requests that arrived meanwhile, and the events of keys
        removed or rewritten elsewhere meanwhile may not be read yet when it resumes: whichever of this loop's
        ticker or such a request runs first after the gap starts the check, and requests wait for it, so none
        is answered with a copy the directory no longer lists. A stop is known exactly (SIGCONT); any other
        stall (a VM pause, starvation) by the gap it leaves in the ticker's rounds (over ``STALL_S``)."""
        now = time.monotonic()
        if now - self._tick > STALL_S:
            self.index.stopped()  # no SIGCONT told us (a VM pause, starvation): mark the index here
            self._continued = True
        self._tick = now
        # a check already running may predate the stall; one owed while we are not joined waits until we are
        # (the index's stop marks keep same-host readers off it meanwhile)
        if self._continued and self.membership.joined and not self._leaving:
            self._continued = False
            self.counters["catch_ups"] += 1
            self._catch_up = asyncio.ensure_future(self._reconcile())
        return self._catch_up if self._catch_up is not None and not self._catch_up.done() else None

    async def _caught_up(self) -> None:
        check = self._stalled()
        if check is not None:
            await asyncio.wait({check}, timeout=self.cluster.redis_timeout)

    async def beat(self) -> None:
        import redis

        async with self._beat_lock:
            if self._leaving:
                return
            self._last_beat_try = time.monotonic()
            try:
                outcome = await self.membership.beat()
                await self._after_beat(outcome)
            except (redis.RedisError, OSError) as exc:
                self.publisher.mark_degraded()
                if self.membership.fresh(1.0):
                    log.warning("heartbeat failed (%s: %s)", type(exc).__name__, exc)

    async def _after_beat(self, outcome: Beat) -> None:
        if outcome is Beat.OK:
            if not self.publisher.active:
                self.publisher.activate()
            if self._reconcile_due:
                self._reconcile_due = False
                self._spawn(self._reconcile())
            return
        self._reconcile_due = False  # a rejoin or a rebuild supersedes it
        if outcome is Beat.TAKEN:
            log.error("node id %s was taken by another daemon; stopping", self.node_id)
            self.request_stop()
            return
        self.publisher.active = False
        if outcome is Beat.EXPIRED and self.membership.cut_off():
            await self._resume()
            return
        if outcome in (Beat.LAPSED, Beat.EXPIRED):
            self.counters["lapses"] += 1
            log.warning("our node record lapsed (stalled or cut off for over %.1f s): dropping %d objects the "
                        "cluster already counts as lost, rejoining with a new epoch", self.cluster.node_ttl,
                        len(self.owned))
            stops = self.index.stops()
            self.drop_all()  # the index shows none of them any more: as good as a finished re-check
            self.index.checked(stops)
            self.publisher.clear()
            self.membership.renew_epoch()
        else:
            self.counters["rebuilds"] += 1
            log.warning("Redis lost the cluster state: re-registering and republishing %d objects", len(self.owned))
            self.membership.joined = False
            self.publisher.republish(self.owned.values())
        if await self.membership.beat() is Beat.OK:
            self.publisher.activate()
        else:
            self.request_stop()

    async def _resume(self) -> None:
        """Redis stopped answering us for longer than our TTL, but nobody declared us dead while we could hear:
        keep our epoch and objects (our entries were dormant, not deleted), re-register, and drop only the
        copies whose entries someone superseded or removed meanwhile (the directory says which)."""
        self.counters["resumes"] += 1
        log.warning("Redis did not answer for over the node TTL (%.1f s): keeping our epoch and %d objects, "
                    "dropping those the directory says were superseded meanwhile", self.cluster.node_ttl,
                    len(self.owned))
        self.membership.joined = False
        if await self.membership.beat() is not Beat.OK:
            self.request_stop()
            return
        self.publisher.activate()
        await self._reconcile()

    # ---- master hooks -------------------------------------------------------------------------------
    def on_published(self, replica: Replica) -> None:
        if replica.id in self.remote.scratch:
            return  # a reader's private copy of a remote object: not ours to show
        super().on_published(replica)
        self.owned[replica.key] = replica
        self.doomed.pop(replica.key, None)
        self.publisher.publish(replica.key, replica)

    def on_unpublished(self, replica: Replica) -> None:
        if replica.id in self.remote.scratch:
            self.remote.scratch.discard(replica.id)
            return
        super().on_unpublished(replica)
        key = replica.key
        if self.owned.get(key) is replica:
            del self.owned[key]
            self.publisher.unpublish(key)
        if self.doomed.get(key) == replica.id:
            del self.doomed[key]

    # ---- local copies -------------------------------------------------------------------------------
    def local(self, key: str) -> bool:
        return key not in self.doomed and self.master.exists(key)

    def drop_local(self, key: str) -> None:
        """Stop serving our copy of ``key`` now; a leased copy is hidden and removed when released."""
        replica = self.owned.get(key)
        if replica is None:
            return
        try:
            self.master.remove(key)
        except ObjectBusyError:
            self.doomed[key] = replica.id
            self.index.unpublish(key, replica.id)
            del self.owned[key]
            self.publisher.unpublish(key)

    def drop_all(self) -> None:
        for key in list(self.owned):
            self.drop_local(key)

    def _stale(self, key: str, seq: int) -> bool:
        """Our copy of ``key`` was published before cluster sequence ``seq`` (and nothing newer is queued)."""
        return key in self.owned and not self.publisher.unflushed(key) and self.publisher.seq.get(key, 0) < seq

    def _on_event(self, kind: str, node: str, seq: int, items: list) -> None:
        if kind == "p":
            for key, checksum in zip(items[0::2], items[1::2], strict=True):
                self._wake(key)
                if node != self.node_id and self._stale(key, seq) and (
                        checksum == "-" or checksum_text(self.owned[key].meta.checksum) != checksum):
                    self.counters["superseded"] += 1
                    self.drop_local(key)
        elif kind == "r":
            for key in items:
                if self._stale(key, seq):
                    self.counters["removed_by_peers"] += 1
                    self.drop_local(key)

    def _wake(self, key: str) -> None:
        for fut in self.waiters.pop(key, ()):
            if not fut.done():
                fut.set_result(key)

    async def _on_resubscribed(self) -> None:
        """Events may have been missed. The next heartbeat tells whether Redis kept its data; only then are
        our entries checked (against an emptied Redis, the rebuild is the answer)."""
        self._reconcile_due = True
        self.poke()

    async def _reconcile(self) -> None:
        """Drop copies whose directory entry is no longer ours (superseded or removed while we were deaf).
        Once done, the index shows the stop count as of its start as checked (``IndexWriter.checked``)."""
        import redis

        stops = self.index.stops()  # a stop after this point is not covered by this check
        epoch = self.membership.epoch
        expected = [(k, encode_entry(epoch, r.meta)) for k, r in self.owned.items() if not self.publisher.unflushed(k)]
        if expected:
            try:
                stale = await self.directory.stale(self.node_id, expected)
            except (redis.RedisError, OSError):
                self._reconcile_due = True
                return
            for key in stale:
                if key in self.owned and not self.publisher.unflushed(key) and epoch == self.membership.epoch:
                    self.drop_local(key)
        if epoch == self.membership.epoch:
            self.index.checked(stops)

    async def _upkeep(self) -> None:
        import redis

        last_members = -math.inf
        while self._running():
            await asyncio.sleep(0.5)
            for key in list(self.doomed):
                try:
                    self.master.remove(key)
                except ObjectBusyError:
                    continue
                self.doomed.pop(key, None)
            if time.monotonic() - last_members >= self.cluster.node_ttl:
                last_members = time.monotonic()
                try:
                    self.members = await self.membership.members()
                except (redis.RedisError, OSError):
                    continue
                self.remote.peers.prune({n: r.epoch for n, r in self.members.items()})
                await self.remote.probe(self.members)

    async def remove_everywhere(self, keys: list[str]) -> list[int]:
        """Delete the directory entries of ``keys``; their holders drop their copies on the event."""
        return await self.directory.remove(keys, self.node_id)

    async def wait_for(self, keys: list[str], timeout: float) -> str | None:
        loop = asyncio.get_running_loop()
        fut = self.add_waiter(keys)
        deadline = loop.time() + timeout
        try:
            while True:
                for key in keys:
                    if self.local(key):
                        return key
                found = await self.remote.entries(keys) or {}
                for key in keys:
                    if found.get(key):
                        return key
                left = deadline - loop.time()
                if left <= 0:
                    return None
                try:
                    return await asyncio.wait_for(asyncio.shield(fut), min(left, WAIT_RECHECK_S))
                except asyncio.TimeoutError:
                    continue
        finally:
            self.forget_waiter(keys, fut)

    def stats(self, after: int = 0, limit: int = 256) -> dict:
        out = super().stats(after, limit)
        pub = self.publisher
        flush = sorted(pub.flush_seconds)
        out["cluster"] = {
            "node": self.node_id, "epoch": self.membership.epoch, "joined": self.membership.joined,
            "advertise": self.cluster.advertise, "members": sorted(self.members), "owned": len(self.owned),
            "doomed": len(self.doomed), "events": self.events.received, "heartbeats": self.membership.beats,
            "directory": {"flushes": pub.flushes, "ops": pub.ops, "failures": pub.failures, "backlog": pub.backlog,
                          "degraded": pub.degraded, "reads": self.directory.round_trips,
                          "flush_p50_ms": round(1e3 * flush[len(flush) // 2], 3) if flush else None,
                          "flush_p99_ms": round(1e3 * flush[int(len(flush) * 0.99)], 3) if flush else None},
            "remote_gets": self.remote.gets, "remote_misses": self.remote.misses,
            "remote_compressed_gets": self.remote.compressed_gets, "peer_compression": self.cluster.peer_compression,
            "refused": self.remote.peers.refusals(), **self.counters}
        return out
