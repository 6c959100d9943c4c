import msgpack
import pytest

from kvstore.errors import InvalidArgumentError, InvalidKeyError, ProtocolError
from kvstore.protocol import wire


def req(**kw):
    return {"v": 1, "id": 1, **kw}


def test_roundtrip():
    frame = wire.encode(req(op="ping"))
    n = wire.frame_length(frame[:4])
    assert wire.decode(frame[4:4 + n]) == req(op="ping")


def test_frame_limits():
    with pytest.raises(ProtocolError):
        wire.frame_length((wire.MAX_FRAME + 1).to_bytes(4, "little"))
    with pytest.raises(ProtocolError):
        wire.encode(req(op="ping", blob=b"x" * (wire.MAX_FRAME + 1)))


@pytest.mark.parametrize("body", [b"\xc1", b"\x92\x01", msgpack.packb([1, 2]), msgpack.packb({1: 2})])
def test_malformed(body):
    with pytest.raises(ProtocolError):
        wire.decode(body)


def test_decode_bounds_structure_to_what_the_schema_allows():
    with pytest.raises(ProtocolError, match="arrays and maps"):
        wire.decode(msgpack.packb(req(op="ping", pad=[[[]] * 4000 for _ in range(16)])))
    with pytest.raises(ProtocolError):
        wire.decode(msgpack.packb(req(op="ping", pad=[0] * (2 * 4096 + 1))))
    with pytest.raises(ProtocolError):
        wire.decode(msgpack.packb(req(op="ping", pad="x" * (4 * 4096 + 1))))
    with pytest.raises(ProtocolError):
        wire.decode(msgpack.packb(req(op="ping", pad=msgpack.ExtType(1, b"x"))))
    # the largest legitimate request still decodes
    keys = ["k" * 200] * 4096
    assert wire.decode(msgpack.packb(req(op="batch_exists", keys=keys)))["keys"] == keys
    # replies (from the daemon the client authenticated) may be larger
    assert len(wire.decode(msgpack.packb(req(ok=True, value=["k"] * 20000)), wire.REPLY_LIMITS)["value"]) == 20000


def test_preauth_frame_limit():
    header = (wire.MAX_PREAUTH_FRAME + 1).to_bytes(4, "little")
    assert wire.frame_length(header) == wire.MAX_PREAUTH_FRAME + 1
    with pytest.raises(ProtocolError, match="before authentication"):
        wire.frame_length(header, wire.MAX_PREAUTH_FRAME)


def test_mixed_str_and_bytes_field_names_are_an_argument_error():
    with pytest.raises(InvalidArgumentError, match="str"):
        wire.validate({"v": 1, "id": 1, "op": "ping", b"x": 1})
    message = wire.decode(msgpack.packb({"v": 1, "id": 1, "op": "exists", "key": "a", b"key": "b"},
                                        use_bin_type=True))
    with pytest.raises(InvalidArgumentError):
        wire.validate(message)


def test_validate_ok_and_defaults():
    op, rid, f = wire.validate(req(op="get", key="a", mode="stream"))
    assert (op, rid, f) == ("get", 1, {"key": "a", "mode": "stream", "compress": None})
    _, _, f = wire.validate(req(op="ls"))
    assert f["prefix"] == "" and f["limit"] > 0


@pytest.mark.parametrize("message,error", [
    ({"v": 2, "id": 1, "op": "ping"}, ProtocolError),
    ({"v": 1, "id": "x", "op": "ping"}, ProtocolError),
    (req(op="nope"), ProtocolError),
    (req(op="get", mode="stream"), InvalidArgumentError),
    (req(op="get", key="a", mode="carrier-pigeon"), InvalidArgumentError),
    (req(op="get", key="a", mode="stream", compress="zstd"), InvalidArgumentError),
    (req(op="get", key="", mode="stream"), InvalidKeyError),
    (req(op="get", key="k" * 1025, mode="stream"), InvalidKeyError),
    (req(op="get", key=b"\xff\xfe", mode="stream"), InvalidKeyError),
    (req(op="get", key=5, mode="stream"), InvalidKeyError),
    (req(op="put", key="a", size=-1, meta={}, mode="stream"), InvalidArgumentError),
    (req(op="put", key="a", size=True, meta={}, mode="stream"), InvalidArgumentError),
    (req(op="put", key="a", size=1, meta=[], mode="stream"), InvalidArgumentError),
    (req(op="ping", extra=1), InvalidArgumentError),
    (req(op="wait", keys=["a"], timeout=-1), InvalidArgumentError),
])
def test_validate_rejects(message, error):
    with pytest.raises(error):
        wire.validate(message)


def test_error_reply_carries_sizes():
    from kvstore.errors import BufferTooSmallError, error_from_wire

    reply = wire.error_reply(3, BufferTooSmallError("small", needed=10, got=5))
    exc = error_from_wire(reply["error"], reply["message"], reply.get("extra"))
    assert isinstance(exc, BufferTooSmallError) and (exc.needed, exc.got) == (10, 5)


def test_make_room_leaves_a_buffer_with_room_as_it_is():
    buf = bytearray(b"..abc...")
    assert wire.make_room(buf, 2, 5, 6) == (buf, 2, 5)  # 6 bytes fit between start and the end
    assert wire.make_room(buf, 2, 5, 6)[0] is buf


def test_make_room_moves_the_unread_bytes_to_the_front():
    buf = bytearray(b"....abc.")
    got, start, end = wire.make_room(buf, 4, 7, 5)
    assert got is buf and (start, end) == (0, 3) and got[start:end] == b"abc" and len(got) == 8


def test_make_room_grows_a_buffer_shorter_than_asked_at_least_twofold():
    buf = bytearray(b"..abcd")
    got, start, end = wire.make_room(buf, 2, 6, 7)
    assert got is not buf and len(got) == 12 and (start, end) == (0, 4) and got[:4] == b"abcd"
    got, start, end = wire.make_room(bytearray(b"xy"), 1, 2, 100)
    assert len(got) == 100 and (start, end) == (0, 1) and got[:1] == b"y"


def test_make_room_with_nothing_unread():
    got, start, end = wire.make_room(bytearray(4), 4, 4, 4)
    assert (start, end) == (0, 0) and len(got) == 4
