"""Membership: each daemon's TTL'd node record in Redis, refreshed by heartbeat, and the list of live members.

``P:node:<id>`` (hash, PEXPIRE = node TTL): epoch, addr, host, transports, capacity, used, objects, pid, started,
ttl_ms. A record that lapses means a dead (or partitioned) node: directory entries carrying its epoch stop
counting. ``P:last:<id>`` (string, PEXPIRE = ``ClusterConfig.cutoff_grace``) remembers the node's epoch past its
record: while it does, the node's entries are *dormant* (not served, not cleaned up), so a node that was only
cut off from Redis can take back every object nobody superseded or removed meanwhile. ``P:nodes`` (set) names
every node ever seen (pruned as records lapse). ``P:cluster`` (string) is a marker written once per Redis
lifetime: when a heartbeat finds it gone or changed, Redis lost its data and the daemon re-registers and
republishes its objects. When only the record is gone, the heartbeat says why it may be: ``EXPIRED`` (the epoch
is still remembered) or ``LAPSED`` (forgotten); the daemon knows whether Redis stopped answering it while its
record was alive (cut off: resume) or it stalled itself (declared dead: rejoin under a new epoch, objects dropped).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from kvstore.cluster.config import ClusterConfig, Names, redact
from kvstore.errors import AuthenticationError, InvalidArgumentError, StoreConnectionError

log = logging.getLogger("kvstore.cluster")

# ARGV: namespace, node, epoch, marker, ttl_ms, mode ('join' | 'beat'), addr, grace_ms, then field/value pairs.
HEARTBEAT_LUA = """
local p, node, epoch, marker, ttl, mode, addr = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7]
local rec = p .. ':node:' .. node
local last = p .. ':last:' .. node
local mkey = p .. ':cluster'
local cur = redis.call('GET', mkey)
local e = redis.call('HGET', rec, 'epoch')
if mode == 'beat' then
  if cur ~= marker then return {'LOST', cur or ''} end
  if not e then
    if redis.call('GET', last) == epoch then return {'EXPIRED', ''} end
    return {'LAPSED', ''}
  end
  if e ~= epoch then return {'TAKEN', e} end
else
  if not cur then redis.call('SET', mkey, marker); cur = marker end
  if e and e ~= epoch and redis.call('HGET', rec, 'addr') ~= addr then
    return {'TAKEN', redis.call('HGET', rec, 'addr')}
  end
  redis.call('DEL', rec)
end
redis.call('HSET', rec, 'epoch', epoch, 'addr', addr, unpack(ARGV, 9))
redis.call('PEXPIRE', rec, ttl)
redis.call('SET', last, epoch, 'PX', ARGV[8])
redis.call('SADD', p .. ':nodes', node)
return {'OK', cur}
"""

# ARGV: namespace, node, epoch. Deletes the record only if it is still ours.
LEAVE_LUA = """
local rec = ARGV[1] .. ':node:' .. ARGV[2]
if redis.call('HGET', rec, 'epoch') == ARGV[3] then
  redis.call('DEL', rec)
  redis.call('DEL', ARGV[1] .. ':last:' .. ARGV[2])
  redis.call('SREM', ARGV[1] .. ':nodes', ARGV[2])
  return 1
end
return 0
"""

# ARGV: namespace. Returns {node, {field, value, ...}, ...} for live records; forgets lapsed ones.
MEMBERS_LUA = """
local p = ARGV[1]
local out = {}
for _, node in ipairs(redis.call('SMEMBERS', p .. ':nodes')) do
  local rec = redis.call('HGETALL', p .. ':node:' .. node)
  if #rec == 0 then
    redis.call('SREM', p .. ':nodes', node)
  else
    out[#out + 1] = node
    out[#out + 1] = rec
  end
end
return out
"""


class Beat(Enum):
    OK = "OK"            # record refreshed
    LAPSED = "LAPSED"    # our record expired and our epoch is forgotten: our entries are void
    EXPIRED = "EXPIRED"  # our record expired, our epoch is remembered: our entries are dormant, not gone
    LOST = "LOST"        # Redis lost its data (restart without persistence, or a fresh server)
    TAKEN = "TAKEN"      # another live daemon registered under our node id


@dataclass(frozen=True, slots=True)
class NodeRecord:
    node: str
    epoch: str
    addr: str
    host: str = ""
    transports: tuple[str, ...] = ()
    capacity: int = 0
    used: int = 0
    objects: int = 0
    pid: int = 0
    started: float = 0.0
    ttl: float = 0.0

    @property
    def free(self) -> int:
        return max(0, self.capacity - self.used)

    @classmethod
    def from_hash(cls, node: str, fields: dict) -> NodeRecord:
        f = {_text(k): _text(v) for k, v in fields.items()}

        def num(name: str, kind=int):
            try:
                return kind(f.get(name, 0))
            except ValueError:
                return kind(0)

        return cls(node=node, epoch=f.get("epoch", ""), addr=f.get("addr", ""), host=f.get("host", ""),
                   transports=tuple(t for t in f.get("transports", "").split(",") if t),
                   capacity=num("capacity"), used=num("used"), objects=num("objects"), pid=num("pid"),
                   started=num("started", float), ttl=num("ttl_ms", float) / 1000)


def _text(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def new_epoch() -> str:
    """Boot epochs grow with time (readable in logs) and carry random bits (unique across restarts)."""
    return f"{time.time_ns() // 1000:x}-{secrets.token_hex(3)}"


def members_args(names: Names) -> list[str]:
    return [names.namespace]


def parse_members(raw: list) -> dict[str, NodeRecord]:
    out = {}
    for i in range(0, len(raw) - 1, 2):
        node = _text(raw[i])
        flat = raw[i + 1]
        out[node] = NodeRecord.from_hash(node, dict(zip(flat[0::2], flat[1::2], strict=True)))
    return out


def redis_failure(exc: Exception, url: str) -> Exception:
    """The kvstore error for a Redis client exception."""
    import redis

    if isinstance(exc, redis.AuthenticationError) or "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
        return AuthenticationError(f"Redis at {redact(url)} refused the credentials: {exc}")
    return StoreConnectionError(f"cluster Redis at {redact(url)} failed: {type(exc).__name__}: {exc}")


class Membership:
    """One daemon's node record (asyncio Redis client). ``describe()`` gives the live fields (capacity,
    used, objects, host, transports) written with every heartbeat."""

    def __init__(self, redis, config: ClusterConfig, describe: Callable[[], dict]):
        self.redis, self.config, self.describe = redis, config, describe
        self.names = config.names
        self.epoch = new_epoch()
        self.marker = secrets.token_hex(8)
        self.joined = False
        self.last_ok = -math.inf
        self.failing_since: float | None = None  # when the first heartbeat since the last good one failed
        self.failures = 0  # heartbeats failed in a row
        self.started = time.time()
        self._heartbeat = redis.register_script(HEARTBEAT_LUA)
        self._leave = redis.register_script(LEAVE_LUA)
        self._members = redis.register_script(MEMBERS_LUA)
        self.beats = 0

    def fresh(self, fraction: float = 0.75) -> bool:
        """True while our record surely has not lapsed (the last refresh is younger than part of the TTL)."""
        return self.joined and time.monotonic() - self.last_ok < fraction * self.config.node_ttl

    def renew_epoch(self) -> None:
        self.epoch = new_epoch()
        self.joined = False

    def _args(self, mode: str) -> list:
        cfg = self.config
        fields = {"host": "", "transports": "", "capacity": 0, "used": 0, "objects": 0, **self.describe(),
                  "pid": os.getpid(), "started": self.started, "ttl_ms": int(cfg.node_ttl * 1000)}
        flat: list = []
        for name, value in fields.items():
            flat += [name, value]
        return [self.names.namespace, cfg.node_id, self.epoch, self.marker, int(cfg.node_ttl * 1000), mode,
                cfg.advertise, int(cfg.cutoff_grace * 1000), *flat]

    async def _call(self, mode: str) -> tuple[str, str]:
        sent = time.monotonic()
        try:
            status, detail = await self._heartbeat(args=self._args(mode))
        except Exception:
            if self.failing_since is None:
                self.failing_since = sent
            self.failures += 1
            raise
        self.beats += 1
        status, detail = _text(status), _text(detail)
        if status == "OK":
            self.joined = True
            self.last_ok = sent
            self.marker = detail
            self.failing_since, self.failures = None, 0
        return status, detail

    def cut_off(self) -> bool:
        """Whether our record expired because Redis stopped answering us while it was still alive (we kept
        trying: cut off), rather than because we stopped trying (stalled, and declared dead by the others).
        Two failures at least: one alone may be a heartbeat that was in flight when this process was stopped."""
        return self.failures >= 2 and self.failing_since is not None and \
            self.failing_since < self.last_ok + self.config.node_ttl

    async def join(self, timeout: float) -> None:
        """Register (at boot or to rejoin). Waits up to ``timeout`` for Redis to answer, or for a lapsing
        record of a previous daemon with our node id; raises StoreConnectionError, AuthenticationError or
        InvalidArgumentError (node id held by a live daemon elsewhere)."""
        import redis

        deadline = time.monotonic() + timeout
        while True:
            try:
                status, detail = await self._call("join")
            except (redis.RedisError, OSError) as exc:
                failure = redis_failure(exc, self.config.redis_url)
                if isinstance(failure, AuthenticationError) or time.monotonic() > deadline:
                    raise failure from None
            else:
                if status == "OK":
                    return
                if time.monotonic() > deadline:
                    raise InvalidArgumentError(f"node id {self.config.node_id!r} is registered by a live daemon at "
                                               f"{detail}; give each daemon its own --node-id")
            await asyncio.sleep(min(0.2, self.config.heartbeat_period))

    async def beat(self) -> Beat:
        """Refresh the record; Redis errors propagate (the caller retries on its next period)."""
        if not self.joined:
            status, _ = await self._call("join")
            return Beat.OK if status == "OK" else Beat.TAKEN
        status, detail = await self._call("beat")
        if status == "LOST":
            # Adopt the marker another node already re-created, or make a new one: nodes that still hold the
            # old value must see a change too, or they would take their own missing records for a lapse.
            self.marker = detail or secrets.token_hex(8)
        return Beat(status)

    async def leave(self) -> None:
        await self._leave(args=[self.names.namespace, self.config.node_id, self.epoch])
        self.joined = False

    async def members(self) -> dict[str, NodeRecord]:
        return parse_members(await self._members(args=members_args(self.names)))
