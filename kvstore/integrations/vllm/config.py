"""ConnectorConfig: the connector's options, read once from ``kv_connector_extra_config``.

    kv_connector_extra_config={"url": "unix:///run/kvstore.sock", "timeout_s": 5, ...}

``url`` defaults to ``$KVSTORE_URL``. Unknown keys and wrong types are refused at engine start with a
ValueError naming the key, so a typo never silently turns the cache off.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any


@dataclasses.dataclass(frozen=True, slots=True)
class ConnectorConfig:
    url: str
    #: Data path to the daemon: "auto" (shared memory on the same host, else TCP), "shm" or "tcp".
    transport: str = "auto"
    #: Deadline of every store call, seconds (a stuck daemon costs at most this, then the call is a fault).
    timeout_s: float = 5.0
    #: After a fault, the next attempt to reconnect waits this long (calls meanwhile skip the store).
    retry_s: float = 2.0
    #: True: engine start fails with a clear error when no store answers at ``url``. False: start degraded
    #: (every lookup misses, saves are dropped, reconnects every ``retry_s``).
    require_store_at_start: bool = True
    #: Verify every loaded block against the checksum recorded at commit (a mismatch is a load error).
    verify: bool = True
    #: "auto" / "async": a saver thread gathers the blocks straight from the cache into the store while vLLM
    #: keeps the blocks (``request_finished`` returns True until the save lands); "sync": saved inside
    #: ``wait_for_save`` on the engine thread (the old behaviour, kept for A/B measurements).
    save_mode: str = "auto"
    #: Async saves: at most this many bytes queued; beyond it a save is dropped (and counted).
    max_pending_save_bytes: int = 256 << 20
    #: True: store hits load on a worker thread (``get_num_new_matched_tokens`` returns ``(n, True)``) while the
    #: running batch keeps decoding; False: loaded in ``start_load_kv`` before the forward pass.
    async_loads: bool = True
    #: Seconds the scheduler waits inline for a lookup before answering "not yet" (None) and asking again on a
    #: later step: a healthy daemon answers within it, a slow or dead one costs the scheduler at most this.
    lookup_wait_s: float = 0.002
    #: Decode side: how long a request whose ``kv_transfer_params`` promise blocks still being saved waits for
    #: them (re-asking every step) before it computes what is missing (counted and logged as a promised miss).
    handoff_wait_s: float = 10.0
    #: Prefill side (kv_producer): hand-off blocks are pinned in the store (never evicted) for this many
    #: seconds, then expire; the decode instance must load them within it.
    handoff_ttl_s: float = 300.0
    #: Seconds a saved block lives in the store (None: until evicted).
    ttl_s: float | None = None
    #: False: the connector sets vLLM's ``kv_load_failure_policy`` to "recompute" (a store fault never
    #: fails a request). True: leave vLLM's policy as configured.
    keep_load_failure_policy: bool = False
    #: With vLLM's KV events on: at most this many of the connector's events (and as many records per worker)
    #: wait to be taken; older ones are dropped and counted (``events_dropped``).
    max_events: int = 10_000
    #: A file to append this engine's step log to (:mod:`.steplog`: one line per engine step and per finished
    #: request, and ``<step_log>.worker<rank>`` per worker: the KV bytes and seconds moved per request).
    #: None: off. A path that cannot be opened is a StepLogError at engine start.
    step_log: str | None = None
    #: Lines per step-log file at most; past it the rest is dropped (a ``truncated`` line says so).
    step_log_max_records: int = 1_000_000
    #: False: this instance moves no KV at all (no store connection, no lookups, loads or saves; ``url`` is not
    #: needed): the connector only records its steps (``step_log``), e.g. on a colocated instance that is
    #: compared with a prefill/decode pair.
    transfers: bool = True

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        extra = dict(extra or {})
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - set(fields))
        if unknown:
            raise ValueError(f"kvstore connector: unknown kv_connector_extra_config keys {unknown}; "
                             f"known: {sorted(fields)}")
        url = extra.pop("url", None) or os.environ.get("KVSTORE_URL")
        if extra.get("transfers") is False and not url:
            url = ""
        elif not isinstance(url, str) or not url:
            raise ValueError("kvstore connector: set kv_connector_extra_config['url'] (e.g. "
                             "'unix:///run/kvstore.sock') or $KVSTORE_URL")
        _check_step_log(extra)
        for name, value in extra.items():
            if name != "step_log":
                _check(name, value, fields[name].default)
        if extra.get("save_mode", "auto") not in ("auto", "sync", "async"):
            raise ValueError(f"kvstore connector: save_mode must be 'auto', 'sync' or 'async', got "
                             f"{extra['save_mode']!r}")
        if extra.get("transport", "auto") not in ("auto", "shm", "tcp"):
            raise ValueError(f"kvstore connector: transport must be 'auto', 'shm' or 'tcp', got {extra['transport']!r}")
        return cls(url=url, **extra)


def _check_step_log(extra: dict[str, Any]) -> None:
    from kvstore.integrations.vllm.steplog import StepLogError

    path = extra.get("step_log")
    if path is not None and (not isinstance(path, str) or not path):
        raise StepLogError(f"kvstore connector: kv_connector_extra_config['step_log'] = {path!r} is invalid "
                           "(expected a file path, or None for no step log)")
    n = extra.get("step_log_max_records", 2)
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise StepLogError(f"kvstore connector: kv_connector_extra_config['step_log_max_records'] = {n!r} is "
                           "invalid (expected an int >= 2)")


def _check(name: str, value: Any, default: Any) -> None:
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, float) or default is None:
        ok = (value is None and default is None) or (
            isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0)
    elif isinstance(default, str):
        ok = isinstance(value, str)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    else:
        ok = True
    if not ok:
        raise ValueError(f"kvstore connector: kv_connector_extra_config[{name!r}] = {value!r} is invalid "
                         f"(expected {_expected(default)})")


def _expected(default: Any) -> str:
    if isinstance(default, bool):
        return "a bool"
    return "a str" if isinstance(default, str) else "a positive number"
