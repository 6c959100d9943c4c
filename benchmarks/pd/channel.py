"""A message channel between the router and a worker process: msgpack frames over a multiprocessing pipe.

Messages are dicts with an ``op`` string; every frame carries the schema version. No pickle crosses the
process boundary (the pipe's own ``send``/``recv`` would pickle; ``send_bytes``/``recv_bytes`` do not).
"""

from __future__ import annotations

from multiprocessing.connection import Connection

import msgpack

SCHEMA_VERSION = 1
MAX_FRAME_BYTES = 64 << 20


class ChannelClosedError(ConnectionError):
    """The other end closed the pipe (or its process died). Nothing more can be sent or received."""


class Channel:
    def __init__(self, conn: Connection):
        self.conn = conn

    def send(self, op: str, **fields) -> None:
        frame = msgpack.packb({"v": SCHEMA_VERSION, "op": op, **fields}, use_bin_type=True)
        if len(frame) > MAX_FRAME_BYTES:
            raise ValueError(f"message {op!r} is {len(frame)} bytes, the limit is {MAX_FRAME_BYTES}")
        try:
            self.conn.send_bytes(frame)
        except (BrokenPipeError, ConnectionResetError, OSError) as exc:
            raise ChannelClosedError(f"peer gone while sending {op!r}: {exc}") from exc

    def recv(self) -> dict:
        try:
            frame = self.conn.recv_bytes(MAX_FRAME_BYTES)
        except (EOFError, ConnectionResetError, OSError) as exc:
            raise ChannelClosedError(f"peer gone: {exc!r}") from exc
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=True)
        if not isinstance(msg, dict) or msg.get("v") != SCHEMA_VERSION or not isinstance(msg.get("op"), str):
            raise ValueError(f"malformed message (want a dict with v={SCHEMA_VERSION} and an op): {msg!r:.200}")
        return msg

    def poll(self, timeout: float = 0.0) -> bool:
        try:
            return self.conn.poll(timeout)
        except (EOFError, OSError) as exc:
            raise ChannelClosedError(f"peer gone: {exc!r}") from exc

    def close(self) -> None:
        self.conn.close()
