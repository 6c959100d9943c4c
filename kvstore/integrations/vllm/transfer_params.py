"""The hand-off's ``kv_transfer_params``: what a prefill instance promises a decode instance, verifiably.

The prefill side's ``request_finished`` returns (vLLM puts it in ``RequestOutput.kv_transfer_params`` and in
the OpenAI server's completion response; a router sends it unchanged as the decode request's
``kv_transfer_params``)::

    {"kvstore": {"version": 1, "fingerprint": "<layout fingerprint>", "num_tokens": <tokens covered>,
                 "saved_blocks": <blocks saved or being saved>, "dropped_blocks": <blocks not saved>,
                 "pending": <bool: saves still in flight when the prefill finished>}}

The decode side reads ``request.kv_transfer_params["kvstore"]`` (:func:`parse`): it waits, bounded, for
promised blocks still in flight instead of recomputing them, and counts and logs a promised block that never
arrives. A router marks the prefill hop's request with ``{"kvstore": {"do_remote_decode": true}}`` (a
request for a promise, not a promise: nothing to wait for). Parameters of another connector (no ``"kvstore"``
entry) are ignored; a malformed entry is logged and
ignored (the request is computed as if nothing were promised) — a router's bug must not fail the request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

VERSION = 1
NAME = "kvstore"


@dataclass(frozen=True, slots=True)
class Promise:
    fingerprint: str
    num_tokens: int
    saved_blocks: int
    dropped_blocks: int
    pending: bool

    def to_params(self) -> dict[str, Any]:
        return {NAME: {"version": VERSION, "fingerprint": self.fingerprint, "num_tokens": self.num_tokens,
                       "saved_blocks": self.saved_blocks, "dropped_blocks": self.dropped_blocks,
                       "pending": self.pending}}


class BadParams(ValueError):
    """``kv_transfer_params["kvstore"]`` is not a version-1 promise (the message says which field)."""


def parse(params: Any) -> Promise | None:
    """The promise in a request's ``kv_transfer_params``; None when there is none (no params, or another
    connector's). BadParams when the ``"kvstore"`` entry is malformed."""
    if not isinstance(params, dict) or NAME not in params:
        return None
    entry = params[NAME]
    if not isinstance(entry, dict):
        raise BadParams(f"kv_transfer_params['kvstore'] must be a dict, got {type(entry).__name__}")
    if "version" not in entry and entry.get("do_remote_decode") is True:
        return None  # the prefill hop's marker: this instance is asked to save and report, not to load
    if entry.get("version") != VERSION:
        raise BadParams(f"kv_transfer_params['kvstore']['version'] is {entry.get('version')!r}; this connector "
                        f"reads version {VERSION}")
    fingerprint = entry.get("fingerprint")
    if not isinstance(fingerprint, str) or not fingerprint:
        raise BadParams(f"kv_transfer_params['kvstore']['fingerprint'] must be a non-empty str, got {fingerprint!r}")
    counts = {}
    for name in ("num_tokens", "saved_blocks", "dropped_blocks"):
        value = entry.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise BadParams(f"kv_transfer_params['kvstore'][{name!r}] must be an int >= 0, got {value!r}")
        counts[name] = value
    pending = entry.get("pending")
    if not isinstance(pending, bool):
        raise BadParams(f"kv_transfer_params['kvstore']['pending'] must be a bool, got {pending!r}")
    return Promise(fingerprint=fingerprint, pending=pending, **counts)
