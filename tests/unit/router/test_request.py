"""The client's request and the bodies of its two hops (pure logic)."""

from __future__ import annotations

import json

import pytest

from kvstore.router.request import CHAT, COMPLETIONS, RequestError, parse, verified


def _parse(endpoint, body, **headers):
    return parse(endpoint, json.dumps(body).encode(), headers)


def test_a_completion_sends_the_same_token_ids_to_both_hops():
    req = _parse(COMPLETIONS, {"model": "m", "prompt": "w5 w6", "max_tokens": 9, "stream": True, "logprobs": 2,
                               "kv_transfer_params": {"forged": 1}}, **{"X-Request-Id": "r1"})
    assert req.tokenize_body() == {"prompt": "w5 w6"}
    req.token_ids = [5, 6]
    prefill = req.prefill_body()
    assert prefill["prompt"] == [5, 6] and prefill["max_tokens"] == 1 and prefill["stream"] is False
    assert "logprobs" not in prefill
    assert prefill["kv_transfer_params"] == {"kvstore": {"do_remote_decode": True}}
    params = {"kvstore": {"version": 1, "saved_blocks": 2}}
    decode = req.decode_body(params)
    assert decode["prompt"] == [5, 6] and decode["max_tokens"] == 9 and decode["stream"] is True
    assert decode["kv_transfer_params"] == params  # unchanged
    assert "kv_transfer_params" not in req.decode_body(None)  # the client's own were dropped
    assert req.request_id == "r1"


def test_a_chat_keeps_its_messages_and_carries_the_ids():
    req = _parse(CHAT, {"messages": [{"role": "user", "content": "w5"}], "max_completion_tokens": 4,
                        "tools": []})
    assert set(req.tokenize_body()) == {"messages", "tools"}
    req.token_ids = [0, 5]
    prefill = req.prefill_body()
    assert prefill["messages"] and "max_completion_tokens" not in prefill and prefill["max_tokens"] == 1
    assert prefill["kv_transfer_params"] == {"kvstore": {"do_remote_decode": True}, "prompt_token_ids": [0, 5]}
    decode = req.decode_body({"kvstore": {"saved_blocks": 1}})
    assert decode["kv_transfer_params"] == {"kvstore": {"saved_blocks": 1}, "prompt_token_ids": [0, 5]}
    assert decode["max_completion_tokens"] == 4 and req.max_tokens == 4


def test_token_id_prompts_are_not_tokenized_again():
    req = _parse(COMPLETIONS, {"prompt": [[7, 8, 9]]})
    assert req.tokenize_body() is None and req.token_ids == [7, 8, 9]


@pytest.mark.parametrize("endpoint, raw, headers", [
    (COMPLETIONS, b"{", {}),
    (COMPLETIONS, b"[]", {}),
    (COMPLETIONS, b'{"prompt": "a", "max_tokens": 0}', {}),
    (COMPLETIONS, b'{"prompt": "a", "max_tokens": true}', {}),
    (COMPLETIONS, b'{"prompt": "a"}', {"X-Request-Class": "vip"}),
    (CHAT, b'{"messages": []}', {}),
])
def test_bad_requests_are_400(endpoint, raw, headers):
    with pytest.raises(RequestError) as err:
        parse(endpoint, raw, headers)
    assert err.value.status == 400 and err.value.body()["error"]["message"]


@pytest.mark.parametrize("prompt", [["a", "b"], "", [], [1, -2], {"x": 1}, None])
def test_prompts_the_router_does_not_take(prompt):
    with pytest.raises(RequestError):
        _parse(COMPLETIONS, {"prompt": prompt}).tokenize_body()


@pytest.mark.parametrize("params, ok", [
    ({"kvstore": {"version": 1, "saved_blocks": 3}}, True),
    ({"kvstore": {"saved_blocks": 0}}, False),
    ({"kvstore": {"saved_blocks": True}}, False),
    ({"kvstore": {}}, False),
    ({"other": {"saved_blocks": 3}}, False),
    (None, False),
])
def test_verified(params, ok):
    assert verified(params) is ok
