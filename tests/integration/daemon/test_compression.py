"""Compressed payloads against a real daemon over tcp: round trips, corrupted frames and bad headers, both ways.

Puts are corrupted by a hand-rolled client (frames built with kvstore.protocol.compression); gets by a TCP
proxy between a real client and the daemon that damages the first compressed frame it forwards. A corrupted
frame must be a ChecksumError with nothing stored and the connection still in step; a bad header a
ProtocolError with the connection closed; the daemon keeps serving either way.
"""

from __future__ import annotations

import os
import socket
import struct
import threading

import msgpack
import numpy as np
import pytest
import xxhash
from conftest import MiB

import kvstore
from kvstore.core.meta import ObjectMeta
from kvstore.errors import ChecksumError, ProtocolError
from kvstore.protocol import compression as cz
from kvstore.protocol import wire
from kvstore.protocol.url import host_id

pytestmark = pytest.mark.timeout(60)


def compressible(n: int, seed: int = 0) -> bytes:
    data = np.zeros(n, np.uint8)
    data[::6] = np.random.default_rng(seed).integers(0, 4, len(data[::6]), dtype=np.uint8)
    return data.tobytes()


@pytest.mark.parametrize("codec", ["lz4", "lz4-shuffle", "auto"])
def test_round_trip_and_checksum_of_the_uncompressed_bytes(daemon, prefix, codec):
    values = {"packed": compressible(3 * MiB + 6), "noise": np.random.default_rng(1).bytes(2 * MiB),
              "small": b"x" * 1000, "edge": compressible(cz.MIN_SIZE)}
    with daemon.connect("tcp", compression=codec) as store, daemon.connect("shm") as local:
        for name, value in values.items():
            key = f"{prefix}/{name}"
            store.put(key, value)
            for reader in (store, local):
                buf = bytearray(len(value))
                reader.get_into(key, buf)
                assert bytes(buf) == value
            assert store.get(key).meta.checksum == xxhash.xxh3_64_intdigest(value)
            local.put(key + "/from-shm", value)
            assert bytes(store.get(key + "/from-shm")) == value
        assert store.stats()["compression"]["mode"] == codec


class RawClient:
    def __init__(self, d):
        host, port = d.tcp_url[len("tcp://"):].rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.rid = 0
        reply = self.call({"op": "hello", "client": "raw", "transport": "tcp", "host": host_id(), "pid": os.getpid(),
                           **d.hello_auth(self.call)})
        assert reply["ok"], reply

    def send(self, message: dict, after: bytes = b"") -> None:
        self.rid += 1
        body = msgpack.packb({"v": wire.VERSION, "id": self.rid, **message}, use_bin_type=True)
        self.sock.sendall(struct.pack("<I", len(body)) + body + after)

    def reply(self) -> dict | None:
        head = self._exact(4)
        return None if head is None else msgpack.unpackb(self._exact(struct.unpack("<I", head)[0]), raw=False)

    def call(self, message: dict, after: bytes = b"") -> dict | None:
        self.send(message, after)
        return self.reply()

    def _exact(self, n: int) -> bytes | None:
        buf = b""
        while len(buf) < n:
            try:
                got = self.sock.recv(n - len(buf))
            except ConnectionResetError:
                return None
            if not got:
                return None
            buf += got
        return buf


def frames(value: bytes, damage=None) -> bytes:
    out = []
    for i, (header, body) in enumerate(cz.Encoder(memoryview(value), "lz4")):
        header, body = bytearray(header), bytearray(body)
        if damage is not None and i == 1:
            damage(header, body)
        out.append(bytes(header) + bytes(body))
    return b"".join(out)


def put_request(key: str, size: int, **extra) -> dict:
    return {"op": "put", "key": key, "size": size, "meta": ObjectMeta(key=key, size=size).to_wire(),
            "mode": "stream", "compress": "lz4", **extra}


def test_a_corrupted_put_frame_is_a_checksum_error_and_stores_nothing(daemon, prefix):
    value = compressible(3 * MiB)
    client = RawClient(daemon)

    def flip(header, body):
        body[len(body) // 2] ^= 0x10

    reply = client.call(put_request(f"{prefix}/bad", len(value)), frames(value, flip))
    assert reply["ok"] is False and reply["error"] == "Checksum", reply
    assert client.call({"op": "exists", "key": f"{prefix}/bad"})["value"] is False  # still in step
    assert client.call(put_request(f"{prefix}/good", len(value)), frames(value))["ok"]
    with daemon.connect("shm") as local:
        assert bytes(local.get(f"{prefix}/good")) == value


@pytest.mark.parametrize("field,offset,value", [("magic", 0, b"ZZ"), ("codec", 3, b"\x09"),
                                                ("raw length", 8, struct.pack("<I", 2 * MiB))])
def test_a_bad_put_frame_header_is_refused_and_closes_the_connection(daemon, prefix, field, offset, value):
    data = compressible(3 * MiB)
    client = RawClient(daemon)

    def bad(header, body):
        header[offset:offset + len(value)] = value

    reply = client.call(put_request(f"{prefix}/{field}", len(data)), frames(data, bad))
    assert reply is not None and reply["error"] == "Protocol", reply
    assert client.reply() is None  # closed
    with daemon.connect("tcp") as other:
        assert not other.exists(f"{prefix}/{field}")
        assert daemon.running()


def test_a_refused_compressed_put_has_its_frames_drained(daemon, prefix):
    value = compressible(2 * MiB)
    with daemon.connect("shm") as local:
        local.put(f"{prefix}/taken", b"first")
    client = RawClient(daemon)
    reply = client.call(put_request(f"{prefix}/taken", len(value), if_absent=True), frames(value))
    assert reply["error"] == "KeyExists", reply
    assert client.call({"op": "ping"})["ok"]  # the frames were read past, not taken for requests


class CorruptingProxy:
    """Forwards one client connection to the daemon; once the client asked for a compressed get, damages the
    first lz4 frame coming back (its body, or its header's version byte)."""

    def __init__(self, target: str, damage: str):
        host, port = target[len("tcp://"):].rsplit(":", 1)
        self.target, self.damage = (host, int(port)), damage
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"tcp://127.0.0.1:{self.server.getsockname()[1]}"
        self.damaged = False
        self.armed = threading.Event()  # set once the client has asked for a compressed get
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        client, _ = self.server.accept()
        upstream = socket.create_connection(self.target)
        threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
        self._pipe(upstream, client, True)

    def _pipe(self, src: socket.socket, dst: socket.socket, damage: bool) -> None:
        marker = cz.MAGIC + bytes([cz.FORMAT, cz.LZ4])
        pending = bytearray()
        while True:
            try:
                got = src.recv(1 << 20)
            except OSError:
                got = b""
            if not got:
                dst.close()
                return
            data = bytearray(got)
            if not damage and b"compress" in data:
                self.armed.set()
            if damage and self.armed.is_set() and not self.damaged:
                pending += data  # hold bytes until a whole header and some body are in hand
                at = pending.find(marker)
                if at < 0 or len(pending) < at + cz.HEADER.size + 64:
                    continue
                if self.damage == "body":
                    pending[at + cz.HEADER.size + 32] ^= 0x20
                else:
                    pending[at + 2] = 99  # format version
                self.damaged = True
                data, pending = pending, bytearray()
            try:
                dst.sendall(data)
            except OSError:
                return


def test_a_corrupted_get_frame_is_a_checksum_error_and_the_connection_stays_usable(daemon, prefix):
    value = compressible(4 * MiB, seed=3)
    with daemon.connect("shm") as local:
        local.put(f"{prefix}/v", value)
        local.put(f"{prefix}/small", b"ok")
    proxy = CorruptingProxy(daemon.tcp_url, "body")
    with kvstore.connect(proxy.url, transport="tcp", compression="lz4", token=daemon.token) as store:
        with pytest.raises(ChecksumError):
            store.get_into(f"{prefix}/v", bytearray(len(value)))
        assert proxy.damaged
        assert bytes(store.get(f"{prefix}/small")) == b"ok"  # the rest of the frames were read past
        buf = bytearray(len(value))
        store.get_into(f"{prefix}/v", buf)
        assert bytes(buf) == value


def test_a_bad_get_frame_header_is_a_protocol_error_and_closes_the_connection(daemon, prefix):
    value = compressible(4 * MiB, seed=4)
    with daemon.connect("shm") as local:
        local.put(f"{prefix}/v", value)
    proxy = CorruptingProxy(daemon.tcp_url, "header")
    with kvstore.connect(proxy.url, transport="tcp", compression="lz4", token=daemon.token) as store:
        with pytest.raises(ProtocolError):
            store.get_into(f"{prefix}/v", bytearray(len(value)))
        assert not store.connected
    assert daemon.running()
