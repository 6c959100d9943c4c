"""A live daemon fed fuzzed frames (mutated valid requests, random bytes, random field values) keeps
answering a well-behaved client, logs no internal error ("crashed"), and keeps its objects intact."""

from __future__ import annotations

import random
import socket
import struct
import threading

import msgpack
import pytest
from conftest import hello_proof, wait_until
from fuzz_frames import GOOD_BODIES
from test_bad_input import RawClient, raw_frame

pytestmark = pytest.mark.timeout(90)
FRAMES = 600


def mutate(rng: random.Random) -> bytes:
    kind = rng.randrange(3)
    if kind == 0:
        body = bytearray(rng.choice(GOOD_BODIES))
        for _ in range(rng.randint(1, 6)):
            body[rng.randrange(len(body))] = rng.randrange(256)
        body = bytes(body)
    elif kind == 1:
        body = rng.randbytes(rng.randint(0, 300))
    else:
        message = msgpack.unpackb(rng.choice(GOOD_BODIES), raw=False)
        name = rng.choice(sorted(message))
        message[name] = rng.choice([None, -1, 2**64 - 1, 1.5, "x" * 5000, b"\xff", [], {}, [[]] * 50, {b"k": 1},
                                    True, "\x00"])
        if rng.random() < 0.3:
            message[rng.choice([b"op", b"key", "zz"])] = 1
        body = msgpack.packb(message, use_bin_type=True)
    if rng.random() < 0.05:  # a lying length prefix
        return struct.pack("<I", rng.choice([len(body) + 7, 1 << 24])) + body
    return struct.pack("<I", len(body)) + body


def fuzz_connection(url: str, frames: list[bytes], hello: dict, token: str | None) -> None:
    c = RawClient(url, timeout=2.0)
    try:
        c.send(raw_frame({**hello, **hello_proof(c.call, token)}))
        c.reply()
        for frame in frames:
            c.send(frame)
    except OSError:
        pass  # the daemon may close a connection whose framing broke
    finally:
        c.close()


def test_daemon_survives_fuzzed_frames(daemon_factory):
    d = daemon_factory(capacity="8MiB")
    with d.connect("shm") as s:
        s.put("fuzz/sentinel", b"s" * 100_000)
    rng = random.Random(1234)
    frames = [mutate(rng) for _ in range(FRAMES)]
    hello = {"v": 1, "id": 1, "op": "hello", "client": "fuzz", "transport": "tcp", "host": "elsewhere"}
    stop = threading.Event()
    pings: list[bool] = []

    def ping_loop() -> None:
        with d.connect("tcp", timeout=10) as good:
            while not stop.is_set():
                good.ping()
                pings.append(True)

    pinger = threading.Thread(target=ping_loop, daemon=True)
    pinger.start()
    assert wait_until(lambda: pings, 30), "the well-behaved client got no ping answered before the fuzzing"
    answered = len(pings)
    for i in range(0, FRAMES, 20):  # 20 frames a connection, over both listeners
        fuzz_connection(d.tcp_url if i % 40 else d.unix_url, frames[i:i + 20], hello, d.token)
    # its connection, open through the fuzzing, is still served (pings are answered one after another)
    assert wait_until(lambda: len(pings) > answered + 1, 30), "the well-behaved client's pings stopped"
    stop.set()
    pinger.join(30)
    assert d.running(), d.log()
    with d.connect("tcp", timeout=5) as s:
        s.ping()
        assert bytes(s.get("fuzz/sentinel")) == b"s" * 100_000
    log = d.log()
    assert "crashed" not in log and "Traceback" not in log, log


def test_unauthenticated_fuzz_gets_nothing_in(daemon_factory):
    """Fuzzed frames before hello never reach an op: the daemon refuses them and stays up."""
    d = daemon_factory(capacity="8MiB")
    rng = random.Random(99)
    for _ in range(20):
        sock = socket.create_connection(("127.0.0.1", d.port), timeout=2.0)
        try:
            for _ in range(10):
                sock.sendall(mutate(rng))
        except OSError:
            pass
        finally:
            sock.close()
    with d.connect("tcp", timeout=5) as s:
        s.ping()
    assert "crashed" not in d.log()
