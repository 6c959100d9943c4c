"""The control wire: length-prefixed msgpack frames with a hard maximum, a schema version, and a validator
for every field of every op. Never pickle.

Frame: ``u32 little-endian length`` + a msgpack map. A request is ``{"v": 1, "id": n, "op": name, ...}``; a
reply is ``{"v": 1, "id": n, "ok": true, ...}`` or ``{"v": 1, "id": n, "ok": false, "error": code,
"message": text}``. Payload bytes of the stream data path follow a frame raw: after a ``put`` request
(``size`` bytes) or after a ``get`` reply that carries ``stream: size``. A ``put`` or ``get`` with ``compress``
moves its payload (of at least 64 KiB) as compressed frames instead (kvstore.protocol.compression): after the put
request, or after a get reply that carries ``frames: size`` and ``codec``.
"""

from __future__ import annotations

import bisect
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack

from kvstore.core.meta import MAX_KEY_BYTES, validate_key, validate_ttl
from kvstore.errors import FrameTooLargeError, InvalidArgumentError, InvalidKeyError, ProtocolError
from kvstore.protocol.compression import check_codec

VERSION = 1
MAX_FRAME = 1 << 20
#: Until a connection's ``hello`` succeeds it may send frames of this size at most: a hello is a few hundred
#: bytes, and an unauthenticated peer must not make the daemon buffer or decode a megabyte.
MAX_PREAUTH_FRAME = 16 << 10
LENGTH = struct.Struct("<I")
#: the ops a connection may send before its hello succeeded
PREAUTH_OPS = frozenset({"challenge", "hello"})


@dataclass(frozen=True, slots=True)
class DecodeLimits:
    """Bounds on the work one frame can make ``decode`` do. msgpack's own limits bound each array, map,
    str and bin; ``containers`` bounds the number of arrays and maps in the whole frame (a 1 MiB frame of
    a million empty arrays costs a third of a second of the event loop; scalars are cheap)."""

    array: int
    map: int
    str: int
    bin: int
    containers: int


#: The most objects (keys, put ids, arena entries) one request may name: ``batch_exists``, ``wait``,
#: ``commit_many``, ``arena_commit``. A client checks it before it sends anything (``KVStore.max_batch``).
MAX_BATCH = 4096
#: containers one request may hold: an ``arena_commit`` of 4096 objects, each an entry, its meta, its user map
#: and its shape, with two more maps or arrays of user metadata to spare (about 8 ms of decoding at most)
COMMIT_CONTAINERS = 6 * 4096 + 256
#: What the request schema allows: key lists of 4096 (``batch_exists``, ``wait``, ``commit_many``; arrays get
#: twice that here so that a list just over the limit gets the validator's field error, not a closed
#: connection), str fields of 4096 characters (up to 4 bytes each), the 64-item user metadata nested 8 deep,
#: UCX worker addresses of 64 KiB.
REQUEST_LIMITS = DecodeLimits(array=2 * 4096, map=256, str=4 * 4096, bin=65536, containers=COMMIT_CONTAINERS)
#: Replies come from the daemon the client authenticated (stats, key listings): bounded by the frame.
REPLY_LIMITS = DecodeLimits(array=MAX_FRAME, map=1 << 16, str=MAX_FRAME, bin=MAX_FRAME, containers=MAX_FRAME)


def encode(message: dict[str, Any], limit: int = MAX_FRAME) -> bytes:
    """One frame; FrameTooLargeError (nothing sent) when its body is over ``limit`` (a daemon's --max-frame)."""
    body: bytes = msgpack.packb(message, use_bin_type=True)
    if len(body) > limit:
        raise FrameTooLargeError(f"{message.get('op') or 'reply'}: a frame of {len(body)} bytes exceeds the "
                                 f"maximum of {limit}")
    return LENGTH.pack(len(body)) + body


#: the key bytes one ``ls`` reply carries at most: the rest of the frame is framing, so a listing of any size
#: crosses in frames under MAX_FRAME (the client asks for the next page ``after`` the last key it got)
LS_PAGE_BYTES = MAX_FRAME // 2


def page_of_keys(keys: list[str], after: str, limit: int, page_bytes: int = LS_PAGE_BYTES
                 ) -> tuple[list[str], bool]:
    """The sorted ``keys`` that come after ``after`` ("" : from the first), at most ``limit`` of them and at most
    ``page_bytes`` of key bytes (one key at least); and whether more of the ``limit`` follow this page."""
    start = bisect.bisect_right(keys, after) if after else 0
    stop = min(len(keys), start + max(limit, 0))
    end, size = start, 0
    while end < stop:
        size += 5 + 4 * len(keys[end])  # a str header and at most 4 bytes a character: no encoding pass
        if size > page_bytes and end > start:
            break
        end += 1
    return keys[start:end], end < stop


def frame_length(header: bytes | bytearray | memoryview, limit: int = MAX_FRAME) -> int:
    """The body length a frame header announces; ProtocolError above ``limit`` (``MAX_PREAUTH_FRAME``
    before authentication)."""
    n: int = LENGTH.unpack(header)[0]
    if n > limit:
        when = " before authentication (send hello first)" if limit < MAX_FRAME else ""
        raise ProtocolError(f"frame of {n} bytes exceeds the maximum of {limit}{when}")
    return n


def make_room(buf: bytearray, start: int, end: int, n: int) -> tuple[bytearray, int, int]:
    """Room for ``n`` unread bytes in a receive buffer (the client's and the daemon's framing): its unread bytes
    ``buf[start:end]`` stay where they are when ``n`` bytes fit between ``start`` and the buffer's end; otherwise
    they move to the front, of a new buffer (at least twice as long) when ``buf`` is shorter than ``n``. Returns
    (buffer, start, end) of the unread bytes."""
    if len(buf) - start >= n:
        return buf, start, end
    keep = bytes(buf[start:end])
    if len(buf) < n:
        buf = bytearray(max(n, 2 * len(buf)))
    buf[:len(keep)] = keep
    return buf, 0, len(keep)


_Container = TypeVar("_Container")


class _TooManyContainers(ValueError):
    pass


def decode(body: bytes | memoryview, limits: DecodeLimits = REQUEST_LIMITS) -> dict[str, Any]:
    """One frame body as a map; ProtocolError for anything else, or for more structure than ``limits``."""
    left = [limits.containers]

    def count(container: _Container) -> _Container:
        left[0] -= 1
        if left[0] < 0:
            raise _TooManyContainers(f"more than {limits.containers} arrays and maps in one frame")
        return container

    # every array or map takes at least one byte, so a body no longer than the bound cannot exceed it: the
    # per-container hook (a Python call each) is only needed for larger frames (and never for replies)
    small = len(body) <= limits.containers
    hooks = {} if small or limits.containers >= MAX_FRAME else {"list_hook": count, "object_hook": count}
    try:
        message = msgpack.unpackb(body, raw=False, strict_map_key=True, max_bin_len=limits.bin,
                                  max_str_len=limits.str, max_array_len=limits.array, max_map_len=limits.map,
                                  max_ext_len=0, **hooks)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise ProtocolError(f"malformed frame: {type(exc).__name__}: {exc}") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"frame must hold a map, got {type(message).__name__}")
    return message


# ---- field validators -------------------------------------------------------------------------------
def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgumentError(f"field {name!r} must be a non-negative int, got {value!r}")
    return value


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"field {name!r} must be a bool, got {value!r}")
    return value


def _str(value: Any, name: str) -> str:
    if not isinstance(value, str) or len(value) > 4096:
        raise InvalidArgumentError(f"field {name!r} must be a str of at most 4096 chars, got {value!r:.80}")
    return value


def _opt_str(value: Any, name: str) -> str | None:
    return None if value is None else _str(value, name)


def _key(value: Any, name: str) -> str:
    return validate_key(value)


def _keys(value: Any, name: str) -> list[str]:
    if not isinstance(value, list) or len(value) > 4096:
        raise InvalidArgumentError(f"field {name!r} must be a list of at most 4096 keys")
    return [validate_key(k) for k in value]


def _ttl(value: Any, name: str) -> float | None:
    return validate_ttl(value)


def _touch_ttl(value: Any, name: str) -> float:
    ttl = validate_ttl(value)
    if ttl is None:
        raise InvalidArgumentError(f"field {name!r} must be a positive number of seconds, got None")
    return ttl


def _seconds(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 3600:
        raise InvalidArgumentError(f"field {name!r} must be between 0 and 3600 seconds, got {value!r}")
    return float(value)


def _mode(value: Any, name: str) -> str:
    if not isinstance(value, str) or value not in ("stream", "region", "ucx"):
        raise InvalidArgumentError(f"field {name!r} must be 'stream', 'region' or 'ucx', got {value!r}")
    return value


def _bin(value: Any, name: str) -> bytes:
    if not isinstance(value, bytes) or not 0 < len(value) <= 65536:
        raise InvalidArgumentError(f"field {name!r} must be 1 to 65536 bytes, got {type(value).__name__}")
    return value


def _bytes32(value: Any, name: str) -> bytes:
    if not isinstance(value, bytes) or len(value) != 32:
        raise InvalidArgumentError(f"field {name!r} must be 32 bytes, got {type(value).__name__} "
                                   f"of length {len(value) if isinstance(value, bytes) else '-'}")
    return value


def _opt_bytes32(value: Any, name: str) -> bytes | None:
    return None if value is None else _bytes32(value, name)


def _names(value: Any, name: str) -> list[str]:
    if not isinstance(value, list) or len(value) > 32:
        raise InvalidArgumentError(f"field {name!r} must be a list of at most 32 names")
    return [_str(v, name) for v in value]


def _via(value: Any, name: str) -> str:
    if not isinstance(value, str) or value not in ("auto", "address", "listener"):
        raise InvalidArgumentError(f"field {name!r} must be 'auto', 'address' or 'listener', got {value!r}")
    return value


def _map(value: Any, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidArgumentError(f"field {name!r} must be a map, got {type(value).__name__}")
    return value


def _opt_int(value: Any, name: str) -> int | None:
    return None if value is None else _int(value, name)


def _ints(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or len(value) > 4096:
        raise InvalidArgumentError(f"field {name!r} must be a list of at most 4096 ints")
    return [_int(v, name) for v in value]


def _opt_ints(value: Any, name: str) -> list[int | None]:
    if not isinstance(value, list) or len(value) > 4096:
        raise InvalidArgumentError(f"field {name!r} must be a list of at most 4096 ints or nulls")
    return [_opt_int(v, name) for v in value]


def _commit_entries(value: Any, name: str) -> list[dict[str, Any]]:
    """What ``arena_commit`` makes visible, in order: objects written into an arena (``arena``, ``offset``,
    ``meta``, ``checksum``) and pending puts (``put_id``, ``checksum``)."""
    if not isinstance(value, list) or not 0 < len(value) <= 4096:
        raise InvalidArgumentError(f"field {name!r} must be a list of 1 to 4096 entries")
    out = []
    for entry in value:
        if not isinstance(entry, dict):
            raise InvalidArgumentError(f"field {name!r}: each entry must be a map, got {type(entry).__name__}")
        names = _ARENA_ENTRY if "arena" in entry else _PUT_ENTRY
        if set(entry) - set(names) or any(n not in entry for n in names if n != "checksum"):
            raise InvalidArgumentError(f"field {name!r}: an entry has fields {sorted(map(str, entry))}, "
                                       f"expected {sorted(names)}")
        out.append({n: check(entry.get(n), n) for n, check in names.items()})
    return out


_ARENA_ENTRY: dict[str, Callable[[Any, str], Any]] = {"arena": _int, "offset": _int, "meta": _map,
                                                      "checksum": _opt_int}
_PUT_ENTRY: dict[str, Callable[[Any, str], Any]] = {"put_id": _int, "checksum": _opt_int}

Field = tuple[Callable[[Any, str], Any], bool, Any]  # validator, required, default

_KEY: dict[str, Field] = {"key": (_key, True, None)}
_PUT: dict[str, Field] = {  # a put's fields but the data path ("mode"), which cuda_put implies
    "key": (_key, True, None), "size": (_int, True, None), "meta": (_map, True, None),
    "if_absent": (_bool, False, False), "pin": (_bool, False, False), "checksum": (_opt_int, False, None),
    "ephemeral": (_bool, False, False), "defer": (_bool, False, False)}
#: compression of a stream payload (kvstore.protocol.compression), asked for per transfer
_COMPRESS: Field = (check_codec, False, None)
_GET: dict[str, Field] = {"key": (_key, True, None), "mode": (_mode, True, None), "compress": _COMPRESS}

#: Every op any kvstore daemon accepts, with its fields: the whole protocol, declared once.
SCHEMA: dict[str, dict[str, Field]] = {
    # before hello, a client that holds the token asks the daemon to prove it knows it (protocol.credentials)
    "challenge": {"nonce": (_bytes32, True, None)},
    # "proof" answers the challenge; "token" in clear is an older client's, accepted on a Unix socket only;
    # "node": the cluster node id the client expects to find at this address (refused if it is another)
    "hello": {"client": (_str, False, ""), "token": (_opt_str, False, None), "proof": (_opt_bytes32, False, None),
              "node": (_opt_str, False, None), "transport": (_str, False, "auto"),
              "host": (_str, False, ""), "pid": (_int, False, 0), "transports": (_names, False, [])},
    "ping": {},
    "put": {"key": (_key, True, None), "size": (_int, True, None), "meta": (_map, True, None),
            "if_absent": (_bool, False, False), "pin": (_bool, False, False), "mode": (_mode, True, None),
            "checksum": (_opt_int, False, None), "ephemeral": (_bool, False, False), "defer": (_bool, False, False),
            "compress": _COMPRESS},
    "commit": {"put_id": (_int, True, None), "checksum": (_opt_int, False, None)},
    "commit_many": {"put_ids": (_ints, True, None), "checksums": (_opt_ints, True, None)},
    "abort": {"put_id": (_int, True, None)},
    # same-host clients' arenas (kvstore.core.arena): granted space they allocate from themselves
    "arena": {"size": (_int, True, None), "need": (_int, False, 0), "retire": (_ints, False, [])},
    "arena_release": {"arenas": (_ints, True, None)},
    "arena_commit": {"entries": (_commit_entries, True, None), "if_absent": (_bool, False, False),
                     "pin": (_bool, False, False), "ephemeral": (_bool, False, False)},
    "get": dict(_GET),
    "release": {"lease": (_int, True, None)},
    "lease": dict(_KEY),
    "exists": dict(_KEY),
    "batch_exists": {"keys": (_keys, True, None)},
    "unpin": {"keys": (_keys, True, None)},
    # region-mode gets of several objects at once (same-host shm clients): one lease each, one round trip
    "get_regions": {"keys": (_keys, True, None)},
    "evict": dict(_KEY),
    "remove": dict(_KEY),
    "inspect": dict(_KEY),
    # keep objects at least ttl more seconds (never shortens); the reply has each one's checksum, nil if absent
    "touch": {"keys": (_keys, True, None), "ttl": (_touch_ttl, True, None)},
    # a page of the connections: those with an id above "after" (the last one of the page before)
    "stats": {"after": (_int, False, 0), "limit": (_int, False, 256)},
    "ls": {"prefix": (lambda v, n: "" if v == "" else _str(v, n), False, ""), "limit": (_int, False, 100000),
           "after": (lambda v, n: "" if v == "" else _str(v, n), False, "")},
    "wait": {"keys": (_keys, True, None), "timeout": (_seconds, True, None)},
    "ucx_connect": {"address": (_bin, True, None), "via": (_via, False, "auto")},
    "ucx_claim": {"conn": (_int, True, None)},
    # the cuda_ipc data path (daemons holding GPU segments; see kvstore.transports.cuda_ipc)
    "cuda_segments": {},
    "cuda_put": dict(_PUT),
    "cuda_get": dict(_KEY),
    # what cluster members send each other (cluster daemons only; see kvstore.cluster.daemon)
    "peer_get": dict(_GET),
    "peer_evict": dict(_KEY),
}


#: the field names each op may carry: its schema's and the envelope's
_ALLOWED: dict[str, frozenset[str]] = {op: frozenset(fields) | {"v", "id", "op", "noreply"}
                                       for op, fields in SCHEMA.items()}


def validate(message: dict[str, Any]) -> tuple[str, int, dict[str, Any]]:
    """Check version, id, op and every field; returns (op, request id, clean fields).

    Raises ProtocolError for a bad version or unknown op, InvalidArgumentError/InvalidKeyError for fields."""
    if message.get("v") != VERSION:
        raise ProtocolError(f"schema version {message.get('v')!r} is not supported (this side speaks {VERSION})")
    rid = message.get("id")
    if isinstance(rid, bool) or not isinstance(rid, int):
        raise ProtocolError(f"request id must be an int, got {rid!r}")
    op = message.get("op")
    if not isinstance(op, str) or op not in SCHEMA:
        raise ProtocolError(f"unknown op {op!r}")
    schema = SCHEMA[op]
    fields: dict[str, Any] = {}
    for name, (check, required, default) in schema.items():
        if name in message:
            fields[name] = check(message[name], name)
        elif required:
            raise InvalidArgumentError(f"op {op!r} needs field {name!r}")
        else:
            fields[name] = default
    if not _ALLOWED[op].issuperset(message):
        odd = [k for k in message if not isinstance(k, str)]
        if odd:  # msgpack maps may mix str and bytes names; ours are str only
            raise InvalidArgumentError(f"field names must be str, got {odd[0]!r:.80}")
        unknown = set(message) - _ALLOWED[op]
        raise InvalidArgumentError(f"op {op!r} has unknown fields {sorted(unknown)}")
    return op, rid, fields


def ok_reply(rid: int, **fields: Any) -> dict[str, Any]:
    """The reply to request ``rid`` that succeeded, with ``fields``."""
    return {"v": VERSION, "id": rid, "ok": True, **fields}


def error_reply(rid: int, exc: Exception) -> dict[str, Any]:
    reply = {"v": VERSION, "id": rid, "ok": False, "error": getattr(exc, "code", "Server"), "message": str(exc)}
    needed = getattr(exc, "needed", None)
    if needed is not None:
        reply["extra"] = {"needed": needed, "got": getattr(exc, "got", None)}
    return reply


__all__ = ["VERSION", "MAX_FRAME", "MAX_PREAUTH_FRAME", "PREAUTH_OPS", "DecodeLimits", "REQUEST_LIMITS",
           "REPLY_LIMITS",
           "MAX_KEY_BYTES", "encode", "decode", "frame_length", "validate",
           "ok_reply", "error_reply", "InvalidKeyError"]
