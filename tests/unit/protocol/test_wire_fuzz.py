"""Fuzzing the frame decoder and validator: random and mutated frames raise only the protocol's typed errors
(ProtocolError, InvalidArgumentError, InvalidKeyError), never an internal TypeError/KeyError/... that the
daemon would log as a crash. Bounded to a few seconds (example counts, no deadline per example)."""

from __future__ import annotations

import msgpack
import pytest
from fuzz_frames import GOOD, GOOD_BODIES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.core.meta import ObjectMeta
from kvstore.errors import InvalidArgumentError, InvalidKeyError, ProtocolError
from kvstore.protocol import wire

pytestmark = pytest.mark.timeout(60)
TYPED = (ProtocolError, InvalidArgumentError, InvalidKeyError)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)

FUZZ_SMALL = settings(FUZZ, max_examples=100)


scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(), st.text(max_size=20),
                    st.binary(max_size=20))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(st.one_of(st.text(max_size=8), st.binary(max_size=8)), inner,
                                                 max_size=5)), max_leaves=20)


def check(body: bytes) -> None:
    """What the daemon does with a frame body before an op runs: decode, validate, and parse a put's meta."""
    try:
        message = wire.decode(body)
        op, _, fields = wire.validate(message)
        if op == "put":
            ObjectMeta.from_wire(fields["meta"])
    except TYPED:
        pass


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes(body):
    check(body)


@FUZZ
@given(st.sampled_from(GOOD_BODIES), st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)),
                                              min_size=1, max_size=8))
def test_mutated_frames(body, flips):
    data = bytearray(body)
    for pos, byte in flips:
        data[pos % len(data)] = byte
    check(bytes(data))


@FUZZ_SMALL
@given(st.sampled_from(GOOD), st.dictionaries(st.one_of(st.text(max_size=10), st.binary(max_size=10)), values,
                                              max_size=4), st.data())
def test_fields_replaced_by_random_values(message, extra, data):
    message = dict(message)
    names = sorted(k for k in message if k not in ("v",))
    for name in data.draw(st.lists(st.sampled_from(names), max_size=3)):
        message[name] = data.draw(values)
    message.update(extra)
    check(msgpack.packb(message, use_bin_type=True))


@FUZZ_SMALL
@given(st.data())
def test_object_meta_with_random_fields(data):
    meta = ObjectMeta(key="k", size=12, kind="numpy", dtype="<f4", shape=(3,)).to_wire()
    for name in data.draw(st.lists(st.sampled_from(sorted(meta)), min_size=1, max_size=3)):
        meta[name] = data.draw(values)
    try:
        ObjectMeta.from_wire(meta)
    except TYPED:
        pass
