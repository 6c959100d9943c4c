"""A client's request as the router sees it, and the bodies of its two hops.

The router tokenizes once and sends the same token ids to both hops, so that the decode instance's block keys
are the prefill instance's: a completion's ``prompt`` becomes the ids; a chat keeps its ``messages`` (the
answer stays a chat completion) and carries the ids in ``kv_transfer_params["prompt_token_ids"]``, which
vLLM uses instead of rendering the chat template again.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from kvstore.errors import KVStoreError
from kvstore.router.config import CLASS_HEADER, INTERACTIVE, REQUEST_CLASSES

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
#: Fields of a chat request that /tokenize takes to render the same prompt the instance would.
_TOKENIZE_CHAT = ("messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
                  "chat_template", "chat_template_kwargs", "tools", "mm_processor_kwargs")
#: Fields a prefill hop (one token, not returned to the client) does not need.
_PREFILL_DROP = ("stream_options", "max_completion_tokens", "min_tokens", "logprobs", "top_logprobs", "echo",
                 "prompt_logprobs", "n", "best_of", "use_beam_search")


class RequestError(KVStoreError):
    """The client's request is wrong (HTTP ``status``, a 4xx); nothing was sent to a decode instance.
    Retrying the same request cannot help."""

    def __init__(self, message: str, status: int = 400, kind: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.status}}


@dataclass(slots=True)
class ClientRequest:
    endpoint: str
    body: dict
    request_id: str
    interactive: bool
    headers: dict = field(default_factory=dict)  # forwarded to both hops
    token_ids: list[int] = field(default_factory=list)
    key: str = field(default_factory=lambda: uuid.uuid4().hex)  # the router's own handle (ids may repeat)

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def max_tokens(self) -> int:
        value = self.body.get("max_completion_tokens", self.body.get("max_tokens"))
        return value if isinstance(value, int) and value > 0 else 16

    def tokenize_body(self) -> dict | None:
        """The /tokenize request for this prompt, or None when the prompt already is token ids."""
        if self.endpoint == CHAT:
            return {k: self.body[k] for k in _TOKENIZE_CHAT if k in self.body}
        prompt = self.body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(type(x) is int and x >= 0 for x in prompt):
            self.token_ids = list(prompt)
            return None
        if isinstance(prompt, str) and prompt:
            out = {"prompt": prompt}
            if "add_special_tokens" in self.body:
                out["add_special_tokens"] = self.body["add_special_tokens"]
            return out
        raise RequestError("'prompt' must be one non-empty string or one list of token ids (the router takes "
                           "one prompt per request)", param="prompt")

    def prefill_body(self) -> dict:
        body = {k: v for k, v in self.body.items() if k not in _PREFILL_DROP}
        body.update(max_tokens=1, stream=False)
        kv = {"kvstore": {"do_remote_decode": True}}
        return self._with_ids(body, kv)

    def decode_body(self, kv_transfer_params: dict | None) -> dict:
        return self._with_ids(dict(self.body), dict(kv_transfer_params or {}))

    def _with_ids(self, body: dict, kv: dict) -> dict:
        if self.endpoint == CHAT:
            kv["prompt_token_ids"] = self.token_ids
        else:
            body["prompt"] = self.token_ids
        if kv:
            body["kv_transfer_params"] = kv
        else:
            body.pop("kv_transfer_params", None)
        return body


def parse(endpoint: str, raw: bytes, headers) -> ClientRequest:
    """The client's body and headers, checked; RequestError (400) otherwise."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    if endpoint == CHAT and not (isinstance(body.get("messages"), list) and body["messages"]):
        raise RequestError("'messages' must be a non-empty list", param="messages")
    klass = headers.get(CLASS_HEADER, INTERACTIVE).strip().lower()
    if klass not in REQUEST_CLASSES:
        raise RequestError(f"{CLASS_HEADER} must be one of {list(REQUEST_CLASSES)}, got {klass!r}")
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and not (type(value) is int and value > 0):
            raise RequestError(f"'{name}' must be a positive integer, got {value!r}", param=name)
    body.pop("kv_transfer_params", None)  # the router owns the hand-off
    rid = headers.get("X-Request-Id") or f"router-{uuid.uuid4().hex}"
    forward = {k: headers[k] for k in ("Authorization",) if k in headers}
    return ClientRequest(endpoint, body, rid, klass == INTERACTIVE, forward)


def verified(kv_transfer_params) -> bool:
    """The prefill instance's answer says it saved at least one block (the connector's contract, docs/router.md)."""
    kv = kv_transfer_params.get("kvstore") if isinstance(kv_transfer_params, dict) else None
    saved = kv.get("saved_blocks") if isinstance(kv, dict) else None
    return type(saved) is int and saved > 0
