"""KVHandoff: hand a request's KV cache from a prefill worker to a decode worker through a KVStore.

Store objects of one request (``rid`` = request id):

- ``kvp/<fingerprint>/<digest>[/<n>]``  one chunk of ``n`` (up to ``chunk_blocks``) packed blocks (block-major,
  all layers; see docs/kv_layout.md), published with token ids: the key of :mod:`kvstore.keys`, the chained
  digest of the chunk's last block (it commits to every token before it) under the layout fingerprint, so a
  shared prompt prefix has the same keys (prefix reuse). A one-block chunk (``chunk_blocks=1``, or a last
  chunk of one block) has the block's own key, the one the vLLM connector saves and looks up: with the
  connector's layout (``CacheLayout.kv_layout()``) the two share blocks both ways (docs/keys.md).
- ``hf/<rid>/chunk/<i>`` one chunk, published without token ids (request-scoped).
- ``hf/<rid>/meta``      the :class:`~kvstore.core.meta.RequestMeta` (msgpack): written in the same all-or-nothing
  batch as the chunks, so it is visible only once every chunk is.
- ``hf/<rid>/claim``     an ephemeral object the producer holds while publishing; if it vanishes before the
  meta appears, the producer died.
- ``hf/<rid>/cancel``    a tombstone a cancel leaves behind for waiting consumers.
- ``hf/<rid>/status``    a small record for ``kvstore requests``: published / fetched / cancelled.
"""

from __future__ import annotations

import hashlib
import math
import os
import socket
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
import xxhash

from kvstore import keys as kv_keys
from kvstore import ops
from kvstore.client.pages import block_tensor, check_object
from kvstore.client.reservation import Reservation
from kvstore.client.store import KVStore
from kvstore.core.meta import RequestMeta
from kvstore.errors import (
    ChecksumError,
    HandoffAbortedError,
    HandoffChecksumError,
    HandoffTimeoutError,
    InvalidArgumentError,
    KeyExistsError,
    KeyNotFoundError,
    LayoutMismatchError,
    ObjectBusyError,
)
from kvstore.handoff_status import STATUS_GRACE_S, list_requests, request_keys
from kvstore.handoff_status import parse_status as parse_status  # noqa: F401 - public here since the first version
from kvstore.layout import KVLayout, dtype_name

_POLL_SLICE_S = 0.25  # how often a waiting consumer also checks that the producer is still alive


def chunk_keys(layout: KVLayout, token_ids: Sequence[int], chunk_tokens: int, *, cache_salt: str = "",
               adapter: str = "") -> list[str]:
    """Chained prefix keys of every chunk of ``token_ids`` (the last one may be partial): those of
    :func:`kvstore.keys.chunk_keys` for chunks of ``chunk_tokens // layout.block_size`` blocks, rooted in
    ``cache_salt`` and the LoRA ``adapter`` (``name@path``) as the vLLM connector roots a request's.
    ``chunk_tokens`` must be a whole number of blocks (InvalidArgumentError)."""
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < layout.block_size \
            or chunk_tokens % layout.block_size:
        raise InvalidArgumentError(f"chunk_tokens must be a positive multiple of the block size "
                                   f"{layout.block_size}, got {chunk_tokens!r}")
    return kv_keys.chunk_keys(token_ids, layout.fingerprint(), layout.block_size, chunk_tokens // layout.block_size,
                              cache_salt=cache_salt, adapter=adapter)


@dataclass
class Ticket:
    """Returned by ``publish``; ``wait()`` blocks until everything is committed and returns the RequestMeta."""

    request_id: str
    _future: Future

    def wait(self, timeout: float | None = None) -> RequestMeta:
        return self._future.result(timeout)

    def done(self) -> bool:
        return self._future.done()


@dataclass(frozen=True)
class FetchResult:
    meta: RequestMeta
    nbytes: int
    wait_s: float  # until the request was published
    transfer_s: float  # from then until its pages were in the cache


class KVHandoff:
    """Prefill side: :meth:`publish`; decode side: :meth:`fetch`, :meth:`lookup`, :meth:`fetch_prefix`."""

    def __init__(self, store: KVStore, layout: KVLayout, *, chunk_blocks: int = 16, producer: str | None = None,
                 status_ttl: float = STATUS_GRACE_S):
        if not isinstance(layout, KVLayout):
            raise TypeError(f"layout must be a KVLayout, got {type(layout).__name__}")
        if isinstance(chunk_blocks, bool) or not isinstance(chunk_blocks, int) or chunk_blocks < 1:
            raise ValueError(f"chunk_blocks must be an int >= 1, got {chunk_blocks!r}")
        self.store, self.layout, self.chunk_blocks = store, layout, chunk_blocks
        self.status_ttl = status_ttl
        self.producer = producer or f"{socket.gethostname()}:{os.getpid()}"
        self._pool: ThreadPoolExecutor | None = None
        self.last_fetch: FetchResult | None = None

    @property
    def chunk_tokens(self) -> int:
        return self.chunk_blocks * self.layout.block_size

    # ---- prefill side -------------------------------------------------------------------------------
    def publish(self, request_id: str, kv_caches: Sequence[torch.Tensor], block_ids: Any, *, num_tokens: int,
                token_ids: Sequence[int] | None = None, ttl: float = 60.0, cache_salt: str = "",
                adapter: str = "") -> Ticket:
        """Gather the request's pages now, straight into store memory reserved for its chunks (the caller may
        reuse its blocks as soon as this returns), and commit them with their RequestMeta in the background;
        nothing is visible to ``fetch`` until all is.

        With ``token_ids`` the chunks are prefix chunks, shared by every request of the same prompt prefix
        (see :func:`chunk_keys`). A stored one is referenced as it is, never replaced: of producers racing to
        store the same chunk, the first commit wins and the others record its checksum, chunk by chunk (a
        request's prefix may hold chunks of several producers: each is a valid KV of its tokens, as in any
        prefix cache). Every request that references a chunk keeps it for its own ``ttl`` at least. ``cache_salt``
        and the LoRA ``adapter`` are part of the keys, as in the vLLM connector."""
        rid = _check_request_id(request_id)
        ids = self._block_tensor(block_ids, kv_caches)
        self._check_counts(num_tokens, len(ids), token_ids)
        bounds = [(b, min(b + self.chunk_blocks, len(ids))) for b in range(0, len(ids), self.chunk_blocks)]
        if token_ids is not None:
            names = chunk_keys(self.layout, token_ids, self.chunk_tokens, cache_salt=cache_salt, adapter=adapter)
        else:
            names = [f"hf/{rid}/chunk/{i}" for i in range(len(bounds))]
        keys = request_keys(rid)
        claim = keys["claim"]  # held from the start, with a status record: a consumer can tell a producer that died
        self.store.put(claim, self.producer.encode(), ttl=ttl, ephemeral=True)
        self.store.put(keys["status"], self._status("publishing", None, rid, ttl), ttl=ttl + self.status_ttl)
        batch = self.store.reservation(ttl=ttl)
        fresh: dict[str, Reservation] = {}  # prefix chunks not stored yet: each committed alone, only if absent
        try:
            checksums = self._gather_chunks(batch, fresh, names, bounds, kv_caches, ids, ttl)
        except BaseException:
            for reservation in (batch, *fresh.values()):
                reservation.abort()
            _quietly(self.store.remove, claim)
            raise
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvstore-handoff")
        chunk_blocks = tuple(b1 - b0 for b0, b1 in bounds)
        future = self._pool.submit(self._commit, rid, batch, fresh, names, chunk_blocks, checksums, num_tokens,
                                   token_ids, ttl)
        return Ticket(rid, future)

    def _gather_chunks(self, batch: Reservation, fresh: dict[str, Reservation], names: list[str], bounds: list,
                       kv_caches: Sequence[torch.Tensor], ids: torch.Tensor, ttl: float) -> list[int | None]:
        """Gather the chunks this publish writes: request-scoped ones into ``batch``; a prefix chunk nobody has
        stored into a reservation of its own (``fresh``) that commits only if the key is still absent. A stored
        prefix chunk is not written at all (its checksum is None here: ``_reference`` records it at commit);
        asking for it keeps it ``ttl`` more seconds."""
        shared = [name for name in names if name.startswith("kvp/")]
        stored = {n for n, checksum in zip(shared, self.store.touch(shared, ttl) if shared else [], strict=True)
                  if checksum is not None}
        checksums: list[int | None] = []
        for name, (b0, b1) in zip(names, bounds, strict=True):
            if name in stored:
                checksums.append(None)
                continue
            if not name.startswith("kvp/"):
                checksums.append(self._gather_chunk(batch, name, kv_caches, ids[b0:b1]))
                continue
            fresh[name] = self.store.reservation(ttl=ttl, if_absent=True)
            try:
                checksums.append(self._gather_chunk(fresh[name], name, kv_caches, ids[b0:b1]))
            except KeyExistsError:  # stored by another producer since the look-up: referenced as a stored one
                fresh.pop(name).abort()
                checksums.append(None)
        return checksums

    def _commit_fresh(self, fresh: dict[str, Reservation], names: list[str], checksums: list[int | None]) -> None:
        """Commit the fresh prefix chunks, each only if still absent: one another producer stored meanwhile
        stays as it is (``_reference`` records it)."""
        for name, reservation in fresh.items():
            try:
                reservation.commit([checksums[names.index(name)]])
            except KeyExistsError:
                pass

    def _reference(self, names: list[str], ttl: float) -> dict[str, int]:
        """The checksum of the stored version of every prefix chunk of ``names``, each kept ``ttl`` more seconds
        from now (one request): the versions this request references. A chunk gone already (evicted since
        it was looked up) fails the publish; its bytes are not here any more to store it again."""
        shared = [name for name in names if name.startswith("kvp/")]
        found = {}
        for name, checksum in zip(shared, self.store.touch(shared, ttl) if shared else [], strict=True):
            if checksum is None:
                raise HandoffAbortedError(f"prefix chunk {name} was evicted before the request was published; "
                                          "publish it again")
            found[name] = checksum
        return found

    def _gather_chunk(self, batch: Reservation, key: str, kv_caches: Sequence[torch.Tensor],
                      ids: torch.Tensor) -> int:
        """Reserve one chunk, gather its blocks into it, and return its xxh3: computed by the gather itself on CPU
        caches (each piece hashed as it is written, see ``ops.gather_pages(checksum=True)``), by a pass after
        the device-to-host copy on CUDA."""
        shape = ops.packed_shape(self.layout, len(ids))
        view = batch.add(key, ops.packed_nbytes(self.layout, len(ids)), kind="torch",
                         dtype=dtype_name(self.layout.dtype), shape=shape)
        if ids.device.type != "cpu":  # one gather on the device, one device-to-host copy into the store
            staged = torch.empty(shape, dtype=self.layout.dtype, device=ids.device)
            ops.gather_pages(kv_caches, ids, staged, layout=self.layout)
            ops.packed_view(view, self.layout, len(ids)).copy_(staged)
            return xxhash.xxh3_64_intdigest(view)
        return ops.gather_pages(kv_caches, ids, view, layout=self.layout, checksum=True)[1]

    def _commit(self, rid: str, batch: Reservation, fresh: dict[str, Reservation], names: list[str],
                chunk_blocks: tuple[int, ...], checksums: list[int | None], num_tokens: int, token_ids, ttl: float
                ) -> RequestMeta:
        keys = request_keys(rid)
        nbytes = sum(chunk_blocks) * self.layout.block_nbytes
        try:
            self._commit_fresh(fresh, names, checksums)
            referenced = self._reference(names, ttl)
        except BaseException:
            for reservation in (batch, *fresh.values()):
                reservation.abort()  # those committed stay: prefix cache
            _quietly(self.store.remove, keys["claim"])
            raise
        sent = [c for name, c in zip(names, checksums, strict=True) if not name.startswith("kvp/")]
        recorded = tuple(referenced[name] if name in referenced else _known(c) for name, c in zip(names, checksums,
                                                                                                  strict=True))
        meta = RequestMeta(
            request_id=rid, layout=self.layout.to_dict(), fingerprint=self.layout.fingerprint(),
            num_tokens=num_tokens, num_blocks=sum(chunk_blocks), chunk_keys=tuple(names), chunk_blocks=chunk_blocks,
            checksums=recorded, producer=self.producer, created=time.time(), ttl=ttl,
            token_hash=_token_hash(token_ids), nbytes=nbytes)
        try:
            # The status goes first: a consumer may fetch (and mark it fetched) the moment the batch commits.
            self.store.put(keys["status"], self._status("published", meta), ttl=ttl + self.status_ttl)
            record = msgpack.packb(meta.to_wire())
            batch.add(keys["meta"], len(record))[:] = record
            batch.commit([*sent, None])
        except BaseException:
            batch.abort()
            raise
        finally:
            _quietly(self.store.remove, keys["claim"])
        if self.store.exists(keys["cancel"]):  # cancelled while we were committing: take it back
            self._drop(meta, keep_chunks=False)
        return meta

    def cancel(self, request_id: str) -> None:
        """Withdraw the request: its meta and request-scoped chunks are removed now (prefix-keyed chunks,
        possibly shared, stay until their TTL) and a waiting ``fetch`` raises HandoffAbortedError."""
        rid = _check_request_id(request_id)
        keys = request_keys(rid)
        self.store.put(keys["cancel"], b"cancelled", ttl=self.status_ttl)
        try:
            meta = self._read_meta(rid)
        except HandoffAbortedError:  # unreadable: it is withdrawn all the same
            meta = None
        if meta is not None:
            self._drop(meta, keep_chunks=False)
        self.store.put(keys["status"], self._status("cancelled", meta, rid), ttl=self.status_ttl)

    # ---- decode side --------------------------------------------------------------------------------
    def fetch(self, request_id: str, kv_caches: Sequence[torch.Tensor], block_ids: Any, *, timeout: float = 5.0,
              num_tokens: int | None = None, keep: bool = False, verify: bool = True) -> RequestMeta:
        """Wait for the request (notified by the store), check it against this side's layout and block
        count (every chunk's size and dtype too, before a byte is written), then scatter it into
        ``kv_caches[block_ids]``, verifying every chunk against the xxh3 its producer recorded at commit.

        On CPU caches the verification is fused with the scatter (each piece of a chunk is hashed as it is
        read; ``ops.scatter_pages(expect_checksum=...)``); on CUDA caches every chunk is hashed before anything
        is written. A mismatch raises HandoffChecksumError (a ChecksumError and a HandoffAbortedError) naming
        the chunk, with ``failed_blocks``: the ids of the bad chunk and of every later chunk, which are not
        loaded (their bytes are undefined: recompute them), and ``loaded_blocks``, the verified ones before it.
        ``verify=False`` skips the hash; the layout and size checks always run. The default (True) is the
        measured choice on every transport: fused, verification costs 0-22 % of a fetch (embedded ~0-8 %, shm
        13-22 %, tcp 3-14 %; README "Checksums inside the copy", ``bench_handoff --checksums``).

        Raises LayoutMismatchError (cache untouched), HandoffTimeoutError, HandoffAbortedError. Afterwards
        the request's meta is removed, and so are its request-scoped chunks unless ``keep=True``; chunks
        keyed by token prefix stay for reuse until their TTL (see ``_drop``)."""
        rid = _check_request_id(request_id)
        ids = self._block_tensor(block_ids, kv_caches)
        started = time.perf_counter()
        self._await_published(rid, time.monotonic() + timeout, timeout)
        published = time.perf_counter()
        meta = self._read_meta(rid)
        if meta is None:
            raise HandoffAbortedError(f"request {rid!r} disappeared (cancelled, expired or fetched by another worker)")
        self._check_meta(meta, len(ids), num_tokens)
        self._scatter_chunks(meta, ids, kv_caches, verify)
        self.last_fetch = FetchResult(meta, meta.nbytes, published - started, time.perf_counter() - published)
        self.store.put(request_keys(rid)["status"], self._status("fetched", meta), ttl=meta.ttl + self.status_ttl)
        self._drop(meta, keep_chunks=keep)
        return meta

    def lookup(self, token_ids: Sequence[int], *, cache_salt: str = "", adapter: str = "") -> int:
        """How many leading tokens of ``token_ids`` already have their KV stored (whole chunks)."""
        keys = chunk_keys(self.layout, token_ids, self.chunk_tokens, cache_salt=cache_salt, adapter=adapter)
        present = self.store.batch_exists(keys) if keys else []
        n = 0
        for i, ok in enumerate(present):
            if not ok:
                break
            n = min((i + 1) * self.chunk_tokens, len(token_ids))
        return n

    def fetch_prefix(self, token_ids: Sequence[int], kv_caches: Sequence[torch.Tensor], block_ids: Any, *,
                     cache_salt: str = "", adapter: str = "") -> int:
        """Scatter the stored chunks of the longest stored prefix of ``token_ids`` into the first blocks of
        ``block_ids``; returns the number of tokens fetched (0 if none). Every chunk is verified against its
        recorded checksum: fused with the scatter on CPU caches, where a bad one raises HandoffChecksumError
        as in :meth:`fetch`; on CUDA caches by ``get(verify=True)`` before anything is written (ChecksumError)."""
        n_tokens = self.lookup(token_ids, cache_salt=cache_salt, adapter=adapter)
        if n_tokens == 0:
            return 0
        keys = chunk_keys(self.layout, token_ids[:n_tokens], self.chunk_tokens, cache_salt=cache_salt,
                          adapter=adapter)
        n_blocks = math.ceil(n_tokens / self.layout.block_size)
        ids = self._block_tensor(block_ids, kv_caches)[:n_blocks]
        items = [(key, ids[i * self.chunk_blocks:min((i + 1) * self.chunk_blocks, n_blocks)])
                 for i, key in enumerate(keys)]
        leased: list = []
        on_cpu = ids.device.type == "cpu"
        try:
            for key, chunk_ids in items:
                try:  # verified here on CUDA caches, inside the scatter (fused) on CPU caches
                    obj = self.store.get(key, copy=False, verify=not on_cpu)
                except KeyNotFoundError:
                    return 0  # evicted since lookup: nothing written, the caller recomputes
                leased.append(obj)
                check_object(obj.meta, self.layout, len(chunk_ids))
            start = 0
            for obj, (key, chunk_ids) in zip(leased, items, strict=True):
                src = ops.packed_view(memoryview(obj), self.layout, len(chunk_ids))
                if not on_cpu:
                    ops.scatter_pages(src.to(ids.device), chunk_ids, kv_caches, layout=self.layout)
                else:
                    try:
                        ops.scatter_pages(src, chunk_ids, kv_caches, layout=self.layout,
                                          expect_checksum=obj.meta.checksum)
                    except ChecksumError as exc:
                        raise _checksum_error("fetch_prefix", key, ids, start, exc.actual, obj.meta.checksum) from None
                start += len(chunk_ids)
                del src
        finally:
            for obj in leased:
                obj.release()
        return n_tokens

    # ---- inspection ---------------------------------------------------------------------------------
    @staticmethod
    def requests(store: KVStore) -> list[dict]:
        """Every request with a status record: state, bytes, chunks, layout, age
        (:func:`kvstore.handoff_status.list_requests`)."""
        return list_requests(store)

    # ---- internals ----------------------------------------------------------------------------------
    def _await_published(self, rid: str, deadline: float, timeout: float) -> None:
        keys = request_keys(rid)
        saw_claim = False
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise HandoffTimeoutError(f"request {rid!r} was not published within {timeout} s")
            found = self.store.wait([keys["meta"], keys["cancel"]], min(left, _POLL_SLICE_S))
            if found == keys["meta"]:
                return
            if found == keys["cancel"]:
                raise HandoffAbortedError(f"request {rid!r} was cancelled")
            meta, cancel, claim, status = self.store.batch_exists(
                [keys["meta"], keys["cancel"], keys["claim"], keys["status"]])
            if meta:
                return
            if cancel:
                raise HandoffAbortedError(f"request {rid!r} was cancelled")
            # The producer holds the claim while it publishes; a claim (or the status it writes next) without
            # it and without the meta means the producer died mid-publish.
            if (saw_claim or status) and not claim:
                if status and self._state(rid) == "fetched":
                    raise HandoffAbortedError(f"request {rid!r} was already fetched (a request is fetched once)")
                raise HandoffAbortedError(f"the producer of request {rid!r} went away before publishing it")
            saw_claim = saw_claim or claim

    def _state(self, rid: str) -> str | None:
        try:
            record = msgpack.unpackb(bytes(self.store.get(request_keys(rid)["status"])))
        except (KeyNotFoundError, ValueError):
            return None
        return record.get("state") if isinstance(record, dict) else None

    def _read_meta(self, rid: str) -> RequestMeta | None:
        """The request's meta, None if absent; HandoffAbortedError if it is unreadable (any client can write hf/,
        and a flipped byte fails its checksum)."""
        try:
            blob = bytes(self.store.get(request_keys(rid)["meta"], verify=True))
            return RequestMeta.from_wire(msgpack.unpackb(blob, raw=False))
        except KeyNotFoundError:
            return None
        except (ChecksumError, ValueError, TypeError, KeyError) as exc:  # msgpack's and from_wire's errors
            raise HandoffAbortedError(f"request {rid!r}: its metadata is unreadable ({type(exc).__name__}: "
                                      f"{str(exc)[:200]}); recompute the prefill") from None

    def _check_meta(self, meta: RequestMeta, num_blocks: int, num_tokens: int | None) -> None:
        mine = self.layout.to_dict()
        if meta.fingerprint != self.layout.fingerprint():
            diff = {k: (meta.layout.get(k), mine[k]) for k in mine if meta.layout.get(k) != mine[k]}
            raise LayoutMismatchError(f"request {meta.request_id!r}: producer layout differs from this consumer's "
                                      f"(field: (producer, consumer)) {diff or 'fingerprint only'}")
        if meta.num_blocks != num_blocks:
            raise LayoutMismatchError(f"request {meta.request_id!r}: producer sent {meta.num_blocks} blocks, "
                                      f"consumer gave {num_blocks} block ids")
        if num_tokens is not None and meta.num_tokens != num_tokens:
            raise LayoutMismatchError(f"request {meta.request_id!r}: producer has {meta.num_tokens} tokens, "
                                      f"consumer expects {num_tokens}")

    def _scatter_chunks(self, meta: RequestMeta, ids: torch.Tensor, kv_caches: Sequence[torch.Tensor],
                        verify: bool = True) -> None:
        """Lease every chunk (zero-copy views where the store is mapped) and check its size and dtype, then
        scatter them straight from the store's memory into the caches, verifying each against the checksum the
        producer published: inside the scatter on CPU caches, before anything is written on CUDA caches."""
        leased: list = []
        n_blocks = meta.chunk_blocks
        on_cpu = ids.device.type == "cpu"
        what = f"request {meta.request_id!r}"
        try:
            for key in meta.chunk_keys:
                try:
                    leased.append(self.store.get(key, copy=False))
                except KeyNotFoundError as exc:
                    raise HandoffAbortedError(f"request {meta.request_id!r}: a chunk is gone (evicted or expired): "
                                              f"{exc}; recompute") from None
                check_object(leased[-1].meta, self.layout, n_blocks[len(leased) - 1])
                stored, recorded = leased[-1].meta.checksum, meta.checksums[len(leased) - 1]
                if stored is not None and stored != recorded:  # a version of the chunk this request does not know
                    raise HandoffAbortedError(
                        f"{what}: chunk {key} is not the version it references (checksum {stored:#x}, recorded "
                        f"{recorded:#x}): it was evicted and stored again since; recompute")
            starts = [sum(n_blocks[:i]) for i in range(len(n_blocks))]
            if verify and not on_cpu:
                for i, (obj, checksum) in enumerate(zip(leased, meta.checksums, strict=True)):
                    actual = xxhash.xxh3_64_intdigest(memoryview(obj))
                    if actual != checksum:
                        raise _checksum_error(what, meta.chunk_keys[i], ids, starts[i], actual, checksum)
            for i, (obj, n, checksum) in enumerate(zip(leased, n_blocks, meta.checksums, strict=True)):
                src = ops.packed_view(memoryview(obj), self.layout, n)
                chunk_ids = ids[starts[i]:starts[i] + n]
                if not on_cpu:
                    ops.scatter_pages(src.to(ids.device), chunk_ids, kv_caches, layout=self.layout)
                elif verify:
                    try:
                        ops.scatter_pages(src, chunk_ids, kv_caches, layout=self.layout, expect_checksum=checksum)
                    except ChecksumError as exc:
                        raise _checksum_error(what, meta.chunk_keys[i], ids, starts[i], exc.actual, checksum) from None
                else:
                    ops.scatter_pages(src, chunk_ids, kv_caches, layout=self.layout)
                del src
        finally:
            for obj in leased:
                obj.release()

    def _drop(self, meta: RequestMeta, keep_chunks: bool) -> None:
        """Remove the request's meta and its request-scoped chunks. Prefix-keyed chunks may be shared with
        concurrent requests of the same prompt prefix, so they are never removed here: they stay as prefix
        cache until their TTL (refreshed by every publish) or LRU eviction."""
        _quietly(self.store.remove, request_keys(meta.request_id)["meta"])
        if not keep_chunks:
            own = f"hf/{meta.request_id}/"
            for key in meta.chunk_keys:
                if key.startswith(own):
                    _quietly(self.store.remove, key)

    def _status(self, state: str, meta: RequestMeta | None, rid: str | None = None, ttl: float = 0.0) -> bytes:
        record = {"request_id": meta.request_id if meta else rid, "state": state, "updated": time.time(),
                  "created": meta.created if meta else time.time(), "bytes": meta.nbytes if meta else 0,
                  "chunks": len(meta.chunk_keys) if meta else 0, "num_tokens": meta.num_tokens if meta else 0,
                  "model_id": self.layout.model_id, "layout": self.layout.kind.value,
                  "fingerprint": self.layout.fingerprint(), "producer": meta.producer if meta else "",
                  "ttl": meta.ttl if meta else ttl}
        return msgpack.packb(record)

    def _block_tensor(self, block_ids: Any, kv_caches: Sequence[torch.Tensor]) -> torch.Tensor:
        if not kv_caches:
            raise ValueError("kv_caches is empty; expected one tensor per layer")
        return block_tensor(block_ids, kv_caches[0].device)  # integers only: TypeError names the dtype

    def _check_counts(self, num_tokens: int, num_blocks: int, token_ids) -> None:
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
            raise ValueError(f"num_tokens must be an int >= 1, got {num_tokens!r}")
        need = math.ceil(num_tokens / self.layout.block_size)
        if need != num_blocks:
            raise ValueError(f"{num_tokens} tokens need {need} blocks of {self.layout.block_size}, "
                             f"got {num_blocks} block ids")
        if token_ids is not None and len(token_ids) != num_tokens:
            raise ValueError(f"token_ids has {len(token_ids)} ids but num_tokens is {num_tokens}")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _check_request_id(request_id: object) -> str:
    if not isinstance(request_id, str) or not request_id or "/" in request_id or len(request_id) > 256:
        raise InvalidArgumentError(f"request_id must be a non-empty str of at most 256 chars without '/', "
                                   f"got {request_id!r}")
    return request_id


def _known(checksum: int | None) -> int:
    if checksum is None:  # only a stored prefix chunk has none until it is referenced
        raise InvalidArgumentError("a request-scoped chunk without a checksum")
    return checksum


def _token_hash(token_ids) -> str:
    if token_ids is None:
        return ""
    data = torch.as_tensor(list(token_ids), dtype=torch.int64).numpy().astype("<i8").tobytes()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _checksum_error(what: str, key: str, ids: torch.Tensor, start: int, actual: int,
                    expected: int) -> HandoffChecksumError:
    """The error for a bad chunk whose first block is ``ids[start]``: it and every later block are not loaded."""
    failed, loaded = tuple(ids[start:].tolist()), tuple(ids[:start].tolist())
    return HandoffChecksumError(
        f"{what}: chunk {key} has checksum {actual:#x}, the producer published {expected:#x}; blocks "
        f"{_short(failed)} are not loaded (recompute them)"
        + (f", blocks {_short(loaded)} were loaded and verified" if loaded else ""),
        key=key, failed_blocks=failed, loaded_blocks=loaded)


def _short(ids: tuple[int, ...]) -> str:
    return str(list(ids)) if len(ids) <= 16 else f"{list(ids[:16])} (+{len(ids) - 16} more)"


def _quietly(fn, key: str) -> None:
    try:
        fn(key)
    except (KeyNotFoundError, ObjectBusyError):
        pass  # already gone, or a reader still holds it: its TTL reclaims it
