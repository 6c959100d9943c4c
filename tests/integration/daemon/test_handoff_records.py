"""Hand-off status records are any authenticated client's bytes (issue 24, defect 8): ``kvstore requests``
reports a malformed one and lists the rest, against a real daemon."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import msgpack
import pytest
from conftest import child_env

pytestmark = pytest.mark.timeout(60)


def good_record(rid: str) -> dict:
    now = time.time()
    return {"request_id": rid, "state": "fetched", "updated": now, "created": now, "bytes": 4096, "chunks": 2,
            "num_tokens": 32, "model_id": "m", "layout": "nhd", "fingerprint": "ab" * 8, "producer": "p",
            "ttl": 60.0}


MALFORMED = {
    "garbage": b"\xc1\xc1 not msgpack",
    "list": msgpack.packb([1, 2, 3]),
    "missing": msgpack.packb({"request_id": "missing", "state": "fetched"}),
    "wrong-type": msgpack.packb({**good_record("wrong-type"), "created": "yesterday"}),
    "state": msgpack.packb({**good_record("state"), "state": "\x1b[2Jowned"}),
    "other-id": msgpack.packb(good_record("someone-else")),
    "extra-data": msgpack.packb(good_record("extra-data")) + b"\x00",
}


def kv(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstore.cli", *args], capture_output=True, timeout=60,
                          env=child_env())


def test_malformed_status_records_are_reported_and_the_listing_goes_on(daemon_factory):
    d = daemon_factory(capacity="16MiB")
    with d.connect("tcp") as s:
        s.put("hf/fine/status", msgpack.packb(good_record("fine")))
        for rid, blob in MALFORMED.items():
            s.put(f"hf/{rid}/status", blob)
    listed = kv("requests", "--url", d.unix_url, "--json")
    assert listed.returncode == 0, listed.stderr.decode()
    records = {r["request_id"]: r for r in json.loads(listed.stdout)}
    assert records["fine"]["state"] == "fetched"
    assert {rid for rid, r in records.items() if r["state"] == "invalid"} == set(MALFORMED)
    assert "created" in records["wrong-type"]["error"] and "someone-else" in records["other-id"]["error"]
    table = kv("requests", "--url", d.unix_url)
    assert table.returncode == 0, table.stderr.decode()
    out = table.stdout.decode()
    assert "\x1b" not in out and "\\x1b" in out  # the forged state is shown escaped, never sent to the terminal
    assert len(out.splitlines()) == 1 + 1 + len(MALFORMED)
