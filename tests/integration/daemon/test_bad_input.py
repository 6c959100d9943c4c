"""Bad input against a real daemon, over raw sockets (frames built with kvstore.protocol.wire).

Every case must get a typed error reply (or, for broken framing, a closed connection); afterwards the
daemon keeps serving other clients and the objects stored before the bad input are intact, byte-exact.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
import subprocess
import sys

import msgpack
import numpy as np
import pytest
import xxhash
from conftest import MiB, child_env, free_port, shm_segments, wait_until

import kvstore
from kvstore.core.meta import ObjectMeta
from kvstore.protocol import wire
from kvstore.protocol.url import host_id

pytestmark = pytest.mark.timeout(60)

CAPACITY = 64 * MiB
SENTINELS = {  # inline, just over the inline limit, and large
    "sentinel/small": np.random.default_rng(1).integers(0, 256, 100, dtype=np.uint8).tobytes(),
    "sentinel/medium": np.random.default_rng(2).integers(0, 256, (64 << 10) + 1, dtype=np.uint8).tobytes(),
    "sentinel/large": np.random.default_rng(3).integers(0, 256, 4 * MiB, dtype=np.uint8).tobytes(),
}
CLOSED = "closed"


class RawClient:
    """A hand-rolled client: send any bytes, read reply frames, notice a closed connection."""

    def __init__(self, url: str, timeout: float = 10.0):
        if url.startswith("unix://"):
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(timeout)
            self.sock.connect(url[len("unix://"):])
        else:
            host, port = url[len("tcp://"):].rsplit(":", 1)
            self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.next_id = 100

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def frame(self, message: dict, add: bool = True) -> int:
        """Send ``message`` (``v`` and ``id`` filled in unless given); return its id."""
        if add:
            self.next_id += 1
            message = {"v": wire.VERSION, "id": self.next_id, **message}
        self.send(raw_frame(message))
        return message.get("id")

    def reply(self) -> dict | str:
        """The next reply frame, or CLOSED if the daemon closed the connection first."""
        try:
            header = self._exact(4)
            if header is None:
                return CLOSED
            body = self._exact(struct.unpack("<I", header)[0])
        except ConnectionResetError:
            return CLOSED
        if body is None:
            return CLOSED
        return msgpack.unpackb(body, raw=False)

    def _exact(self, n: int) -> bytes | None:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                return None
            buf += chunk
        return buf

    def call(self, message: dict) -> dict | str:
        self.frame(message)
        return self.reply()

    def hello(self, **fields) -> dict:
        reply = self.call({"op": "hello", "client": "raw-test", "transport": "tcp", "host": host_id(),
                           "pid": os.getpid(), **fields})
        assert reply != CLOSED and reply["ok"], reply
        return reply

    def is_closed(self) -> bool:
        """True if the daemon has closed this connection (it sends nothing more)."""
        return self.reply() == CLOSED

    def close(self) -> None:
        self.sock.close()


def raw_frame(message) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    return struct.pack("<I", len(body)) + body


def put_meta(key: str, size: int) -> dict:
    return ObjectMeta(key=key, size=size).to_wire()


@pytest.fixture(scope="module")
def served(daemon):
    """The module daemon with the sentinel objects stored through both paths."""
    with daemon.connect("shm") as s:
        for key, value in SENTINELS.items():
            s.put(key, value)
    return daemon


@pytest.fixture
def raw(served):
    clients: list[RawClient] = []

    def make(url: str | None = None, hello: bool = True, **fields) -> RawClient:
        c = RawClient(url or served.tcp_url)
        clients.append(c)
        if hello:
            c.hello(**{**served.hello_auth(c.call), **fields})
        return c

    yield make
    for c in clients:
        c.close()
    assert_still_serving(served)


def assert_still_serving(d) -> None:
    """The daemon is alive, serves new clients over both paths, and the sentinels are byte-exact."""
    assert d.running(), f"daemon died:\n{d.log()}"
    for transport in ("shm", "tcp"):
        with d.connect(transport, timeout=5) as s:
            for key, value in SENTINELS.items():
                assert bytes(s.get(key)) == value, f"{key} changed ({transport})"
                out = bytearray(len(value))
                assert s.get_into(key, out) == len(value) and bytes(out) == value
            s.put("sentinel/probe", b"probe")
            assert s.remove("sentinel/probe")
            stats = s.stats()
            assert stats["pending"] == 0, stats
            assert stats["objects"] >= len(SENTINELS)


def assert_error(reply, code: str, *words: str, rid: int | None = None) -> None:
    assert reply != CLOSED, f"expected a {code} error reply, the connection was closed"
    assert reply["ok"] is False and reply["error"] == code, reply
    for word in words:
        assert word in reply["message"], (word, reply["message"])
    if rid is not None:
        assert reply["id"] == rid, reply


def assert_usable(c: RawClient) -> None:
    reply = c.call({"op": "ping"})
    assert reply != CLOSED and reply["ok"], reply


# ---- broken framing --------------------------------------------------------------------------------------
@pytest.mark.parametrize("body", [b"\xc1\xc1\xc1\xc1", b"\x92\x01", b"", b"\xa3abc", b"\x81\x01\x02",
                                  b"\xdf\xff\xff\xff\xff"],
                         ids=["garbage", "array", "empty", "str", "int-map-key", "huge-map-header"])
def test_malformed_msgpack(raw, body):
    c = raw()
    c.send(struct.pack("<I", len(body)) + body)
    reply = c.reply()
    assert_error(reply, "Protocol")
    other = raw()  # another client is unaffected
    assert_usable(other)


def test_truncated_frame_then_close(raw, served):
    c = raw()
    frame = raw_frame({"v": 1, "id": 5, "op": "exists", "key": "sentinel/small"})
    c.send(frame[:len(frame) // 2])
    c.close()
    c2 = raw()
    c2.send(raw_frame({"v": 1, "id": 6, "op": "put", "key": "half", "size": 1000, "meta": put_meta("half", 1000),
                       "mode": "stream"}) + b"x" * 400)
    c2.close()  # payload cut short: the put must be aborted
    with served.connect("tcp") as s:
        assert not s.exists("half")
        assert wait_pending_zero(s)


def wait_pending_zero(s) -> bool:
    return wait_until(lambda: s.stats()["pending"] == 0, 5.0)


@pytest.mark.parametrize("length", [wire.MAX_FRAME + 1, 0xFFFFFFFF])
def test_frame_over_the_maximum_closes_the_connection(raw, length):
    c = raw()
    c.send(struct.pack("<I", length) + b"\x80" * 1000)
    reply = c.reply()
    if reply != CLOSED:  # an error reply first is allowed, then the close
        assert_error(reply, "Protocol", str(wire.MAX_FRAME))
        assert c.is_closed()
    assert_usable(raw())


def test_frame_at_the_maximum_is_accepted(raw):
    c = raw()
    filler = ["x" * 16000] * ((wire.MAX_FRAME - 200) // 16003)  # strs and lists within the decode limits
    message = {"v": 1, "id": 9, "op": "ping", "pad": filler}  # unknown field, but framing is fine
    body = msgpack.packb(message)
    assert len(body) <= wire.MAX_FRAME
    c.send(struct.pack("<I", len(body)) + body)
    assert_error(c.reply(), "InvalidArgument", "pad", rid=9)
    assert_usable(c)



def test_large_frame_before_hello_is_refused(raw):
    """An unauthenticated peer may send small frames only: the daemon does not buffer a megabyte for it."""
    c = raw(hello=False)
    c.send(struct.pack("<I", wire.MAX_PREAUTH_FRAME + 1) + b"\x80" * 100)
    reply = c.reply()
    if reply != CLOSED:
        assert_error(reply, "Protocol", str(wire.MAX_PREAUTH_FRAME), "authentication")
        assert c.is_closed()
    assert_usable(raw())


def test_frame_of_a_million_empty_arrays_is_refused(raw):
    """Bounded decode work: a frame that is nothing but containers gets a Protocol error, not 0.3 s of the loop."""
    c = raw()
    bomb = {"v": 1, "id": 9, "op": "ping", "pad": [[[]] * 4000 for _ in range(200)]}
    c.send(raw_frame(bomb))
    reply = c.reply()
    if reply != CLOSED:
        assert_error(reply, "Protocol", "arrays and maps")
    assert_usable(raw())

# ---- bad requests in good frames ------------------------------------------------------------------------
BAD_REQUESTS = {
    # name: (message, expected error code, words in the message)
    "unknown-op": ({"v": 1, "id": 7, "op": "frobnicate"}, "Protocol", ["frobnicate"]),
    "op-missing": ({"v": 1, "id": 7, "key": "a"}, "Protocol", []),
    "op-not-str": ({"v": 1, "id": 7, "op": 3}, "Protocol", []),
    "version-2": ({"v": 2, "id": 7, "op": "ping"}, "Protocol", ["version"]),
    "version-missing": ({"id": 7, "op": "ping"}, "Protocol", ["version"]),
    "version-str": ({"v": "1", "id": 7, "op": "ping"}, "Protocol", ["version"]),
    "id-str": ({"v": 1, "id": "seven", "op": "ping"}, "Protocol", ["id"]),
    "key-int": ({"v": 1, "id": 7, "op": "exists", "key": 123}, "InvalidKey", []),
    "key-list": ({"v": 1, "id": 7, "op": "get", "key": ["a"], "mode": "stream"}, "InvalidKey", []),
    "key-empty": ({"v": 1, "id": 7, "op": "exists", "key": ""}, "InvalidKey", ["empty"]),
    "key-bad-utf8": ({"v": 1, "id": 7, "op": "exists", "key": b"\xff\xfe\xfd"}, "InvalidKey", ["UTF-8"]),
    "key-1025": ({"v": 1, "id": 7, "op": "exists", "key": "k" * 1025}, "InvalidKey", ["1025", "1024"]),
    "key-missing": ({"v": 1, "id": 7, "op": "exists"}, "InvalidArgument", ["key"]),
    "mode-missing": ({"v": 1, "id": 7, "op": "get", "key": "sentinel/small"}, "InvalidArgument", ["mode"]),
    "mode-bad": ({"v": 1, "id": 7, "op": "get", "key": "sentinel/small", "mode": "teleport"}, "InvalidArgument",
                 ["mode"]),
    "unknown-field": ({"v": 1, "id": 7, "op": "exists", "key": "a", "bogus": 1}, "InvalidArgument", ["bogus"]),
    "timeout-str": ({"v": 1, "id": 7, "op": "wait", "keys": ["a"], "timeout": "soon"}, "InvalidArgument",
                    ["timeout"]),
    "timeout-negative": ({"v": 1, "id": 7, "op": "wait", "keys": ["a"], "timeout": -1}, "InvalidArgument",
                         ["timeout"]),
    "keys-not-list": ({"v": 1, "id": 7, "op": "batch_exists", "keys": "abc"}, "InvalidArgument", ["keys"]),
    "keys-too-many": ({"v": 1, "id": 7, "op": "batch_exists", "keys": ["k"] * 5000}, "InvalidArgument", ["keys"]),
    "keys-bad-member": ({"v": 1, "id": 7, "op": "batch_exists", "keys": ["ok", ""]}, "InvalidKey", []),
    "limit-negative": ({"v": 1, "id": 7, "op": "ls", "prefix": "", "limit": -1}, "InvalidArgument", ["limit"]),
    "limit-bool": ({"v": 1, "id": 7, "op": "ls", "limit": True}, "InvalidArgument", ["limit"]),
    "lease-str": ({"v": 1, "id": 7, "op": "release", "lease": "x"}, "InvalidArgument", ["lease"]),
    "lease-unknown": ({"v": 1, "id": 7, "op": "release", "lease": 987654321}, "Lease", []),
    "commit-unknown": ({"v": 1, "id": 7, "op": "commit", "put_id": 987654321}, "Lease", []),
    "abort-unknown": ({"v": 1, "id": 7, "op": "abort", "put_id": 987654321}, "Lease", []),
    "missing-object": ({"v": 1, "id": 7, "op": "get", "key": "no/such", "mode": "stream"}, "KeyNotFound",
                       ["no/such"]),
    "region-over-tcp": ({"v": 1, "id": 7, "op": "get", "key": "sentinel/small", "mode": "region"}, "Transport",
                        ["shm"]),
    "key-none": ({"v": 1, "id": 7, "op": "evict", "key": None}, "InvalidKey", []),
    # declared in the one schema, served by cluster members only
    "cluster-op-on-a-single-daemon": ({"v": 1, "id": 7, "op": "peer_get", "key": "sentinel/small", "mode": "stream"},
                                      "Protocol", ["peer_get", "not served"]),
    "mixed-field-names": ({"v": 1, "id": 7, "op": "ping", b"op": "ping", "z": 1}, "InvalidArgument", ["str"]),
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_request_gets_error_reply(raw, name):
    message, code, words = BAD_REQUESTS[name]
    c = raw()
    c.send(raw_frame(message))
    reply = c.reply()
    rid = message["id"] if code != "Protocol" else None
    assert_error(reply, code, *words, rid=rid)
    if code != "Protocol":  # a field error leaves the connection usable
        assert_usable(c)
    assert_usable(raw())


# ---- bad puts: the payload in flight is skipped or the connection closed ---------------------------------
def stream_put(c: RawClient, key, size, payload: bytes | None = None, **overrides) -> int:
    message = {"op": "put", "key": key, "size": size, "meta": put_meta(key if isinstance(key, str) else "x", size),
               "mode": "stream", **overrides}
    rid = c.frame(message)
    if payload is not None:
        c.send(payload)
    return rid


@pytest.mark.parametrize("case", ["meta-key-mismatch", "meta-size-mismatch", "meta-not-map", "meta-bad-field",
                                  "if-absent-str", "empty-key", "bad-utf8-key", "long-key", "unknown-field",
                                  "key-exists", "meta-object-dtype", "meta-shape-not-size", "meta-structured"])
def test_bad_stream_put_payload_is_skipped(raw, served, case):
    """The request is refused, the payload that follows is skipped, and the connection stays usable."""
    c = raw()
    size = 200_000
    payload = b"\x5a" * size
    key = f"badput/{case}"
    overrides: dict = {}
    code = "InvalidArgument"
    if case == "meta-key-mismatch":
        overrides["meta"] = put_meta("other", size)
    elif case == "meta-size-mismatch":
        overrides["meta"] = put_meta(key, size + 1)
    elif case == "meta-not-map":
        overrides["meta"] = [1, 2]
    elif case == "meta-bad-field":
        overrides["meta"] = {**put_meta(key, size), "shape": ["x"]}
    elif case == "meta-object-dtype":  # a consumer's .numpy() would read pointers out of these bytes
        overrides["meta"] = {**put_meta(key, size), "kind": "numpy", "dtype": "|O", "shape": [size // 8]}
    elif case == "meta-shape-not-size":
        overrides["meta"] = {**put_meta(key, size), "kind": "numpy", "dtype": "<f4", "shape": [size]}
    elif case == "meta-structured":
        overrides["meta"] = {**put_meta(key, size), "kind": "numpy", "dtype": "i4,i4", "shape": [size // 8]}
    elif case == "if-absent-str":
        overrides["if_absent"] = "yes"
    elif case == "empty-key":
        key, code = "", "InvalidKey"
    elif case == "bad-utf8-key":
        key, code = b"\xc3\x28", "InvalidKey"
    elif case == "long-key":
        key, code = "k" * 2000, "InvalidKey"
    elif case == "unknown-field":
        overrides["color"] = "blue"
    elif case == "key-exists":
        key, code = "sentinel/small", "KeyExists"
        overrides["if_absent"] = True
        overrides["meta"] = put_meta(key, size)
    rid = stream_put(c, key, size, payload, **overrides)
    assert_error(c.reply(), code, rid=rid)
    assert_usable(c)
    with served.connect("tcp") as s:
        if isinstance(key, str) and key and len(key) <= 1024 and key != "sentinel/small":
            assert not s.exists(key)


def test_put_larger_than_capacity(raw, served):
    c = raw()
    rid = stream_put(c, "toolarge", CAPACITY + 1)
    reply = c.reply()
    assert_error(reply, "ObjectTooLarge", str(CAPACITY + 1), rid=rid)
    assert c.is_closed()  # 64 MiB of payload would follow: the daemon does not wait for it
    shm = raw(served.unix_url, transport="shm")
    rid = shm.frame({"op": "put", "key": "toolarge", "size": CAPACITY * 2, "meta": put_meta("toolarge", CAPACITY * 2),
                     "mode": "region"})
    assert_error(shm.reply(), "ObjectTooLarge", rid=rid)
    assert_usable(shm)  # nothing follows a region put: the connection stays usable
    with served.connect("tcp") as s:
        assert not s.exists("toolarge")


@pytest.mark.parametrize("size", [100, 200_000, 3 * MiB])  # inline, streamed, streamed in many pieces
def test_stream_put_whose_bytes_do_not_match_its_checksum_is_refused(raw, served, size):
    """The daemon hashes a streamed payload as it lands: a checksum the client sent that the bytes do not match
    (corrupted on the way) stores nothing, and the previous version stays readable."""
    payload = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    key = f"badsum/{size}"
    with served.connect("tcp") as s:
        s.put(key, b"previous")
    c = raw()
    rid = stream_put(c, key, size, payload, checksum=xxhash.xxh3_64_intdigest(payload) ^ 1)
    assert_error(c.reply(), "Checksum", "nothing was stored", rid=rid)
    assert_usable(c)
    rid = stream_put(c, key, size, payload, checksum=xxhash.xxh3_64_intdigest(payload))  # the right one is taken
    reply = c.reply()
    assert reply["ok"] and reply["checksum"] == xxhash.xxh3_64_intdigest(payload), reply
    with served.connect("tcp") as s:
        assert bytes(s.get(key, verify=True)) == payload
        s.remove(key)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_recorded_checksum_is_the_payloads_on_every_path(served, transport):
    """Whoever hashes (the tcp client no longer does: the daemon hashes while receiving), the checksum that a
    put returns and the daemon records is the xxh3 of the bytes stored, for single and batched puts."""
    values = {f"sum/{transport}/{n}": np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
              for n in (0, 1, 5000, 70_000, 2 * MiB + 3)}
    with served.connect(transport) as s:
        for key, value in values.items():
            assert s.put(key, value).checksum == xxhash.xxh3_64_intdigest(value)
        metas = s.batch_put([(f"{key}/b", value) for key, value in values.items()])
        assert [m.checksum for m in metas] == [xxhash.xxh3_64_intdigest(v) for v in values.values()]
    with served.connect("shm") as reader:
        for key, value in values.items():
            for k in (key, f"{key}/b"):
                assert int(reader.inspect(k)["checksum"], 16) == xxhash.xxh3_64_intdigest(value)
                assert bytes(reader.get(k, verify=True)) == value
                reader.remove(k)


@pytest.mark.parametrize("size", [-1, "big", None, 2 ** 63])
def test_put_with_bad_size(raw, size):
    c = raw()
    rid = c.frame({"op": "put", "key": "badsize", "size": size, "meta": put_meta("badsize", 10), "mode": "stream"})
    reply = c.reply()
    assert reply == CLOSED or reply["ok"] is False, reply
    if reply != CLOSED:
        assert reply["error"] in ("InvalidArgument", "ObjectTooLarge"), reply
        assert reply["id"] == rid


def test_commit_of_another_clients_put_is_refused(raw, served):
    owner = raw(served.unix_url, transport="shm")
    rid = owner.frame({"op": "put", "key": "theirs", "size": 1000, "meta": put_meta("theirs", 1000),
                       "mode": "region"})
    reply = owner.reply()
    assert reply["ok"], reply
    thief = raw(served.unix_url, transport="shm")
    assert_error(thief.call({"op": "commit", "put_id": reply["put_id"]}), "InvalidArgument", "another client")
    assert_error(thief.call({"op": "abort", "put_id": reply["put_id"]}), "InvalidArgument", "another client")
    owner.close()  # the owner goes away: its pending put is revoked
    with served.connect("tcp") as s:
        assert not s.exists("theirs")
        assert wait_pending_zero(s)
    assert rid == reply["id"]


def test_refused_region_ops_leave_nothing_behind(raw, served):
    """A region-mode get or put on a tcp connection is refused, and holds no lease or reserved space."""
    c = raw()  # hello'd with transport="tcp"
    with served.connect("shm") as s:
        before = s.stats()
        assert_error(c.call({"op": "get", "key": "sentinel/large", "mode": "region"}), "Transport", "shm")
        assert_error(c.call({"op": "put", "key": "region-over-tcp", "size": MiB,
                             "meta": put_meta("region-over-tcp", MiB), "mode": "region"}), "Transport", "shm")
        assert_usable(c)
        after = s.stats()  # c is still connected: nothing may be held on its behalf
        assert (after["leases"], after["pending"], after["used_bytes"]) == \
            (before["leases"], before["pending"], before["used_bytes"]), (before, after)


# ---- hello, tokens ---------------------------------------------------------------------------------------
def test_op_before_hello(raw):
    c = raw(hello=False)
    reply = c.call({"op": "exists", "key": "sentinel/small"})
    assert_error(reply, "Authentication", "hello")
    c2 = raw(hello=False)
    c2.send(raw_frame({"v": 1, "id": 1, "op": "get", "key": "sentinel/large", "mode": "stream"}))
    reply = c2.reply()
    assert reply == CLOSED or reply["ok"] is False, "a get before hello was served"


@pytest.mark.parametrize("fields,code", [({"transport": "rdma"}, "Transport"),
                                         ({"transport": "shm", "host": "elsewhere/123"}, "Transport"),
                                         ({"transport": 5}, "InvalidArgument"),
                                         ({"pid": -3}, "InvalidArgument"),
                                         ({"client": ["x"]}, "InvalidArgument")])
def test_bad_hello(raw, served, fields, code):
    c = raw(hello=False)
    reply = c.call({"op": "hello", "client": "raw", "transport": "tcp", "host": host_id(),
                    **served.hello_auth(c.call), **fields})
    assert_error(reply, code)


@pytest.fixture
def token_daemon(daemon_factory, short_dir):
    workdir = short_dir
    token_file = os.path.join(workdir, "token")
    with open(token_file, "w") as f:
        f.write("s3cret-token\n")
    os.chmod(token_file, 0o600)
    d = daemon_factory(capacity="8MiB", token_file=token_file)
    with d.connect("tcp", token="s3cret-token") as s:
        s.put("protected", b"p" * 100_000)
    yield d


@pytest.mark.parametrize("token", [None, "", "wrong", "s3cret-token-", "s3cret-toke", "S3CRET-TOKEN", 42])
def test_wrong_token(token_daemon, token):
    c = RawClient(token_daemon.tcp_url)
    try:
        reply = c.call({"op": "hello", "client": "raw", "transport": "tcp", "host": host_id(), "token": token})
        assert reply != CLOSED, "no error reply for a wrong token"
        assert reply["ok"] is False and reply["error"] in ("Authentication", "InvalidArgument"), reply
        after = c.call({"op": "exists", "key": "protected"})  # no access: closed, or refused
        assert after == CLOSED or after["ok"] is False, after
    finally:
        c.close()
    with token_daemon.connect("shm", token="s3cret-token") as s:  # the right token still works
        assert bytes(s.get("protected")) == b"p" * 100_000


@pytest.mark.parametrize("token", [None, "wrong"])
def test_wrong_token_through_the_client(token_daemon, token):
    with pytest.raises(kvstore.AuthenticationError) as info:  # kvstore.connect: token None is no token at all
        kvstore.connect(token_daemon.tcp_url, transport="tcp", token=token)
    assert isinstance(info.value, PermissionError) and "token" in str(info.value)


def test_right_token_over_both_listeners(token_daemon):
    for transport in ("shm", "tcp"):
        with token_daemon.connect(transport, token="s3cret-token") as s:
            assert s.exists("protected")


def test_non_loopback_listen_without_token_is_refused(short_dir):
    workdir = short_dir
    port = free_port()
    sock_path = os.path.join(workdir, "x.sock")
    cmd = [sys.executable, "-m", "kvstore.cli", "serve", "--listen", f"unix://{sock_path}",
           "--listen", f"tcp://0.0.0.0:{port}", "--capacity", "4MiB"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=child_env(), cwd=workdir)
    assert proc.returncode != 0
    err = proc.stderr + proc.stdout
    assert "non-loopback" in err and "token" in err, err
    assert "0.0.0.0" in err, err
    assert not os.path.exists(sock_path)


def test_empty_token_file_is_refused(short_dir):
    workdir = short_dir
    token_file = os.path.join(workdir, "empty")
    open(token_file, "w").close()
    proc = subprocess.run([sys.executable, "-m", "kvstore.cli", "serve", "--listen", f"unix://{workdir}/x.sock",
                           "--token-file", token_file], capture_output=True, text=True, timeout=30,
                          env=child_env(), cwd=workdir)
    assert proc.returncode != 0
    assert "empty" in proc.stderr, proc.stderr


def test_socket_and_segments_are_private(served):
    assert stat.S_IMODE(os.stat(served.unix_path).st_mode) == 0o600
    segments = shm_segments(served.pid)
    assert segments, "the daemon has no shared-memory segments"
    for path in segments:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path


def run_refused_daemon(*listen: str) -> tuple[int, str, int]:
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "serve", "--capacity", "4MiB", "--insecure",
                             *[arg for url in listen for arg in ("--listen", url)]],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env())
    out, _ = proc.communicate(timeout=30)
    return proc.returncode, out, proc.pid


def test_second_daemon_on_a_live_socket_is_refused(served):
    rc, out, pid = run_refused_daemon(served.unix_url)
    assert rc != 0
    assert "already" in out and served.unix_path in out, out
    assert shm_segments(pid) == [], f"the refused daemon left shared memory behind: {shm_segments(pid)}"
    assert_still_serving(served)


def test_daemon_on_a_busy_tcp_port_is_refused_and_cleans_up(served, short_dir):
    sock_path = os.path.join(short_dir, "y.sock")
    rc, out, pid = run_refused_daemon(f"unix://{sock_path}", served.tcp_url)
    assert rc != 0
    assert "in use" in out, out
    assert not os.path.exists(sock_path), "the refused daemon left its unix socket behind"
    assert shm_segments(pid) == [], f"the refused daemon left shared memory behind: {shm_segments(pid)}"
    assert_still_serving(served)


def test_bad_requests_are_logged(raw, served):
    c = raw()
    assert_error(c.call({"op": "frobnicate-logged"}), "Protocol")
    assert_error(c.call({"op": "exists", "key": "", "x": 1}), "InvalidKey")
    assert wait_until(lambda: "frobnicate-logged" in served.log(), 5), served.log()


def test_client_side_errors_do_not_disturb_the_daemon(served):
    """The typed errors through the real client, then the same connection keeps working."""
    with served.connect("tcp") as s:
        with pytest.raises(kvstore.BufferTooSmallError):
            s.get_into("sentinel/large", bytearray(10))
        with pytest.raises(kvstore.KeyNotFoundError):
            s.get("nope")
        with pytest.raises(kvstore.ObjectTooLargeError):
            s.put("x", np.zeros(CAPACITY + 1, np.uint8))
        assert bytes(s.get("sentinel/large")) == SENTINELS["sentinel/large"]
