"""GpuOps: the daemon-session side of the GPU data paths (a mixin of :class:`kvstore.daemon.session.Session`).

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
from typing import TYPE_CHECKING

from kvstore.core.master import Tier
from kvstore.core.meta import ObjectMeta
from kvstore.errors import InvalidArgumentError, KVStoreError, TransportError

if TYPE_CHECKING:
    from kvstore.core.master import Lease, Replica
    from kvstore.gpu.memory import GpuMemory

class GpuOps:
    """Session mixin. Expects ``ctx``, ``master``, ``segments``, ``client``, ``transport``, ``_ok`` and ``_send``."""

    _staging: dict[int, int] | None = None  # lease id -> put id of the host region staging a GPU object

    # ---- cuda_ipc ops -------------------------------------------------------------------------------
    async def op_cuda_segments(self, rid: int, f: dict) -> dict:
        return self._ok(rid, segments=self._gpu().describe())

    async def op_cuda_put(self, rid: int, f: dict) -> dict:
        self._gpu()  # before anything is reserved
        meta = ObjectMeta.from_wire(f["meta"])
        if meta.key != f["key"] or meta.size != f["size"]:
            raise InvalidArgumentError(f"put of {f['key']!r}: meta names key {meta.key!r} size {meta.size}, "
                                       f"request says size {f['size']}")
        if f["checksum"] is not None:
            meta = replace(meta, checksum=f["checksum"])
        replica = self.master.begin_put(meta, self.client, if_absent=f["if_absent"], pin=f["pin"],
                                               ephemeral=f["ephemeral"], tier=Tier.GPU)
        return self._ok(rid, put_id=replica.id, segment=replica.segment, offset=replica.offset, tier=Tier.GPU.value)

    async def op_cuda_get(self, rid: int, f: dict) -> dict:
        self._gpu()  # before the lease is taken
        master = self.master
        lease = master.lease(f["key"], self.client)
        r = lease.replica
        return self._ok(rid, meta=r.meta.to_wire(), segment=r.segment, offset=r.offset, size=r.size, lease=lease.id,
                        tier=master.tier_of(r).value)

    # ---- hooks for Session --------------------------------------------------------------------------
    def _on_gpu(self, replica: Replica) -> bool:
        return self.master.tier_of(replica) is Tier.GPU

    async def _staged_get(self, rid: int, f: dict, lease: Lease) -> dict | None:
        """Serve a get of a GPU-resident object through host memory (the lease is held; it is released here
        on failure and after a streamed reply, by the client after a region reply)."""
        replica = lease.replica
        try:
            if f["mode"] == "region":
                return await self._stage_region(rid, lease)
            data = memoryview(bytearray(replica.size))
            await self.ctx.gpu.copy_to_host(replica.segment, replica.offset, data)
        except BaseException:
            self._release_lease(lease.id)
            raise
        try:
            await self._send(self._ok(rid, meta=replica.meta.to_wire(), stream=replica.size), data)
        finally:
            self._release_lease(lease.id)
        return None

    async def _stage_region(self, rid: int, lease: Lease) -> dict:
        master, replica = self.master, lease.replica
        staging = master.begin_put(replica.meta, self.client, tier=Tier.HOST)
        try:
            region = self.segments[staging.segment].view(staging.offset, replica.size)
            await self.ctx.gpu.copy_to_host(replica.segment, replica.offset, region)
            region.release()
        except BaseException:
            self._abort_quietly(staging.id)
            raise
        if self._staging is None:
            self._staging = {}
        self._staging[lease.id] = staging.id
        return self._ok(rid, meta=replica.meta.to_wire(), segment=staging.segment, offset=staging.offset,
                        size=replica.size, lease=lease.id)

    def _drop_staging(self, lease_id: int) -> None:
        """The client released ``lease_id``: free the host region that staged it, if one did."""
        put_id = (self._staging or {}).pop(lease_id, None)
        if put_id is not None:
            self._abort_quietly(put_id)

    # ---- helpers ------------------------------------------------------------------------------------
    def _gpu(self) -> GpuMemory:
        if self.transport != "cuda_ipc":
            raise TransportError(f"cuda ops need the cuda_ipc transport; this connection uses {self.transport}")
        if self.ctx.gpu is None:
            raise TransportError("this daemon holds no GPU segments (start it with --gpu-capacity)")
        return self.ctx.gpu

    def _release_lease(self, lease_id: int) -> None:
        if self.client is None:
            return  # the session closed: the master released this client's leases already
        try:
            self.master.release(lease_id)
        except KVStoreError:
            pass

    def _abort_quietly(self, put_id: int) -> None:
        try:
            self.master.abort(put_id)
        except KVStoreError:
            pass  # revoked meanwhile (the client went away)
