"""Publisher: writes one daemon's directory entries, after its master committed (or dropped) the objects.

The master's hooks queue an op per key (publish this replica / unpublish), coalesced to the key's final state.
One task flushes the queue with one atomic script call (group commit: while a flush is in flight the next batch
collects), so a burst of puts costs a few Redis round trips, and the keys of one ``batch_put`` become visible to
other nodes together. The script is fenced by the boot epoch: a node whose record lapsed cannot write.
``seq`` remembers, per key, the cluster sequence number of our last publish; an event from another node with a
larger number that names different content means our copy was superseded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from kvstore.cluster.config import Names
from kvstore.cluster.directory import PUBLISH_LUA, encode_entry
from kvstore.core.master import Replica

log = logging.getLogger("kvstore.cluster")
MAX_FLUSH = 8192  # ops per script call; larger bursts (a rebuild) go in several calls
_RETRY_S = (0.05, 0.2, 0.5, 1.0)


class Fenced(Exception):
    """Redis refused our writes: our node record does not carry the epoch they were sent with."""

    def __init__(self, epoch: str):
        super().__init__(epoch)
        self.epoch = epoch


class Publisher:
    def __init__(self, redis, names: Names, node: str, epoch: Callable[[], str], on_fenced: Callable[[], None]):
        self.names, self.node, self.epoch, self.on_fenced = names, node, epoch, on_fenced
        self._script = redis.register_script(PUBLISH_LUA)
        self._pending: dict[str, Replica | None] = {}  # key -> replica to publish, or None to unpublish
        self._inflight: dict[str, Replica | None] = {}
        self._wake = asyncio.Event()
        self._queued = 0   # ops queued so far
        self._flushed = 0  # ops known to be in Redis
        self._waiters: list[tuple[int, asyncio.Future]] = []
        self.seq: dict[str, int] = {}
        self._stop = False
        self.active = False   # flush only while our record is registered
        self.degraded = False  # the last flush failed: puts do not wait for the directory
        self.flushes = self.ops = self.failures = 0
        self.flush_seconds: list[float] = []

    # ---- queueing (called synchronously on the loop by the master hooks) ------------------------------
    def publish(self, key: str, replica: Replica) -> None:
        self._queue(key, replica)

    def unpublish(self, key: str) -> None:
        self._queue(key, None)

    def _queue(self, key: str, op: Replica | None) -> None:
        self._pending.pop(key, None)  # re-insert: keep queue order = order of last change
        self._pending[key] = op
        self._queued += 1
        self._wake.set()

    def unflushed(self, key: str) -> bool:
        return key in self._pending or key in self._inflight

    @property
    def backlog(self) -> int:
        return len(self._pending) + len(self._inflight)

    def republish(self, replicas: Iterable[Replica]) -> None:
        """Redis lost the directory: queue every object we hold."""
        self.seq.clear()
        self._pending.clear()
        for replica in replicas:
            self._queue(replica.key, replica)

    def clear(self) -> None:
        """We lapsed: our entries are void (old epoch); forget what was queued."""
        self._pending.clear()
        self.seq.clear()
        self._release_waiters(everyone=True)

    def mark_degraded(self) -> None:
        """Redis is failing: stop holding puts back for the directory."""
        self.degraded = True
        self._release_waiters(everyone=True)

    def stop(self) -> None:
        self._stop = True
        self._wake.set()

    def _running(self) -> bool:
        task = asyncio.current_task()  # see ClusterServer.shutdown: redis-py may swallow a cancellation
        return not self._stop and not (task is not None and task.cancelling())

    def activate(self) -> None:
        self.active = True
        self._wake.set()

    async def synced(self, timeout: float) -> None:
        """Wait until every op queued so far is in Redis (at most ``timeout``; not at all while Redis fails)."""
        target = self._queued
        if self._flushed >= target or self.degraded:
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((target, fut))
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            pass

    def _release_waiters(self, everyone: bool = False) -> None:
        keep = []
        for target, fut in self._waiters:
            if everyone or target <= self._flushed:
                if not fut.done():
                    fut.set_result(None)
            else:
                keep.append((target, fut))
        self._waiters = keep

    # ---- flushing -----------------------------------------------------------------------------------
    async def run(self) -> None:
        import redis

        failures = 0
        while self._running():
            await self._wake.wait()
            self._wake.clear()
            if not self.active or not self._pending or not self._running():
                continue
            upto, ops = self._queued, self._pending
            self._pending, self._inflight = {}, ops
            try:
                await self._flush(ops)
            except Fenced as exc:
                self._restore(ops)
                if exc.epoch == self.epoch():  # else we rejoined meanwhile: just send them again
                    self.active = False
                    self.on_fenced()
                self._wake.set()
            except (redis.RedisError, OSError) as exc:
                self._restore(ops)
                failures += 1
                self.failures += 1
                if not self.degraded:
                    log.warning("directory flush failed (%s: %s); keeping %d ops and retrying", type(exc).__name__,
                                exc, len(self._pending))
                self.mark_degraded()
                await asyncio.sleep(_RETRY_S[min(failures, len(_RETRY_S)) - 1])
                self._wake.set()
            else:
                failures = 0
                self.degraded = False
                self._flushed = max(self._flushed, upto)
                self._release_waiters()
            finally:
                self._inflight = {}

    def _restore(self, ops: dict[str, Replica | None]) -> None:
        """Put back ops that did not reach Redis, unless a newer op for the key was queued meanwhile."""
        newer = self._pending
        self._pending = {k: v for k, v in ops.items() if k not in newer}
        self._pending.update(newer)

    async def _flush(self, ops: dict[str, Replica | None]) -> None:
        items = list(ops.items())
        for start in range(0, len(items), MAX_FLUSH):
            chunk = items[start:start + MAX_FLUSH]
            epoch = self.epoch()
            args: list = [self.names.namespace, self.node, epoch]
            for key, replica in chunk:
                args += ["p", key, encode_entry(epoch, replica.meta)] if replica is not None else ["u", key, ""]
            began = time.perf_counter()
            (seq,) = await self._script(args=args)
            self.flush_seconds.append(time.perf_counter() - began)
            del self.flush_seconds[:-4096]
            if int(seq) < 0:
                raise Fenced(epoch)
            self.flushes += 1
            self.ops += len(chunk)
            for key, replica in chunk:
                if replica is not None:
                    self.seq[key] = int(seq)
                else:
                    self.seq.pop(key, None)
