"""The hand-off's kv_transfer_params: a promise round-trips, the router's prefill marker is not a promise, and a
malformed entry is a typed error naming the field."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvstore.integrations.vllm.transfer_params import BadParams, Promise, parse  # noqa: E402

PROMISE = Promise(fingerprint="ab" * 16, num_tokens=64, saved_blocks=4, dropped_blocks=1, pending=True)


def test_a_promise_round_trips():
    assert parse(PROMISE.to_params()) == PROMISE


@pytest.mark.parametrize("params", [None, {}, {"other_connector": {"remote_block_ids": [1]}},
                                    {"kvstore": {"do_remote_decode": True}}])
def test_no_promise(params):
    assert parse(params) is None


@pytest.mark.parametrize(("field", "value"), [("version", 2), ("fingerprint", ""), ("num_tokens", -1),
                                              ("saved_blocks", True), ("pending", "yes")])
def test_a_malformed_promise_names_the_field(field, value):
    entry = PROMISE.to_params()["kvstore"] | {field: value}
    with pytest.raises(BadParams, match=field):
        parse({"kvstore": entry})


def test_the_marker_with_a_version_is_read_as_a_promise():
    with pytest.raises(BadParams, match="fingerprint"):
        parse({"kvstore": {"version": 1, "do_remote_decode": True}})
