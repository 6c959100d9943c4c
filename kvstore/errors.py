"""The one error hierarchy of kvstore.

Every class says two things in its docstring: whether the failed operation was rolled back (nothing it
started is left visible or allocated), and whether retrying the same call can help.
"""

from __future__ import annotations

from typing import Any


class KVStoreError(Exception):
    """Base of every error kvstore raises on purpose."""

    #: stable name used on the wire; the client maps it back to the class
    code = "KVStoreError"


class KeyNotFoundError(KVStoreError, KeyError):
    """The key is not stored (never written, removed, evicted or expired).

    Nothing was changed. Retrying helps only if another producer is about to put the key.
    """

    code = "KeyNotFound"

    def __str__(self) -> str:  # KeyError's repr-quoting makes messages hard to read
        return str(self.args[0]) if self.args else "key not found"


class KeyExistsError(KVStoreError):
    """``put(..., if_absent=True)`` found the key already committed.

    Rolled back: the new value was not stored. Retrying will fail the same way until the key is removed.
    """

    code = "KeyExists"


class StoreFullError(KVStoreError):
    """Not enough space even after relocating what may move and evicting everything that may be evicted
    (leased, pending and pinned objects are never evicted; leased, pending and quarantined ones never move).
    The message gives the used, free and largest-free-extent bytes, the fragmentation, and the bytes of each
    kind of holder that is really there.

    Rolled back: nothing was allocated. Retrying can help once leases are released or objects removed.
    """

    code = "StoreFull"


class ObjectTooLargeError(StoreFullError):
    """The value is larger than the store's whole capacity.

    Rolled back. Retrying cannot help.
    """

    code = "ObjectTooLarge"


class QuotaExceededError(StoreFullError):
    """A per-client limit of the daemon refused the request: its pending bytes (``--max-pending-bytes``, beyond
    which a reservation may use free space but never evicts committed data), the segment bytes it holds in
    pending puts and leases together (``--max-held-bytes``), or its lease count (``--max-leases``). The message
    names the limit and the client's current use.

    Rolled back: nothing was reserved or leased. Retrying helps once this client commits, aborts or releases.
    """

    code = "QuotaExceeded"


class BufferTooSmallError(KVStoreError, ValueError):
    """``get_into`` was given a buffer smaller than the object; the message names both sizes.

    Nothing was written into the buffer and the object is intact. Retry with a large enough buffer.
    """

    code = "BufferTooSmall"

    def __init__(self, message: str, needed: int | None = None, got: int | None = None):
        super().__init__(message)
        self.needed = needed
        self.got = got


class InvalidKeyError(KVStoreError, ValueError):
    """The key is empty, not valid UTF-8, or longer than 1 KiB.

    Nothing was changed. Retrying the same key cannot help.
    """

    code = "InvalidKey"


class InvalidArgumentError(KVStoreError, ValueError):
    """A request field has the wrong type or value (sizes, TTLs, buffers, options).

    Nothing was changed. Retrying the same call cannot help.
    """

    code = "InvalidArgument"


class ArenaError(InvalidArgumentError):
    """A put into a same-host client's arena named space that is not that client's free arena space: an arena
    it does not hold (unknown, released, another client's), or a range outside it or overlapping an object
    already committed from it.

    Nothing was stored and nothing was freed: the arena is as it was. Retrying the same range cannot help.
    """

    code = "Arena"


class ProtocolError(KVStoreError):
    """A malformed, truncated, oversized or unknown frame, or a schema version this side does not speak.

    The request was not applied. The connection that carried a broken frame is closed. Retrying the same
    frame cannot help.
    """

    code = "Protocol"


class FrameTooLargeError(ProtocolError):
    """A message would not fit in one frame (``kvstore.protocol.wire.MAX_FRAME``): a request is refused before
    it is sent; a daemon's reply is replaced by this error on that request.

    Nothing was sent and the connection stays usable. The request itself was carried out (replies that grow
    this large are listings, which change nothing). Retrying the same call cannot help: ask for less.
    """

    code = "FrameTooLarge"


class AuthenticationError(KVStoreError, PermissionError):
    """The daemon refused the connection's token, or the client refused a daemon run by another user.

    Nothing was done (no token or data was sent to a refused daemon). Retrying with the same token, or
    against the same daemon, cannot help.
    """

    code = "Authentication"


class ChecksumError(KVStoreError):
    """``get(..., verify=True)`` found bytes whose xxh3 differs from the checksum recorded at commit.

    The caller's buffer may hold the corrupt bytes; the stored object is left as it is for inspection.
    Retrying reads the same bytes; remove and re-put the object.
    """

    code = "Checksum"


class DiskReadError(KVStoreError):
    """A disk-tier object could not be read back: an I/O error (EIO) or bytes that do not match the
    checksum written with them (a corrupted or torn file).

    The object was dropped from the disk tier and nothing valid was written to the caller's buffer.
    Retrying finds the key missing (KeyNotFoundError); recompute it and put it again.
    """

    code = "DiskRead"


class DiskPathError(KVStoreError, OSError):
    """The disk tier cannot use its path: missing, not a directory, read-only, or locked by another
    kvstore process.

    Nothing was started. Retrying cannot help until the path is fixed (or the other process exits).
    """

    code = "DiskPath"


class LeaseError(KVStoreError):
    """A lease or pending put named in a request is unknown (already released, expired or revoked).

    Nothing was changed. Retrying the same handle cannot help; start the operation again.
    """

    code = "Lease"


class ObjectBusyError(KVStoreError):
    """``evict``/``remove`` of an object that is leased or pinned, when the caller asked not to wait.

    Nothing was changed. Retrying after the lease is released can help.
    """

    code = "ObjectBusy"


class StoreConnectionError(KVStoreError, ConnectionError):
    """The daemon is unreachable, went away, or did not answer within the client's timeout.

    An operation in flight may or may not have been applied; a put that was not committed is never
    visible. Retrying after reconnecting can help.
    """

    code = "Connection"


class StoreTimeoutError(StoreConnectionError, TimeoutError):
    """The daemon did not answer within the client's timeout. The connection is closed, since its framing
    can no longer be trusted.

    As for :class:`StoreConnectionError`: an uncommitted put is never visible. Retrying can help.
    """

    code = "Timeout"


class TransportError(KVStoreError):
    """The data path failed (a transport raised, or the requested transport is not served).

    A put whose bytes did not all arrive is aborted and never visible. Retrying can help, possibly over
    another transport.
    """

    code = "Transport"


class LayoutMismatchError(KVStoreError, ValueError):
    """Producer and consumer disagree on the KV layout, token count or block count. The message carries
    both sides' values.

    Nothing was written into the consumer's cache. Retrying cannot help; the consumer must recompute.
    """

    code = "LayoutMismatch"


class UnsupportedKVCacheError(KVStoreError, ValueError):
    """An engine's KV cache has a layout, dtype, platform or cache type kvstore cannot move; the message names
    what was found and what is supported. Raised when the cache is registered, before any byte is copied.

    Nothing was started. Retrying cannot help: change the engine's configuration (or use it without kvstore).
    """

    code = "UnsupportedKVCache"


class DeviceCopyError(KVStoreError):
    """A CUDA error (a device fault, out of memory) while moving blocks between device memory and the store.

    Rolled back: a save's reservation is aborted (nothing visible); a load's blocks are reported as failed.
    Retrying can help once the device has memory again; a faulted device needs the engine restarted anyway.
    """

    code = "DeviceCopy"


class HandoffTimeoutError(KVStoreError, TimeoutError):
    """A hand-off fetch waited longer than its timeout for the producer to publish.

    Nothing was written into the consumer's cache. Retrying with a longer timeout can help.
    """

    code = "HandoffTimeout"


class HandoffAbortedError(KVStoreError):
    """The request was cancelled, expired, or its producer went away before publishing.

    Nothing was written into the consumer's cache. Retrying cannot help; recompute the prefill.
    """

    code = "HandoffAborted"


class HandoffChecksumError(ChecksumError, HandoffAbortedError):
    """A hand-off chunk's bytes differ from the xxh3 its producer recorded at commit (``KVHandoff.fetch`` /
    ``fetch_prefix``). ``key`` names the chunk; ``failed_blocks`` are the consumer's block ids that were not
    loaded — the bad chunk's and every later chunk's — and ``loaded_blocks`` those of the earlier chunks,
    written and verified.

    Not rolled back: with verification fused into the scatter (CPU caches) the bad chunk's blocks were written
    before its hash was known, so their bytes are undefined; treat every ``failed_blocks`` id as not loaded
    (an engine recomputes them). The stored chunk is left as it is. Retrying reads the same bytes: recompute.
    """

    code = "HandoffChecksum"

    def __init__(self, message: str, key: str = "", failed_blocks: tuple[int, ...] = (),
                 loaded_blocks: tuple[int, ...] = ()):
        super().__init__(message)
        self.key = key
        self.failed_blocks = tuple(failed_blocks)
        self.loaded_blocks = tuple(loaded_blocks)


class ServerError(KVStoreError):
    """The daemon hit an unexpected internal error while serving the request (logged on the daemon).

    The request was rolled back where the daemon could tell; retrying may help.
    """

    code = "Server"


class MissingExtraError(KVStoreError, ImportError):
    """A feature needs an optional dependency that is not installed; the message names the extra.

    Nothing was done. Retrying helps only after installing it (``pip install 'kvstore[EXTRA]'``).
    """

    code = "MissingExtra"


def _all_error_classes() -> dict[str, type[KVStoreError]]:
    out: dict[str, type[KVStoreError]] = {}
    stack: list[type[KVStoreError]] = [KVStoreError]
    while stack:
        cls = stack.pop()
        out[cls.code] = cls
        stack.extend(cls.__subclasses__())
    return out


def error_from_wire(code: str, message: str, extra: dict[str, Any] | None = None) -> KVStoreError:
    """Rebuild the exception a daemon reported as ``(code, message)``; unknown codes become ServerError."""
    cls = _all_error_classes().get(code, ServerError)
    if cls is BufferTooSmallError and extra:
        return BufferTooSmallError(message, extra.get("needed"), extra.get("got"))
    return cls(message)


__all__ = [name for name, obj in dict(globals()).items() if isinstance(obj, type) and issubclass(obj, KVStoreError)]
__all__ += ["error_from_wire"]
