"""Directory: the cluster's object index in Redis — which nodes hold a committed copy of each key.

``P:obj:<key>`` is a hash: node id -> ``"<epoch> <xxh3 hex | -> " + msgpack([version, size, ObjectMeta wire])``.
An entry counts only while the node's record (``P:node:<id>``) carries the same boot epoch; a lookup deletes
the entries it finds dead (lazy cleanup), and a reader whose owner no longer has the object deletes that one
entry (only if it is unchanged); a lapsed node's entries stay dormant while Redis remembers its epoch (see
``membership.py``). Only the owning daemon writes its entries, after its master committed the
object (see ``publisher.py``). Copies on several nodes coexist while their checksums agree; a publish of
different content supersedes the others (last writer wins). Every publish and removal bumps ``P:seq`` and
announces itself on the ``P:events`` channel: ``[kind, node, seq, items]`` in msgpack, kind ``p`` (items:
key, checksum, ...) or ``r`` (items: keys).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import msgpack

from kvstore.cluster.config import Names
from kvstore.core.meta import ObjectMeta
from kvstore.errors import InvalidArgumentError

# ARGV: namespace, node, epoch, then (op, key, value) triples; op 'p' = publish value, 'u' = unpublish.
# Returns {seq}, or {-1} when the node's record does not carry this epoch (lapsed or replaced: fenced off).
PUBLISH_LUA = """
local p, node, epoch = ARGV[1], ARGV[2], ARGV[3]
if redis.call('HGET', p .. ':node:' .. node, 'epoch') ~= epoch then return {-1} end
local seq = redis.call('INCR', p .. ':seq')
local pub = {}
for i = 4, #ARGV, 3 do
  local op, key, val = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local okey = p .. ':obj:' .. key
  if op == 'p' then
    local sum = string.match(val, '^%S+ (%S+) ')
    local cur = redis.call('HGETALL', okey)
    for j = 1, #cur, 2 do
      if cur[j] ~= node and (sum == '-' or string.match(cur[j + 1], '^%S+ (%S+) ') ~= sum) then
        redis.call('HDEL', okey, cur[j])
      end
    end
    redis.call('HSET', okey, node, val)
    pub[#pub + 1] = key
    pub[#pub + 1] = sum
  else
    redis.call('HDEL', okey, node)
  end
end
if #pub > 0 then redis.call('PUBLISH', p .. ':events', cmsgpack.pack({'p', node, seq, pub})) end
return {seq}
"""

# ARGV: namespace, then keys. Returns, per key, {node, value, addr, host, ...} of live entries. Entries of a dead
# epoch are deleted; those of a lapsed node whose epoch is still remembered (P:last) are dormant: kept, not served.
LOOKUP_LUA = """
local p = ARGV[1]
local nodes = {}
local out = {}
for i = 2, #ARGV do
  local okey = p .. ':obj:' .. ARGV[i]
  local cur = redis.call('HGETALL', okey)
  local live = {}
  for j = 1, #cur, 2 do
    local n = cur[j]
    local rec = nodes[n]
    if rec == nil then
      rec = redis.call('HMGET', p .. ':node:' .. n, 'epoch', 'addr', 'host')
      if not rec[1] then rec[4] = redis.call('GET', p .. ':last:' .. n) end
      nodes[n] = rec
    end
    local e = string.match(cur[j + 1], '^(%S+) ')
    if rec[1] and rec[1] == e then
      live[#live + 1] = n
      live[#live + 1] = cur[j + 1]
      live[#live + 1] = rec[2]
      live[#live + 1] = rec[3]
    elseif rec[1] or rec[4] ~= e then
      redis.call('HDEL', okey, n)
    end
  end
  out[#out + 1] = live
end
return out
"""

# ARGV: namespace, key, node, value: delete that entry if it is still exactly value.
FORGET_LUA = """
local okey = ARGV[1] .. ':obj:' .. ARGV[2]
if redis.call('HGET', okey, ARGV[3]) == ARGV[4] then return redis.call('HDEL', okey, ARGV[3]) end
return 0
"""

# ARGV: namespace, node, then keys. Deletes every entry; returns per key how many live copies were listed.
REMOVE_LUA = """
local p = ARGV[1]
local seq = redis.call('INCR', p .. ':seq')
local gone = {}
local out = {}
for i = 3, #ARGV do
  local okey = p .. ':obj:' .. ARGV[i]
  local cur = redis.call('HGETALL', okey)
  local live = 0
  for j = 1, #cur, 2 do
    if redis.call('HGET', p .. ':node:' .. cur[j], 'epoch') == string.match(cur[j + 1], '^(%S+) ') then
      live = live + 1
    end
  end
  if #cur > 0 then
    redis.call('DEL', okey)
    gone[#gone + 1] = ARGV[i]
  end
  out[#out + 1] = live
end
if #gone > 0 then redis.call('PUBLISH', p .. ':events', cmsgpack.pack({'r', ARGV[2], seq, gone})) end
return out
"""

# ARGV: namespace, node, then (key, value) pairs. Returns the keys whose entry for node is not value.
CHECK_LUA = """
local p, node = ARGV[1], ARGV[2]
local out = {}
for i = 3, #ARGV, 2 do
  if redis.call('HGET', p .. ':obj:' .. ARGV[i], node) ~= ARGV[i + 1] then out[#out + 1] = ARGV[i] end
end
return out
"""

BATCH = 512  # keys per script call: bounds how long one call holds Redis


@dataclass(frozen=True, slots=True)
class Entry:
    """One live copy of ``key``: on ``node`` (boot ``epoch``, reachable at ``addr``, host ``host``)."""

    key: str
    node: str
    epoch: str
    checksum: str
    version: int
    size: int
    meta: ObjectMeta
    addr: str
    host: str
    raw: bytes


def checksum_text(checksum: int | None) -> str:
    return "-" if checksum is None else f"{checksum:016x}"


def encode_entry(epoch: str, meta: ObjectMeta) -> bytes:
    head = f"{epoch} {checksum_text(meta.checksum)} ".encode()
    return head + msgpack.packb([meta.version, meta.size, meta.to_wire()], use_bin_type=True)


def decode_entry(key: str, node: str, raw: bytes, addr: str, host: str) -> Entry | None:
    """None for an entry this version cannot read (written by a newer release): it is skipped."""
    try:
        epoch, checksum, body = raw.split(b" ", 2)
        version, size, wire = msgpack.unpackb(body, raw=False)
        meta = ObjectMeta.from_wire(wire)
    except (ValueError, TypeError, InvalidArgumentError, msgpack.UnpackException):
        return None
    return Entry(key, node, epoch.decode(), checksum.decode(), int(version), int(size), meta, addr, host, raw)


def _text(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else ("" if value is None else str(value))


def parse_lookup(keys: list[str], result: list) -> dict[str, list[Entry]]:
    out: dict[str, list[Entry]] = {}
    for key, flat in zip(keys, result, strict=True):
        entries = []
        for i in range(0, len(flat) - 3, 4):
            entry = decode_entry(key, _text(flat[i]), flat[i + 1], _text(flat[i + 2]), _text(flat[i + 3]))
            if entry is not None:
                entries.append(entry)
        out[key] = entries
    return out


def batches(items: list, size: int = BATCH) -> Iterable[list]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


def glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def decode_event(data: bytes) -> tuple[str, str, int, list] | None:
    try:
        kind, node, seq, items = msgpack.unpackb(data, raw=False)
        return str(kind), str(node), int(seq), list(items)
    except (ValueError, TypeError, msgpack.UnpackException):
        return None


class Directory:
    """Lookups and removals from a client (blocking Redis client). ``round_trips`` counts script calls."""

    def __init__(self, redis, names: Names):
        self.names = names
        self._lookup = redis.register_script(LOOKUP_LUA)
        self._forget = redis.register_script(FORGET_LUA)
        self._remove = redis.register_script(REMOVE_LUA)
        self.round_trips = 0

    def lookup(self, keys: list[str]) -> dict[str, list[Entry]]:
        """Live entries of every key (one round trip per 512 keys)."""
        out: dict[str, list[Entry]] = {}
        for chunk in batches(list(dict.fromkeys(keys))):
            self.round_trips += 1
            out.update(parse_lookup(chunk, self._lookup(args=[self.names.namespace, *chunk])))
        return out

    def forget(self, entry: Entry) -> None:
        self.round_trips += 1
        self._forget(args=[self.names.namespace, entry.key, entry.node, entry.raw])

    def remove(self, keys: list[str], node: str = "") -> list[int]:
        out: list[int] = []
        for chunk in batches(keys):
            self.round_trips += 1
            out += [int(n) for n in self._remove(args=[self.names.namespace, node, *chunk])]
        return out


class AsyncDirectory:
    """The same from a daemon (asyncio Redis client), plus listing and the owner's self-check."""

    def __init__(self, redis, names: Names):
        self.redis, self.names = redis, names
        self._lookup = redis.register_script(LOOKUP_LUA)
        self._forget = redis.register_script(FORGET_LUA)
        self._remove = redis.register_script(REMOVE_LUA)
        self._check = redis.register_script(CHECK_LUA)
        self.round_trips = 0

    async def lookup(self, keys: list[str]) -> dict[str, list[Entry]]:
        out: dict[str, list[Entry]] = {}
        for chunk in batches(list(dict.fromkeys(keys))):
            self.round_trips += 1
            out.update(parse_lookup(chunk, await self._lookup(args=[self.names.namespace, *chunk])))
        return out

    async def forget(self, entry: Entry) -> None:
        self.round_trips += 1
        await self._forget(args=[self.names.namespace, entry.key, entry.node, entry.raw])

    async def remove(self, keys: list[str], node: str) -> list[int]:
        out: list[int] = []
        for chunk in batches(keys):
            self.round_trips += 1
            out += [int(n) for n in await self._remove(args=[self.names.namespace, node, *chunk])]
        return out

    async def stale(self, node: str, expected: list[tuple[str, bytes]]) -> list[str]:
        """Keys among ``expected`` (key, entry) whose entry for ``node`` is no longer that value."""
        out: list[str] = []
        for chunk in batches(expected):
            self.round_trips += 1
            flat = [x for pair in chunk for x in pair]
            out += [_text(k) for k in await self._check(args=[self.names.namespace, node, *flat])]
        return out

    async def keys(self, prefix: str, limit: int) -> list[str]:
        """Keys with a live entry whose name starts with ``prefix`` (SCAN, then validated; at most ``limit``)."""
        head = len(self.names.obj(""))
        found: list[str] = []
        async for name in self.redis.scan_iter(match=self.names.obj(glob_escape(prefix)) + "*", count=1000):
            found.append(_text(name)[head:])
            if len(found) >= 4 * limit + BATCH:
                break
        live = await self.lookup(found) if found else {}
        return sorted(k for k, entries in live.items() if entries)[:limit]
