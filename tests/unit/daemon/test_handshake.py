"""The handshake's proofs and the daemon's checks of a hello (no sockets: the daemon's side is plain state;
the end-to-end handshake runs in tests/integration/daemon and tests/integration/cluster/test_cluster_trust.py)."""

from __future__ import annotations

import pytest

from kvstore.daemon.handshake import Handshake
from kvstore.errors import AuthenticationError, InvalidArgumentError
from kvstore.protocol import credentials

TOKEN = "s3cret"


def hello(**fields) -> dict:
    return {"token": None, "proof": None, "node": None, **fields}


def answer(hs: Handshake, token: str = TOKEN, node: str | None = None) -> dict:
    nonce = credentials.new_nonce()
    reply = hs.challenge(nonce)
    assert credentials.proof_ok(TOKEN, "server", nonce, reply["nonce"], reply["node"], reply["proof"])
    return hello(proof=credentials.proof(token, "client", nonce, reply["nonce"], reply["node"]), node=node)


def test_proofs_bind_role_nonces_and_node():
    a, b = credentials.new_nonce(), credentials.new_nonce()
    p = credentials.proof(TOKEN, "client", a, b, "n1")
    assert len(p) == credentials.PROOF_BYTES and credentials.proof_ok(TOKEN, "client", a, b, "n1", p)
    for role, x, y, node, token in [("server", a, b, "n1", TOKEN), ("client", b, a, "n1", TOKEN),
                                    ("client", a, b, "n2", TOKEN), ("client", a, b, "n1", "other")]:
        assert not credentials.proof_ok(token, role, x, y, node, p)
    assert not credentials.proof_ok(TOKEN, "client", a, b, "n1", p[:-1])
    assert not credentials.proof_ok(TOKEN, "client", a, b"short", "n1", p)
    with pytest.raises(InvalidArgumentError):
        credentials.proof(TOKEN, "client", a, b"short", "n1")


def test_a_proof_answers_one_challenge_once():
    hs = Handshake(TOKEN, "n1", local=False)
    good = answer(hs, node="n1")
    hs.check_hello(good)
    with pytest.raises(AuthenticationError):  # replayed: the challenge was used up
        hs.check_hello(good)
    with pytest.raises(AuthenticationError):
        hs.check_hello(answer(hs, token="wrong"))
    with pytest.raises(AuthenticationError):  # a proof without a challenge on this connection
        Handshake(TOKEN, "n1", local=False).check_hello(good)


def test_hello_naming_another_node_is_refused():
    hs = Handshake(TOKEN, "n1", local=False)
    with pytest.raises(AuthenticationError, match="n2"):
        hs.check_hello(answer(hs, node="n2"))
    with pytest.raises(AuthenticationError):  # a single daemon is no cluster node
        Handshake(None, "", local=True).check_hello(hello(node="n1"))
    Handshake(None, "", local=True).check_hello(hello())


@pytest.mark.parametrize("local", [True, False])
def test_token_in_clear_only_on_a_unix_socket(local):
    hs = Handshake(TOKEN, "", local=local)
    if local:
        hs.check_hello(hello(token=TOKEN))
    else:
        with pytest.raises(AuthenticationError, match="clear"):
            hs.check_hello(hello(token=TOKEN))
    with pytest.raises(AuthenticationError):
        hs.check_hello(hello(token="wrong"))
    with pytest.raises(AuthenticationError):
        hs.check_hello(hello())


def test_a_daemon_without_a_token_proves_nothing_and_asks_nothing():
    hs = Handshake(None, "n1", local=False)
    assert hs.challenge(credentials.new_nonce())["proof"] is None
    hs.check_hello(hello())
