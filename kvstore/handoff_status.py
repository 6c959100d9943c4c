"""Hand-off status records (``hf/<rid>/status``, written by :class:`kvstore.handoff.KVHandoff`): a request's
keys, parsing a record that any client may have written, and the listing of ``kvstore requests``. Without
torch, so that listing starts in a fraction of a second."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import msgpack

from kvstore.errors import KeyNotFoundError

if TYPE_CHECKING:
    from kvstore.client.store import KVStore

#: what a status record holds (``KVHandoff._status``); any authenticated client can write ``hf/``, so a reader
#: checks every field before it trusts one
_STATUS_FIELDS = {"request_id": str, "state": str, "updated": (int, float), "created": (int, float), "bytes": int,
                  "chunks": int, "num_tokens": int, "model_id": str, "layout": str, "fingerprint": str,
                  "producer": str, "ttl": (int, float)}
_STATUS_STATES = ("publishing", "published", "fetched", "cancelled")
_STATUS_MAX_BYTES = 64 << 10
STATUS_GRACE_S = 600.0  # status records outlive their request by this long, so "expired" can be shown


def request_keys(request_id: str) -> dict[str, str]:
    return {name: f"hf/{request_id}/{name}" for name in ("meta", "claim", "cancel", "status")}


def parse_status(key: str, blob: bytes) -> dict:
    """The status record stored at ``key`` (``hf/<rid>/status``) as KVHandoff writes it. A malformed one (not
    msgpack, a field missing or of the wrong type, an unknown state, another request's id) becomes a record in
    state ``invalid`` with an ``error`` saying why, so that a listing reports it and goes on."""
    rid = key[len("hf/"):-len("/status")]
    problem, record = None, {}
    if len(blob) > _STATUS_MAX_BYTES:
        problem = f"{len(blob)} bytes, more than a status record holds"
    else:
        try:
            record = msgpack.unpackb(blob, raw=False)
        except (ValueError, TypeError) as exc:  # msgpack's errors (ExtraData, FormatError…) are ValueErrors
            problem = f"not msgpack ({type(exc).__name__})"
    if problem is None and not isinstance(record, dict):
        problem = f"a msgpack {type(record).__name__}, not a map"
    for name, kind in _STATUS_FIELDS.items() if problem is None else ():
        value = record.get(name)
        if isinstance(value, bool) or not isinstance(value, kind):
            problem = f"field {name!r} is {'missing' if value is None else type(value).__name__}"
            break
    if problem is None and record["state"] not in _STATUS_STATES:
        problem = f"unknown state {record['state'][:40]!r}"
    if problem is None and record["request_id"] != rid:
        problem = f"it names request {record['request_id'][:40]!r}"
    if problem is None:
        return record
    now = time.time()
    return {"request_id": rid, "state": "invalid", "error": problem, "updated": now, "created": now, "bytes": 0,
            "chunks": 0, "num_tokens": 0, "model_id": "", "layout": "", "fingerprint": "", "producer": "", "ttl": 0,
            "age_s": 0.0}


def list_requests(store: KVStore) -> list[dict]:
    """Every request with a status record: state, bytes, chunks, layout, age."""
    out = []
    for key in store.keys("hf/"):
        if not key.endswith("/status"):
            continue
        try:
            record = parse_status(key, bytes(store.get(key)))
        except KeyNotFoundError:
            continue
        if record["state"] == "invalid":
            out.append(record)
            continue
        keys = request_keys(record["request_id"])
        if record["state"] in ("publishing", "published") and not store.exists(keys["meta"]):
            if store.exists(keys["claim"]):
                record["state"] = "publishing"
            else:  # never committed (producer died) or gone at its TTL
                expired = time.time() - record["created"] >= record["ttl"]
                record["state"] = "expired" if expired else "aborted"
        record["age_s"] = round(time.time() - record["created"], 3)
        out.append(record)
    return out
