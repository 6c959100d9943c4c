"""The client's side of the handshake: prove the token without sending it, and make the daemon prove it too.

With a token: ``challenge`` first, and nothing more is sent unless the daemon's answer proves the same token
and names the node this client expected to find there (a cluster's directory says which node an address
belongs to; Redis is not trusted with that). Then ``hello`` with the client's proof. Without a token, a plain
hello (the daemon refuses it if it wants one). A daemon without a token (``--insecure``, or a Unix socket only)
cannot prove anything: a client talks to it at an address the user gave, but never as a cluster peer.
See ``kvstore.daemon.handshake`` for the daemon's side and docs/security.md for the threat model.
"""

from __future__ import annotations

from typing import Any

from kvstore.client.rpc import Caller
from kvstore.errors import AuthenticationError
from kvstore.protocol import credentials


def say_hello(conn: Caller, token: str | None, fields: dict[str, Any], node: str | None = None
              ) -> dict[str, Any]:
    """Authenticate ``conn`` and send ``hello`` with ``fields``; the daemon's hello reply.

    ``node``: the cluster node id the caller expects at this address. AuthenticationError (nothing but the
    challenge sent) when the daemon cannot prove the token or is another node."""
    hello = {"op": "hello", **fields}
    if node is not None:
        hello["node"] = node
    if token is None:
        return conn.call(hello)
    client_nonce = credentials.new_nonce()
    reply = conn.call({"op": "challenge", "nonce": client_nonce})
    server_nonce, served, proof = reply.get("nonce") or b"", reply.get("node"), reply.get("proof")
    served = served if isinstance(served, str) else ""
    where = str(conn.endpoint)
    if proof is None and node is None:
        return conn.call(hello)  # a daemon without a token, at the address the user gave: nothing to prove
    if proof is None:
        raise AuthenticationError(f"the daemon at {where} has no token and cannot prove it is cluster node "
                                  f"{node!r}; nothing is sent to an unproven peer")
    if not credentials.proof_ok(token, "server", client_nonce, server_nonce, served, proof):
        raise AuthenticationError(f"the daemon at {where} could not prove it knows the token (another token, or "
                                  "not a kvstore daemon of this deployment); nothing was sent to it")
    if node is not None and served != node:
        raise AuthenticationError(f"the daemon at {where} is {'node ' + repr(served) if served else 'no cluster node'}"
                                  f", not node {node!r}: the cluster directory points at the wrong address")
    hello["proof"] = credentials.proof(token, "client", client_nonce, server_nonce, served)
    return conn.call(hello)
