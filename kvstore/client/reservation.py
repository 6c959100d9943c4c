"""Reservation: objects written in place, then committed together — the primitive under ``KVStore.reserve``,
``batch_reserve`` and ``put_pages``.

``add`` reserves one object's space and returns a writable, C-contiguous byte view of it. On the embedded
store and on a same-host daemon (shm) that view **is** the object's memory in the segment, so a kernel can
write straight into it; elsewhere (tcp, ucx, a cluster) it is a client-side staging buffer sent at commit.
``commit`` makes every object visible at once (all or nothing, in order); ``abort`` — or an exception inside
the ``with`` block, or this process dying — leaves nothing visible and frees the space.

A filler that already knows a checksum (the xxh3-64 of exactly the object's bytes, e.g. computed while the
bytes were in cache) passes it to ``commit``; otherwise it is computed at commit from the view. Where the view
is segment memory (embedded, shm) the given checksum is recorded as it is (a wrong one is caught by a
``verify=True`` read); where staged bytes travel to a daemon (tcp), the daemon hashes them as they land and
refuses a checksum they do not match (``ChecksumError``, nothing of the batch visible).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

from kvstore.client.staging import Staged
from kvstore.core.digest import checksum_of
from kvstore.core.meta import ObjectMeta, validate_key, validate_ttl, validate_user_meta
from kvstore.errors import InvalidArgumentError

if TYPE_CHECKING:
    from kvstore.client.store import KVStore, PutFlags


def _check_nbytes(nbytes: object) -> int:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise InvalidArgumentError(f"nbytes must be an int >= 0, got {nbytes!r}")
    return nbytes


class Reservation:
    """Pending objects of one store, committed or aborted together. Not thread-safe; use it from one thread."""

    def __init__(self, store: KVStore, flags: PutFlags, ttl: float | None):
        self._store, self._flags, self._ttl = store, flags, validate_ttl(ttl)
        self._metas: list[ObjectMeta] = []
        self._handles: list[Any] = []
        self._views: list[memoryview] = []
        self._done = False
        self.committed: list[ObjectMeta] = []  # after commit: the objects' metadata

    def add(self, key: str, nbytes: int, *, meta: dict[str, Any] | None = None, kind: str = "bytes",
            dtype: str | None = None, shape: tuple[int, ...] | None = None) -> memoryview:
        """Reserve ``nbytes`` for ``key`` now (StoreFullError, KeyExistsError… here, nothing else changes) and
        return its writable byte view. ``kind``/``dtype``/``shape`` describe the value for readers."""
        if self._done:
            raise InvalidArgumentError("this reservation is already committed or aborted")
        self._store._check_batch(len(self._handles) + 1, "a reservation")
        object_meta = ObjectMeta(key=validate_key(key), size=_check_nbytes(nbytes), kind=kind, dtype=dtype,
                                 shape=shape, producer=self._store.producer, ttl=self._ttl,
                                 user=validate_user_meta(meta))
        handle, view = self._store._reserve(object_meta, self._flags)
        self._metas.append(object_meta)
        self._handles.append(handle)
        self._views.append(view)
        return view

    def drop(self, key: str) -> None:
        """Give back the object reserved for ``key``: nothing of it becomes visible; the others stay reserved."""
        if self._done:
            raise InvalidArgumentError("this reservation is already committed or aborted")
        i = next((i for i, m in enumerate(self._metas) if m.key == key), None)
        if i is None:
            raise InvalidArgumentError(f"{key!r} is not reserved in this reservation")
        try:
            self._views.pop(i).release()
        except BufferError:
            pass  # the caller still exports it; it goes when they do
        self._metas.pop(i)
        self._store._abort_reserved([self._handles.pop(i)], quiet=True)

    @property
    def views(self) -> list[memoryview]:
        return list(self._views)

    def commit(self, checksums: Sequence[int | None] | None = None) -> list[ObjectMeta]:
        """Make every reserved object visible at once; returns their committed metadata. ``checksums`` (one
        per object, None to compute it here) are recorded as the objects' xxh3-64."""
        if self._done:
            raise InvalidArgumentError("this reservation is already committed or aborted")
        if checksums is None:
            checksums = [None] * len(self._metas)
        if len(checksums) != len(self._metas):
            raise InvalidArgumentError(f"commit got {len(checksums)} checksums for {len(self._metas)} objects")
        # a staged object's bytes are hashed by the path that sends them (a daemon, as they land); an object
        # written in the store's own memory is hashed here
        sums = [checksum_of(view) if c is None and not isinstance(h, Staged) else c
                for c, view, h in zip(checksums, self._views, self._handles, strict=True)]
        self._done = True
        self._release_views()
        if not self._metas:
            return []
        try:
            self.committed = self._store._commit_reserved(self._handles, self._metas, sums)
            return self.committed
        except BaseException:
            self._store._abort_reserved(self._handles, quiet=True)
            raise

    def abort(self) -> None:
        """Free every reserved object; nothing becomes visible. Idempotent."""
        if self._done:
            return
        self._done = True
        self._release_views()
        self._store._abort_reserved(self._handles, quiet=True)

    def _release_views(self) -> None:
        # Views of segment memory must not outlive the reservation: release ours (a caller's own slices or
        # tensors made from them stay valid memory-wise but no longer name a pending object).
        for view in self._views:
            try:
                view.release()
            except BufferError:
                pass  # the caller still exports it (e.g. a tensor over it); it goes when they do
        self._views = []

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()
