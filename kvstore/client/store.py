"""KVStore: the public API, the same for an in-process store and a client of ``kvstore serve``.

``KVStore.embedded(capacity=...)`` runs master and segments in this process; ``kvstore.connect(url)`` talks to
a daemon. Both share the argument checking, value encoding and checksums defined here; a backend supplies
the handful of primitives below the line.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstore.client import pages, registry, staging
from kvstore.client.reservation import Reservation
from kvstore.client.staging import Staged, StagingPool
from kvstore.core.digest import Digest, checksum_of
from kvstore.core.meta import ObjectMeta, validate_key, validate_ttl, validate_user_meta
from kvstore.core.value import KVObject, Payload, as_payload, writable_view
from kvstore.errors import BufferTooSmallError, ChecksumError, InvalidArgumentError, KVStoreError, StoreConnectionError
from kvstore.gpu import runtime as gpu
from kvstore.units import parse_size

if TYPE_CHECKING:
    from kvstore.client.device import DeviceMemory
    from kvstore.layout import KVLayout


@dataclass(frozen=True, slots=True)
class PutFlags:
    if_absent: bool = False
    pin: bool = False
    ephemeral: bool = False


class KVStore(ABC):
    """Store KV-cache objects by key.

    Every method raises the typed errors of :mod:`kvstore.errors`: a missing key is
    :class:`~kvstore.KeyNotFoundError`, never an empty value."""

    producer: str = ""
    #: the most objects one batch (batch_put, batch_reserve, put_pages, wait) may hold here; None: no bound.
    #: Checked before anything is sent or reserved, so a batch over it changes nothing (InvalidArgumentError).
    max_batch: int | None = None

    # ---- construction -------------------------------------------------------------------------------
    @staticmethod
    def embedded(capacity: int | str = "1GiB", **options: Any) -> KVStore:
        """A store living in this process (no daemon). Options: high_watermark, low_watermark."""
        return registry.backend("embedded")(parse_size(capacity), **options)

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- writes -------------------------------------------------------------------------------------
    def put(self, key: str, value: Any, meta: dict[str, Any] | None = None, ttl: float | None = None, *,
            if_absent: bool = False, pin: bool = False, ephemeral: bool = False) -> ObjectMeta:
        """Store ``value`` (bytes-like, numpy array or torch CPU tensor) under ``key``.

        The new version becomes visible atomically when all its bytes are written; a reader of the old
        version finishes on the old bytes. ``if_absent`` raises KeyExistsError instead of replacing;
        ``pin`` keeps the object from eviction; ``ttl`` seconds after commit it expires; an ``ephemeral``
        object is removed when this client disconnects (or dies)."""
        flags = PutFlags(if_absent=if_absent, pin=pin, ephemeral=ephemeral)
        if gpu.is_device_value(value):
            device = self._require_device()  # refuse before anything is sent
            return device.put_many([self._prepare_device(key, value, meta, ttl)], flags)[0]
        object_meta, payload = self._prepare(key, value, meta, ttl)
        return self._put(object_meta, payload, Digest(payload.view), flags=flags)

    def _prepare(self, key: str, value: Any, meta: dict[str, Any] | None, ttl: float | None
                 ) -> tuple[ObjectMeta, Payload]:
        payload = as_payload(value)
        return ObjectMeta(key=validate_key(key), size=len(payload.view), kind=payload.kind, dtype=payload.dtype,
                          shape=payload.shape, producer=self.producer, ttl=validate_ttl(ttl),
                          user=validate_user_meta(meta)), payload

    def _prepare_device(self, key: str, value: Any, meta: dict[str, Any] | None, ttl: float | None
                        ) -> tuple[ObjectMeta, Payload]:
        base, _ = self._prepare(key, b"", meta, ttl)  # validates key, ttl and user meta
        payload = gpu.device_payload(value)
        return ObjectMeta(key=base.key, size=len(payload.view), kind=payload.kind, dtype=payload.dtype,
                          shape=payload.shape, producer=base.producer, ttl=base.ttl, user=base.user), payload

    def batch_put(self, items: Iterable[tuple[str, Any]], ttl: float | None = None, *,
                  ephemeral: bool = False) -> list[ObjectMeta]:
        """Store several objects, all or nothing: they become visible together (in order) when every byte
        of every one is written; if one fails, none is visible and all their space is freed."""
        items = list(items)
        self._check_batch(len(items), "batch_put")
        flags = PutFlags(ephemeral=ephemeral)
        if any(gpu.is_device_value(value) for _, value in items):
            device = self._require_device()
            return device.put_many([self._prepare_device(key, value, None, ttl) if gpu.is_device_value(value)
                                    else self._prepare(key, value, None, ttl) for key, value in items], flags)
        prepared = [self._prepare(key, value, None, ttl) for key, value in items]
        if not prepared:
            return []
        digests = [Digest(payload.view) for _, payload in prepared]
        return self._put_many(prepared, digests, flags=flags)

    # ---- writes in place ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def reserve(self, key: str, nbytes: int, meta: dict[str, Any] | None = None, ttl: float | None = None, *,
                ephemeral: bool = False) -> Iterator[memoryview]:
        """Reserve ``nbytes`` for ``key`` and yield a writable, C-contiguous byte view to fill; the object is
        committed (visible atomically) when the block exits, aborted (nothing visible, space freed) if it
        raises. On the embedded store and a same-host daemon (shm) the view is the object's own memory in
        the segment: a single copy writes it. Elsewhere it is a staging buffer sent at commit.

        ``with store.reserve("k", n) as buf: fill(buf)``. StoreFullError, ObjectTooLargeError and
        InvalidKeyError are raised before the block runs."""
        with self.batch_reserve([(key, nbytes)], ttl=ttl, ephemeral=ephemeral, metas=[meta]) as views:
            yield views[0]

    @contextlib.contextmanager
    def batch_reserve(self, items: Iterable[tuple[str, int]], ttl: float | None = None, *,
                      ephemeral: bool = False, metas: Sequence[dict[str, Any] | None] | None = None
                      ) -> Iterator[list[memoryview]]:
        """Reserve several objects and yield their views; all of them commit together at exit (in order),
        or none does (an exception inside, a failed commit, this process dying)."""
        items = list(items)
        self._check_batch(len(items), "batch_reserve")
        if metas is not None and len(metas) != len(items):
            raise InvalidArgumentError(f"batch_reserve got {len(items)} items but {len(metas)} metas")
        with self.reservation(ttl=ttl, ephemeral=ephemeral) as batch:
            views = [batch.add(key, nbytes, meta=metas[i] if metas else None)
                     for i, (key, nbytes) in enumerate(items)]
            yield views

    def reservation(self, ttl: float | None = None, *, ephemeral: bool = False, if_absent: bool = False
                    ) -> Reservation:
        """An open set of in-place writes: ``add(key, nbytes, ...)`` reserves one and returns its view,
        ``commit(checksums)`` publishes all, ``abort()`` frees all (see :mod:`kvstore.client.reservation`).
        ``if_absent``: KeyExistsError (from ``add``, or from ``commit``, which then publishes nothing) when a key
        is already stored."""
        return Reservation(self, PutFlags(if_absent=if_absent, ephemeral=ephemeral), ttl)

    # ---- paged KV -----------------------------------------------------------------------------------
    def put_pages(self, key: str, kv_caches: Sequence[Any], block_ids: Any, *, layout: KVLayout,
                  meta: dict[str, Any] | None = None, ttl: float | None = None, ephemeral: bool = False) -> ObjectMeta:
        """Store blocks ``block_ids`` of every layer's cache as one packed object (``ops.packed_shape(layout,
        len(block_ids))``), gathered straight into the store's memory where it is mapped (one copy).
        Block ids must be integers (TypeError otherwise); layout errors are raised before anything is
        reserved."""
        return self.batch_put_pages([(key, block_ids)], kv_caches, layout=layout, meta=meta, ttl=ttl,
                                    ephemeral=ephemeral)[0]

    def batch_put_pages(self, items: Sequence[tuple[str, Any]], kv_caches: Sequence[Any], *, layout: KVLayout,
                        meta: dict[str, Any] | None = None, ttl: float | None = None, ephemeral: bool = False
                        ) -> list[ObjectMeta]:
        """Several packed objects (key, block ids) of the same caches, committed all or nothing."""
        return pages.put_pages(self, items, kv_caches, layout, ttl, ephemeral, meta)

    def get_pages(self, key: str, kv_caches: Sequence[Any], block_ids: Any, *, layout: KVLayout,
                  verify: bool = False) -> int:
        """Scatter the packed object ``key`` into blocks ``block_ids`` of every layer's cache, straight from
        the store's memory under a lease; returns the bytes moved. LayoutMismatchError (size or dtype) and,
        with ``verify``, ChecksumError are raised before a byte is written into the caches."""
        return pages.get_pages(self, [(key, block_ids)], kv_caches, layout, verify)

    def batch_get_pages(self, items: Sequence[tuple[str, Any]], kv_caches: Sequence[Any], *, layout: KVLayout,
                        verify: bool = False) -> int:
        return pages.get_pages(self, items, kv_caches, layout, verify)

    # ---- reads --------------------------------------------------------------------------------------
    def get(self, key: str, *, copy: bool = True, verify: bool = False) -> KVObject:
        """The object under ``key``, read-only; its bytes never change under the caller on any transport.

        ``copy=False`` avoids the copy where the store's memory can be mapped: embedded, and a daemon's
        ``shm`` / ``cuda_ipc`` paths return a view into the store's memory that holds a lease (the object
        cannot be evicted or removed) until ``release()``, the end of a ``with`` block or garbage collection.
        Over ``tcp`` and ``ucx`` the bytes have to cross a socket into this process anyway, so ``copy=False``
        returns that private copy and holds no lease: the stored object may then be evicted or removed while
        the copy stays valid — until ``release()`` (or the end of the ``with`` block), after which its warm
        buffer is reused by later reads and writes of this client, exactly as a released view of the store's
        memory may be reused by later objects: do not touch a ``copy=False`` object after releasing it.
        Use ``with store.lease(key):`` to keep an object in the store on every transport. (A lease over tcp
        would only pin the object at the cost of two round trips, protecting no memory of the caller's.)"""
        obj = self._get(validate_key(key), copy=copy)
        if verify:
            self._verify(obj.meta, memoryview(obj))
        return obj

    def get_many(self, keys: Sequence[str], *, copy: bool = False) -> list[KVObject | KVStoreError]:
        """``get`` of several keys: per key, the object (a zero-copy view under a lease, as ``get(copy=False)``,
        unless ``copy``) or the typed error that key met (KeyNotFoundError...). Only a lost connection raises.
        A same-host daemon leases all of them in one round trip; release each object (``with`` or
        ``release()``) when done."""
        keys = [validate_key(k) for k in keys]
        self._check_batch(len(keys), "get_many")
        if not copy:
            return self._get_many_views(keys)
        return [self._get_or_error(key, copy=True) for key in keys]

    def send_releases(self) -> None:
        """Hand released leases back to the store now (a daemon client otherwise sends them with its next
        request); no round trip. A no-op where releases are immediate."""
        return None

    def _get_or_error(self, key: str, *, copy: bool) -> KVObject | KVStoreError:
        try:
            return self._get(key, copy=copy)
        except StoreConnectionError:
            raise
        except KVStoreError as exc:
            return exc

    def _get_many_views(self, keys: list[str]) -> list[KVObject | KVStoreError]:
        return [self._get_or_error(key, copy=False) for key in keys]

    def get_into(self, key: str, out: Any, *, verify: bool = False) -> int:
        """Copy the object into ``out`` (numpy array, torch CPU tensor, bytearray, writable memoryview);
        returns the number of bytes written. BufferTooSmallError (nothing written) if it does not fit.
        A CUDA tensor (or DeviceBuffer) goes through ``device_memory()``."""
        if gpu.is_device_value(out):
            return self._get_into_device(key, out, verify)
        dst = writable_view(out)
        key = validate_key(key)

        def fit(size: int) -> memoryview:
            if size > len(dst):
                raise BufferTooSmallError(f"object {key!r} is {size} bytes but the buffer holds {len(dst)}",
                                          needed=size, got=len(dst))
            return dst

        size, checksum = self._get_into(key, fit)
        if verify:
            self._verify_raw(key, checksum, dst[:size])
        return size

    def _get_into_device(self, key: str, out: Any, verify: bool) -> int:
        device = self._require_device()
        dst = gpu.device_destination(out)
        key = validate_key(key)
        size, checksum = device.get_into(key, dst)
        if verify and checksum is not None:
            self._verify_raw(key, checksum, gpu.to_host(dst, size))
        return size

    def batch_get_into(self, keys: Sequence[str], outs: Sequence[Any]) -> list[int]:
        if len(keys) != len(outs):
            raise InvalidArgumentError(f"batch_get_into got {len(keys)} keys but {len(outs)} buffers")
        return [self.get_into(key, out) for key, out in zip(keys, outs, strict=True)]

    def exists(self, key: str) -> bool:
        return self._exists(validate_key(key))

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        return self._batch_exists([validate_key(k) for k in keys])

    def unpin(self, keys: Sequence[str]) -> int:
        """Make pinned objects (``put(..., pin=True)``) ordinary cache entries again: evictable, most recently
        used, their TTL still running. Absent or unpinned keys are skipped; returns how many were unpinned."""
        keys = [validate_key(k) for k in keys]
        return self._unpin(keys) if keys else 0

    def _unpin(self, keys: list[str]) -> int:
        raise InvalidArgumentError(f"{type(self).__name__} cannot unpin objects")

    def evict(self, key: str) -> bool:
        """Drop the object as the cache would; False if absent. Leased or pinned: ObjectBusyError."""
        return self._evict(validate_key(key))

    def remove(self, key: str) -> bool:
        """Delete the object; False if absent. Leased: ObjectBusyError."""
        return self._remove(validate_key(key))

    def wait(self, keys: Sequence[str], timeout: float) -> str | None:
        """Block until one of ``keys`` is committed (notified, not polled); returns it, or None at timeout."""
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout <= 3600:
            raise InvalidArgumentError(f"timeout must be between 0 and 3600 seconds, got {timeout!r}")
        keys = [validate_key(k) for k in keys]
        self._check_batch(len(keys), "wait")
        return self._wait(keys, float(timeout))

    def touch(self, keys: Sequence[str], ttl: float) -> list[int | None]:
        """Keep each stored object of ``keys`` for at least ``ttl`` more seconds (an object that expires later
        keeps its expiry, one without a TTL keeps none) and count it as just used for eviction; returns each
        one's checksum (its xxh3-64: which version is kept), None for a key not stored. In one request."""
        keys = [validate_key(k) for k in keys]
        self._check_batch(len(keys), "touch")
        seconds = validate_ttl(ttl)
        if seconds is None:
            raise InvalidArgumentError("touch needs a ttl (seconds), got None")
        return self._touch(keys, seconds) if keys else []

    def inspect(self, key: str) -> dict[str, Any]:
        """Size, dtype/shape, checksum, state, leases, age, TTL, segment and offset of one object."""
        return self._inspect(validate_key(key))

    def _check_batch(self, n: int, what: str) -> None:
        if self.max_batch is not None and n > self.max_batch:
            raise InvalidArgumentError(f"{what} of {n} objects: this store takes at most {self.max_batch} in one "
                                       f"batch (one request); nothing was sent. Split it (each batch is atomic)")

    # ---- device memory ------------------------------------------------------------------------------
    def device_memory(self) -> DeviceMemory | None:
        """How this store moves device values (CUDA tensors, DeviceBuffers), or None when it takes host memory
        only. ``put`` / ``batch_put`` / ``get_into`` route device values through it; callers such as
        ``KVHandoff`` ask it whether device tensors may be handed over as they are."""
        return None

    def _device_refusal(self) -> str:
        """Why ``device_memory()`` is None (the message of the InvalidArgumentError device values get)."""
        return ("this store takes host memory only; connect to a kvstore daemon on this host (transport 'auto', "
                "'cuda_ipc' or 'shm'), which moves CUDA tensors, or pass a CPU tensor")

    def _require_device(self) -> DeviceMemory:
        device = self.device_memory()
        if device is None:
            raise InvalidArgumentError(self._device_refusal())
        return device

    def _batch_exists(self, keys: list[str]) -> list[bool]:
        return [self._exists(key) for key in keys]

    @contextlib.contextmanager
    def lease(self, key: str) -> Iterator[ObjectMeta]:
        """While held, the object cannot be evicted or removed (a replace makes a new version visible)."""
        handle, meta = self._lease(validate_key(key))
        try:
            yield meta
        finally:
            self._release(handle)

    def _verify(self, meta: ObjectMeta, data: memoryview) -> None:
        self._verify_raw(meta.key, meta.checksum, data)

    @staticmethod
    def _verify_raw(key: str, expected: int | None, data: memoryview) -> None:
        actual = checksum_of(data)
        if expected is not None and actual != expected:
            raise ChecksumError(f"object {key!r}: xxh3 {actual:#018x} differs from {expected:#018x} "
                                "recorded at commit")

    # ---- backend primitives -------------------------------------------------------------------------
    # In-place writes. The default stages in a client buffer and stores it with _put_many at commit; backends
    # whose memory the caller can map (embedded, a same-host daemon) hand out the object's own memory.
    _staging: StagingPool | None = None

    def _staging_pool(self) -> StagingPool:
        """Warm client buffers for staged writes and for zero-copy reads on paths that cannot map the store."""
        if self._staging is None:
            self._staging = StagingPool()
        return self._staging

    def _reserve(self, meta: ObjectMeta, flags: PutFlags) -> tuple[Any, memoryview]:
        """Reserve ``meta.size`` bytes for ``meta``; return (handle, writable view)."""
        return staging.stage(self._staging_pool(), meta, flags)

    def _commit_reserved(self, handles: list[Any], metas: list[ObjectMeta], checksums: list[int | None]
                         ) -> list[ObjectMeta]:
        """Commit reserved objects at once with these checksums (abort them all on failure). A None checksum
        (only for staged handles) is computed by the path that sends the bytes (a daemon hashes a stream as it
        lands)."""
        return staging.send_staged(handles, checksums, self._put_many, self._staging)

    def _abort_reserved(self, handles: list[Any], quiet: bool = False) -> None:
        """Free reserved objects (staging buffers: nothing was sent; they go back to the pool)."""
        staging.unstage([h for h in handles if isinstance(h, Staged)], self._staging)
        handles.clear()

    @abstractmethod
    def _put(self, meta: ObjectMeta, payload: Payload, digest: Digest, *, flags: PutFlags) -> ObjectMeta:
        """Store ``payload``; record ``digest()`` as its checksum at commit."""

    @abstractmethod
    def _put_many(self, items: list[tuple[ObjectMeta, Payload]], digests: list[Digest], *,
                  flags: PutFlags) -> list[ObjectMeta]:
        """Write every payload as a pending put, then commit them all at once (abort all on failure)."""

    @abstractmethod
    def _get(self, key: str, *, copy: bool) -> KVObject: ...

    @abstractmethod
    def _get_into(self, key: str, fit: Callable[[int], memoryview]) -> tuple[int, int | None]:
        """Copy into ``fit(size)``; return (size, checksum recorded at commit)."""

    @abstractmethod
    def _lease(self, key: str) -> tuple[Any, ObjectMeta]: ...

    @abstractmethod
    def _release(self, handle: Any) -> None: ...

    @abstractmethod
    def _exists(self, key: str) -> bool: ...

    @abstractmethod
    def _evict(self, key: str) -> bool: ...

    @abstractmethod
    def _remove(self, key: str) -> bool: ...

    @abstractmethod
    def _wait(self, keys: list[str], timeout: float) -> str | None: ...

    @abstractmethod
    def keys(self, prefix: str = "") -> list[str]: ...

    @abstractmethod
    def _inspect(self, key: str) -> dict[str, Any]: ...

    @abstractmethod
    def _touch(self, keys: list[str], ttl: float) -> list[int | None]: ...

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """At least capacity_bytes, used_bytes, objects, evictions, leases, pending."""

    @abstractmethod
    def close(self) -> None: ...
