"""EventListener: a daemon's subscription to the directory's event channel (publishes and removals anywhere in
the cluster). It wakes ``wait`` callers and drops local copies that another node superseded or removed. Pub/sub
is not durable: after a reconnect ``on_resubscribed`` lets the node re-check what it may have missed, and
waiters also re-read the directory on a bounded period.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from kvstore.cluster.config import open_redis
from kvstore.cluster.directory import decode_event

log = logging.getLogger("kvstore.cluster")
_RETRY_S = (0.1, 0.3, 1.0)


class EventListener:
    def __init__(self, url: str, timeout: float, channel: str, on_event: Callable[[str, str, int, list], None],
                 on_resubscribed: Callable[[], Awaitable[None]]):
        self.url, self.timeout, self.channel = url, timeout, channel
        self.on_event, self.on_resubscribed = on_event, on_resubscribed
        self.connected = False
        self.received = 0
        self._stop = False

    def stop(self) -> None:
        self._stop = True

    def _stopping(self) -> bool:
        # redis-py can swallow a cancellation that lands inside its reads: check for one ourselves
        task = asyncio.current_task()
        return self._stop or (task is not None and task.cancelling() > 0)

    async def run(self) -> None:
        import redis

        failures = 0
        ever = False
        while not self._stopping():
            client = open_redis(self.url, self.timeout, asynchronous=True, pubsub=True)
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.channel)
                self.connected = True
                if ever and failures:
                    log.info("event channel back after %d failed attempts", failures)
                    await self.on_resubscribed()
                ever, failures = True, 0
                await self._read(pubsub)
            except (redis.RedisError, OSError) as exc:
                self.connected = False
                if failures == 0:
                    log.warning("event channel lost (%s: %s); resubscribing", type(exc).__name__, exc)
                failures += 1
                await asyncio.sleep(_RETRY_S[min(failures, len(_RETRY_S)) - 1])
            finally:
                self.connected = False
                # bounded: a close racing a cancelled subscribe can otherwise wait forever (and hang shutdown)
                await _quietly(pubsub.aclose(), self.timeout)
                await _quietly(client.aclose(), self.timeout)

    async def _read(self, pubsub) -> None:
        while not self._stopping():
            message = await pubsub.get_message(timeout=1.0)
            if message is None or message.get("type") != "message":
                continue
            event = decode_event(message["data"])
            if event is None:
                log.warning("ignoring a malformed directory event")
                continue
            self.received += 1
            try:
                self.on_event(*event)
            except Exception:  # a bug in a handler must not stop the subscription
                log.exception("directory event handler failed")


async def _quietly(awaitable, timeout: float) -> None:
    try:
        await asyncio.wait_for(awaitable, timeout)
    except Exception:
        pass
