"""Bad arguments and damaged data get typed errors (kvstore.errors), never OverflowError, UnicodeDecodeError or a
traceback (issue 24), and a failed read leaves the caller's buffer as it was."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
from conftest import child_env, short_tmpdir, wait_until

import kvstore
from kvstore.errors import DiskReadError, HandoffAbortedError, InvalidArgumentError, ObjectTooLargeError

pytestmark = pytest.mark.timeout(120)
MiB = 1 << 20


def test_overflowing_sizes_and_timeouts_are_typed(daemon_factory):
    with pytest.raises(InvalidArgumentError, match="capacity"):
        kvstore.KVStore.embedded(capacity=10**20)
    d = daemon_factory(capacity="8MiB")
    for bad in (math.inf, math.nan, 0, -1, True):
        with pytest.raises(InvalidArgumentError, match="timeout"):
            kvstore.connect(d.tcp_url, token=d.token, timeout=bad)
    with d.connect("tcp") as s:
        with pytest.raises(ObjectTooLargeError):
            with s.reserve("huge", 2**63):
                pass
        s.ping()


def test_get_to_a_closed_stdout_is_a_message_not_a_traceback(daemon_factory):
    d = daemon_factory(capacity="8MiB")
    with d.connect("shm") as s:
        s.put("k", b"v" * 1000)
    proc = subprocess.run([sys.executable, "-m", "kvstore.cli", "get", "k", "-", "--url", d.unix_url],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=child_env(), timeout=60,
                          preexec_fn=lambda: os.close(1))
    err = proc.stderr.decode()
    assert proc.returncode == 2 and "Traceback" not in err and "stdout" in err, err


def test_a_corrupted_disk_copy_leaves_the_callers_buffer_alone():
    path = short_tmpdir()
    try:
        s = kvstore.KVStore.embedded("2MiB", disk_path=path, disk_capacity="64MiB")
        s.put("lost", b"\x01" * (256 << 10))
        assert s.evict("lost")
        assert wait_until(lambda: s.stats()["disk_pending_writes"] == 0, 30)
        name = [n for n in os.listdir(path) if n.endswith(".kv")][0]
        with open(os.path.join(path, name), "r+b") as f:
            f.seek(4096 + 100)
            f.write(b"\xff" * 16)
        out = bytearray(b"\x07" * (256 << 10))
        with pytest.raises(DiskReadError):
            s.get_into("lost", out)
        assert out == bytearray(b"\x07" * (256 << 10))
        s.close()
    finally:
        subprocess.run(["rm", "-rf", path], check=False)


def test_a_flipped_byte_in_handoff_metadata_is_typed(daemon_factory):
    from handoff_child import caches, layout

    from kvstore.handoff import KVHandoff, request_keys

    lay = layout()
    d = daemon_factory(capacity="32MiB")
    with d.connect("tcp") as s:
        h = KVHandoff(s, lay, chunk_blocks=2)
        h.publish("r", caches(4, seed=1), [0, 1], num_tokens=2 * lay.block_size).wait()
        key = request_keys("r")["meta"]
        blob = bytearray(s.get(key))
        blob[len(blob) // 2] ^= 0x80  # a flipped byte, as a stray write or another client would leave it
        s.put(key, bytes(blob))  # the checksum is of the new bytes: decoding is what must fail typed
        with pytest.raises(HandoffAbortedError, match="metadata"):
            h.fetch("r", caches(4, seed=2), [2, 3], num_tokens=2 * lay.block_size)
