"""Handshake: the daemon's side of one connection's authentication (``challenge``, then ``hello``).

A client that holds the token opens with ``challenge``: the daemon answers with a fresh nonce, its node id and
its proof of the token, and remembers both nonces for this connection only. The hello then carries the
client's proof over the same nonces, checked in constant time and accepted once. The token itself never
crosses the wire (see ``kvstore.protocol.credentials``), so a listener that a forged cluster record points
clients at learns nothing it could log in with.

Older clients send the token in clear in their hello: accepted on a Unix socket only (same host, and the
kernel names the peer's uid), refused on TCP. A hello naming a cluster node id (``node``) other than this
daemon's is refused: a record advertising another node's address must not receive that node's traffic.
"""

from __future__ import annotations

import hmac
from typing import Any

from kvstore.errors import AuthenticationError
from kvstore.protocol import credentials


class Handshake:
    def __init__(self, token: str | None, node: str, local: bool):
        """``token``: the daemon's (None: any client is accepted); ``node``: its cluster node id ("" for a
        single daemon); ``local``: the connection is a Unix socket."""
        self.token, self.node, self.local = token, node, local
        self._nonces: tuple[bytes, bytes] | None = None

    def challenge(self, client_nonce: bytes) -> dict[str, Any]:
        """The reply fields to a ``challenge``: our nonce, node id, and proof (None when we have no token)."""
        server_nonce = credentials.new_nonce()
        self._nonces = (client_nonce, server_nonce)
        proof = None if self.token is None else credentials.proof(self.token, "server", client_nonce,
                                                                  server_nonce, self.node)
        return {"nonce": server_nonce, "node": self.node, "proof": proof}

    def check_hello(self, fields: dict[str, Any]) -> None:
        """AuthenticationError unless the hello's credentials are good for this daemon."""
        nonces, self._nonces = self._nonces, None  # one proof per challenge: never replayable
        expected = fields["node"]
        if expected is not None and expected != self.node:
            raise AuthenticationError(f"this daemon is {_name(self.node)}, not cluster node {expected!r}: the "
                                      "address the client was given belongs to another daemon")
        if self.token is None:
            return
        if fields["proof"] is not None:
            if nonces is None:
                raise AuthenticationError("hello carries a proof but no challenge was asked on this connection")
            if not credentials.proof_ok(self.token, "client", *nonces, self.node, fields["proof"]):
                raise AuthenticationError("wrong token (the hello's proof does not match)")
            return
        if fields["token"] is None:
            raise AuthenticationError("wrong or missing token")
        if not self.local:
            raise AuthenticationError("a token sent in clear is refused over TCP: this client is too old for "
                                      "this daemon (it must answer a challenge instead)")
        if not hmac.compare_digest(fields["token"].encode(), self.token.encode()):
            raise AuthenticationError("wrong or missing token")


def _name(node: str) -> str:
    return f"cluster node {node!r}" if node else "not a cluster member"
