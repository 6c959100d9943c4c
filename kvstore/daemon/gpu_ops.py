"""GpuOps: the daemon-session side of the GPU data paths (a handler object that a
:class:`~kvstore.daemon.session.Session` owns).

* ``cuda_segments``, ``cuda_put``, ``cuda_get``: the ops of the ``cuda_ipc`` transport (see
  :mod:`kvstore.transports.cuda_ipc`). ``cuda_put`` reserves space in the GPU tier; the client copies into it through
  CUDA IPC, waits for its copy, then commits with the ordinary ``commit`` / ``commit_many``, so the object
  becomes visible only with all its bytes in place. ``cuda_get`` leases the object wherever it lives and says
  which tier; the client releases the lease once its copy has completed.
* Staging: a ``get`` of a GPU-resident object on a path that cannot map GPU memory. With ``mode="region"``
  (shm clients, host buffers on cuda_ipc) the daemon reserves a host region (an uncommitted put of this client,
  never visible), copies the object into it and answers with that region; the client's release of the lease
  frees it, and so does the client going away. On the stream paths (tcp, ucx, inline) the bytes are copied to
  a buffer and sent after the reply.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kvstore.core.master import Tier
from kvstore.core.meta import ObjectMeta
from kvstore.daemon.context import client_of
from kvstore.errors import InvalidArgumentError, KVStoreError, TransportError
from kvstore.protocol.wire import ok_reply

if TYPE_CHECKING:
    from kvstore.core.master import Lease, Replica
    from kvstore.daemon.context import SessionContext
    from kvstore.daemon.session import Handler
    from kvstore.gpu.memory import GpuMemory


class GpuOps:
    """``cuda_segments``, ``cuda_put``, ``cuda_get``, and the staging of GPU-resident objects for the session's
    ``get`` / ``release``."""

    def __init__(self, session: SessionContext):
        self.s = session
        self._staging: dict[int, int] = {}  # lease id -> put id of the host region staging a GPU object

    def handlers(self) -> dict[str, Handler]:
        return {"cuda_segments": self.op_cuda_segments, "cuda_put": self.op_cuda_put, "cuda_get": self.op_cuda_get}

    # ---- cuda_ipc ops -------------------------------------------------------------------------------
    async def op_cuda_segments(self, rid: int, f: dict[str, Any]) -> dict[str, Any]:
        return ok_reply(rid, segments=self.require_gpu().describe())

    async def op_cuda_put(self, rid: int, f: dict[str, Any]) -> dict[str, Any]:
        self.require_gpu()  # before anything is reserved
        meta = ObjectMeta.from_wire(f["meta"])
        if meta.key != f["key"] or meta.size != f["size"]:
            raise InvalidArgumentError(f"put of {f['key']!r}: meta names key {meta.key!r} size {meta.size}, "
                                       f"request says size {f['size']}")
        if f["checksum"] is not None:
            meta = replace(meta, checksum=f["checksum"])
        replica = self.s.master.begin_put(meta, client_of(self.s), if_absent=f["if_absent"], pin=f["pin"],
                                          ephemeral=f["ephemeral"], tier=Tier.GPU)
        return ok_reply(rid, put_id=replica.id, segment=replica.segment, offset=replica.offset, tier=Tier.GPU.value)

    async def op_cuda_get(self, rid: int, f: dict[str, Any]) -> dict[str, Any]:
        self.require_gpu()  # before the lease is taken
        master = self.s.master
        lease = master.lease(f["key"], client_of(self.s))
        r = lease.replica
        return ok_reply(rid, meta=r.meta.to_wire(), segment=r.segment, offset=r.offset, size=r.size, lease=lease.id,
                        tier=master.tier_of(r).value)

    # ---- hooks for the session's get and release ------------------------------------------------------
    def on_gpu(self, replica: Replica) -> bool:
        return self.s.master.tier_of(replica) is Tier.GPU

    async def staged_get(self, rid: int, f: dict[str, Any], lease: Lease) -> dict[str, Any] | None:
        """Serve a get of a GPU-resident object through host memory (the lease is held; it is released here
        on failure and after a streamed reply, by the client after a region reply)."""
        replica = lease.replica
        try:
            if f["mode"] == "region":
                return await self._stage_region(rid, lease)
            data = memoryview(bytearray(replica.size))
            await self._gpu_memory().copy_to_host(replica.segment, replica.offset, data)
        except BaseException:
            self._release_lease(lease.id)
            raise
        try:
            await self.s.conn.send(ok_reply(rid, meta=replica.meta.to_wire(), stream=replica.size), data)
        finally:
            self._release_lease(lease.id)
        return None

    async def _stage_region(self, rid: int, lease: Lease) -> dict[str, Any]:
        master, replica = self.s.master, lease.replica
        staging = master.begin_put(replica.meta, client_of(self.s), tier=Tier.HOST)
        try:
            region = self.s.segments[staging.segment].view(staging.offset, replica.size)
            await self._gpu_memory().copy_to_host(replica.segment, replica.offset, region)
            region.release()
        except BaseException:
            self._abort_quietly(staging.id)
            raise
        self._staging[lease.id] = staging.id
        return ok_reply(rid, meta=replica.meta.to_wire(), segment=staging.segment, offset=staging.offset,
                        size=replica.size, lease=lease.id)

    def drop_staging(self, lease_id: int) -> None:
        """The client released ``lease_id``: free the host region that staged it, if one did."""
        put_id = self._staging.pop(lease_id, None)
        if put_id is not None:
            self._abort_quietly(put_id)

    # ---- helpers ------------------------------------------------------------------------------------
    def require_gpu(self) -> GpuMemory:
        """The daemon's GPU memory; TransportError unless this connection is cuda_ipc and the daemon has some."""
        if self.s.transport != "cuda_ipc":
            raise TransportError(f"cuda ops need the cuda_ipc transport; this connection uses {self.s.transport}")
        return self._gpu_memory()

    def _gpu_memory(self) -> GpuMemory:
        gpu = self.s.ctx.gpu
        if gpu is None:
            raise TransportError("this daemon holds no GPU segments (start it with --gpu-capacity)")
        return gpu

    def _release_lease(self, lease_id: int) -> None:
        if self.s.client is None:
            return  # the session closed: the master released this client's leases already
        try:
            self.s.master.release(lease_id)
        except KVStoreError:
            pass

    def _abort_quietly(self, put_id: int) -> None:
        try:
            self.s.master.abort(put_id)
        except KVStoreError:
            pass  # revoked meanwhile (the client went away)
