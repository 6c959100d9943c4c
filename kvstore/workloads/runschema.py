"""The run-log schema: what ``benchmarks/pd`` writes for a run (and ``kvstore plan`` for a simulation), and
what :mod:`kvstore.workloads.runlog` reads back. One place for field names, units and which times are
absolute, used by the writers and the reader alike.

A run directory holds ``requests.jsonl`` (one request per line, fields :data:`REQUEST_FIELDS`),
``summary.json`` (aggregates and the deployment; a log written to this schema says so under
:data:`SCHEMA_KEY`) and optionally ``timeline.jsonl`` (one engine step per line).

Times: a field with ``absolute=True`` is seconds on the run's clock (the same clock as ``arrival_s``); every
other ``*_s`` field is a duration in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SCHEMA_VERSION = 1
SCHEMA_KEY = "runlog_schema"  # summary.json: the version of this schema the run was written to
REQUESTS_FILE = "requests.jsonl"
SUMMARY_FILE = "summary.json"
TIMELINE_FILE = "timeline.jsonl"


@dataclass(frozen=True, slots=True)
class Field:
    name: str
    unit: str  # "s", "tokens", "bytes", "count", "id", "flag", "" (free text)
    absolute: bool = False  # seconds on the run's clock (else a duration, or not a time)
    required: bool = False  # the reader refuses a line without it


REQUEST_FIELDS: tuple[Field, ...] = (
    Field("id", "id"), Field("class", "id"),
    Field("arrival_s", "s", absolute=True, required=True),
    Field("prompt_tokens", "tokens", required=True), Field("output_tokens", "tokens"),
    Field("target_output_tokens", "tokens"),
    Field("dispatch_s", "s", absolute=True),
    Field("prefill_worker", "id"), Field("decode_worker", "id"),
    Field("prefill_queue_s", "s"),
    Field("prefill_start_s", "s", absolute=True, required=True),
    Field("prefill_end_s", "s", absolute=True, required=True),
    Field("ttft_s", "s", required=True), Field("tpot_s", "s"), Field("e2e_s", "s"),
    Field("decode_queue_s", "s"),
    Field("decode_admit_s", "s", absolute=True),
    Field("token_times_s", "s", absolute=True, required=True),  # a list: one time per output token
    Field("output_token_ids", "id"),
    Field("kv_bytes", "bytes"), Field("kv_bytes_transferred", "bytes"),
    Field("transfer_s", "s"), Field("publish_s", "s"), Field("fetch_s", "s"),
    Field("recomputed", "count"), Field("refetched", "count"), Field("lost", "flag"), Field("errors", ""),
)
FIELDS: dict[str, Field] = {f.name: f for f in REQUEST_FIELDS}
REQUIRED: tuple[str, ...] = tuple(f.name for f in REQUEST_FIELDS if f.required)
ABSOLUTE_TIMES: frozenset[str] = frozenset(f.name for f in REQUEST_FIELDS if f.absolute)


def missing_fields(row: dict[str, Any]) -> list[str]:
    """The required fields ``row`` lacks, in schema order."""
    return [name for name in REQUIRED if name not in row]


def request_row(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` as one ``requests.jsonl`` line, in schema order; ValueError if a field is not in the schema
    or a required one is missing (a writer that drifted from the reader fails here, not in the planner)."""
    unknown = sorted(set(values) - FIELDS.keys())
    missing = missing_fields(values)
    if unknown or missing:
        raise ValueError(f"run-log row does not fit the schema: unknown fields {unknown}, missing {missing}")
    return {name: values[name] for name in FIELDS if name in values}


def summary_header() -> dict[str, Any]:
    """The keys every summary.json written to this schema starts with."""
    return {SCHEMA_KEY: SCHEMA_VERSION}
