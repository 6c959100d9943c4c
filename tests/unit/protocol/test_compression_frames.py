"""Compressed frames (kvstore.protocol.compression): round trips, corrupted frames, refused headers."""

from __future__ import annotations

import lz4.block
import numpy as np
import pytest
import torch
import xxhash

from kvstore.errors import ChecksumError, InvalidArgumentError, ProtocolError
from kvstore.protocol import compression as cz

MiB = 1 << 20


def _decode_all(frames: list[tuple[bytes, bytes]], size: int) -> bytearray:
    out = bytearray(size)
    view, pos = memoryview(out), 0
    for header, body in frames:
        frame = cz.parse_header(header, size - pos)
        assert frame.wire_len == len(body)
        cz.decode(frame, body, view[pos:pos + frame.raw_len])
        pos += frame.raw_len
    assert pos == size
    return out


def _kv(nbytes: int) -> bytes:
    return torch.randn(nbytes // 2, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).view(
        torch.uint8).numpy().tobytes()


def _compressible(nbytes: int) -> bytes:
    data = np.zeros(nbytes, np.uint8)
    data[::5] = np.arange(len(data[::5])) % 7
    return data.tobytes()


@pytest.mark.parametrize("codec", sorted(cz.CODECS))
@pytest.mark.parametrize("make,size", [(_compressible, 3 * MiB + 10), (_compressible, 2 * MiB), (_kv, MiB + 64),
                                        (lambda n: np.random.default_rng(1).bytes(n), MiB // 2 + 1)])
def test_frames_round_trip(codec, make, size):
    data = make(size)
    encoder = cz.Encoder(memoryview(data), codec)
    frames = [(h, bytes(b)) for h, b in encoder]
    assert bytes(_decode_all(frames, size)) == data
    assert encoder.wire_bytes == sum(len(h) + len(b) for h, b in frames)


def test_compressible_data_shrinks_and_random_data_goes_stored_after_a_probe():
    packed = cz.Encoder(memoryview(_compressible(4 * MiB)), "lz4")
    list(packed)
    assert packed.compressed == 4 and packed.wire_bytes < MiB
    noise = cz.Encoder(memoryview(np.random.default_rng(2).bytes(8 * MiB)), "lz4")
    frames = list(noise)
    assert noise.compressed == 0 and noise.wire_bytes == 8 * MiB + 8 * cz.HEADER.size
    assert all(cz.parse_header(h, MiB).codec == cz.STORED for h, _ in frames)


def test_shuffle_groups_the_bytes_of_each_element():
    data = memoryview(bytes([1, 2, 1, 2, 1, 2]))
    assert cz.shuffle(data, 2).tobytes() == bytes([1, 1, 1, 2, 2, 2])
    encoder = cz.Encoder(memoryview(_compressible(MiB)), "lz4-shuffle")
    header, _ = encoder.frame(0)
    frame = cz.parse_header(header, MiB)
    assert frame.elem == 2 and frame.codec == cz.LZ4


@pytest.mark.parametrize("where", ["lz4 body", "stored body", "truncated lz4", "checksum"])
def test_a_corrupted_frame_is_a_checksum_error(where):
    data = _compressible(MiB) if where != "stored body" else np.random.default_rng(3).bytes(MiB)
    header, body = cz.Encoder(memoryview(data), "lz4").frame(0)
    body = bytearray(body)
    if where == "checksum":
        header = header[:16] + (xxhash.xxh3_64_intdigest(data) ^ 1).to_bytes(8, "little")
    elif where == "truncated lz4":
        body = body[:len(body) // 2]
        header = header[:12] + len(body).to_bytes(4, "little") + header[16:]
    else:
        body[len(body) // 3] ^= 0x40
    frame = cz.parse_header(header, MiB)
    with pytest.raises(ChecksumError):
        cz.decode(frame, bytes(body), memoryview(bytearray(MiB)))


def _header(**over) -> bytes:
    fields = dict(magic=cz.MAGIC, version=cz.FORMAT, codec=cz.LZ4, flags=0, elem=0, reserved=0, raw_len=MiB,
                  wire_len=1000, checksum=0)
    fields.update(over)
    return cz.HEADER.pack(*fields.values())


@pytest.mark.parametrize("over", [dict(magic=b"XX"), dict(version=2), dict(codec=7), dict(flags=2), dict(reserved=1),
                                  dict(flags=1, elem=0), dict(flags=0, elem=2), dict(flags=1, elem=3),
                                  dict(flags=1, elem=2, codec=cz.STORED, wire_len=MiB), dict(raw_len=0),
                                  dict(raw_len=MiB + 1), dict(raw_len=2 * MiB), dict(wire_len=0),
                                  dict(wire_len=cz.lz4_bound(MiB) + 1), dict(codec=cz.STORED, wire_len=MiB - 1),
                                  dict(flags=1, elem=4, raw_len=MiB - 2)])
def test_bad_headers_are_refused(over):
    with pytest.raises(ProtocolError):
        cz.parse_header(_header(**over), MiB)


def test_a_header_may_not_claim_more_than_the_payload_has_left():
    cz.parse_header(_header(raw_len=100, wire_len=50), 100)
    with pytest.raises(ProtocolError):
        cz.parse_header(_header(raw_len=101, wire_len=50), 100)


def test_codec_names_are_validated():
    assert cz.check_codec(None) is None and cz.check_codec("lz4") == "lz4"
    for bad in ("zstd", "", 1, b"lz4"):
        with pytest.raises(InvalidArgumentError):
            cz.check_codec(bad)


def test_lz4_bound_holds_for_incompressible_input():
    noise = np.random.default_rng(4).bytes(MiB)
    assert len(lz4.block.compress(noise, store_size=False)) <= cz.lz4_bound(MiB)
