"""Credentials: token files, the per-user directory of the default socket, the peer check a client makes
before it talks to a daemon over a Unix socket, and the challenge-response proofs by which a client and a
daemon show each other that they know the token without sending it. See docs/security.md for the threat model.

Handshake (``challenge`` then ``hello``): the client sends a fresh nonce; the daemon answers with its own nonce,
its node id and ``server_proof``; the client checks it (and the node id it expected) before anything else goes
out, then sends ``client_proof`` in its hello. Each proof is HMAC-SHA256 keyed by the token over a role label,
both nonces and the daemon's node id, so neither side can replay or reflect the other's proof, and a listener
that does not know the token learns nothing it can use.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import stat
import struct

from kvstore.errors import AuthenticationError, InvalidArgumentError

_PEERCRED = struct.Struct("3i")  # pid, uid, gid
NONCE_BYTES = 32
PROOF_BYTES = 32  # SHA-256
_LABELS = {"server": b"kvstore/1 daemon proof\0", "client": b"kvstore/1 client proof\0"}


def read_token_file(path: str) -> str:
    """The token in ``path`` (surrounding whitespace stripped). Refuses, with InvalidArgumentError, a file
    that group or others may read or write (the token is the key to every object) and an empty one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise InvalidArgumentError(f"cannot read token file {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if st.st_mode & 0o077:
            raise InvalidArgumentError(f"token file {path} is readable or writable by group or others (mode "
                                       f"{stat.S_IMODE(st.st_mode):04o}): chmod 600 {path}")
        with os.fdopen(fd, closefd=False) as f:
            token = f.read().strip()
    finally:
        os.close(fd)
    if not token:
        raise InvalidArgumentError(f"token file {path} is empty")
    return token


def env_token() -> str | None:
    """The token named by ``$KVSTORE_TOKEN_FILE`` (clients use it when given no token), or None."""
    path = os.environ.get("KVSTORE_TOKEN_FILE")
    return read_token_file(path) if path else None


def ensure_private_dir(path: str) -> None:
    """Create ``path`` as a 0700 directory of this user, or check that an existing one is exactly that
    (not a link, owned by us, no access for group or others). InvalidArgumentError otherwise: another user
    who made it first could squat the socket inside and collect clients' tokens."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise InvalidArgumentError(f"{path} should be this user's private directory, but it is not a directory")
    if st.st_uid != os.getuid():
        raise InvalidArgumentError(f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()}): "
                                   "refusing to put the daemon's socket there (use --listen unix:///other/path)")
    if st.st_mode & 0o077:
        raise InvalidArgumentError(f"{path} has mode {stat.S_IMODE(st.st_mode):04o}; it must be 0700 "
                                   f"(chmod 700 {path})")


def check_peer(sock: socket.socket, where: str) -> None:
    """Refuse a Unix-socket peer run by another user (root excepted, who can read our memory anyway):
    AuthenticationError naming its uid, before any byte (a token, a key, a value) is sent to it."""
    pid, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    if uid not in (os.getuid(), 0):
        raise AuthenticationError(f"the daemon at {where} runs as uid {uid} (pid {pid}), not as this user "
                                  f"(uid {os.getuid()}) or root: refusing to talk to it (a socket squatted by "
                                  "another user?)")


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def proof(token: str, role: str, client_nonce: bytes, server_nonce: bytes, node: str) -> bytes:
    """HMAC-SHA256(token, label(role) + client nonce + server nonce + node id). ``role`` is ``"server"`` (the
    daemon's answer to a challenge) or ``"client"`` (the hello's); the labels keep one from passing for the other.
    The nonces have a fixed length and the node id comes last, so the message cannot be split two ways."""
    if len(client_nonce) != NONCE_BYTES or len(server_nonce) != NONCE_BYTES:
        raise InvalidArgumentError(f"nonces must be {NONCE_BYTES} bytes, got {len(client_nonce)} and "
                                   f"{len(server_nonce)}")
    message = _LABELS[role] + client_nonce + server_nonce + node.encode()
    return hmac.new(token.encode(), message, hashlib.sha256).digest()


def proof_ok(token: str, role: str, client_nonce: bytes, server_nonce: bytes, node: str, got: object) -> bool:
    """Whether ``got`` is the proof ``role`` owes for these nonces and node id (constant-time compare)."""
    if not isinstance(got, bytes) or len(got) != PROOF_BYTES or not isinstance(server_nonce, bytes) \
            or len(server_nonce) != NONCE_BYTES:
        return False
    return hmac.compare_digest(proof(token, role, client_nonce, server_nonce, node), got)
