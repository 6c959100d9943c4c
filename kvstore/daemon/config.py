"""ServerConfig: the options of ``kvstore serve``, checked once when the daemon is configured."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.core.quota import ClientQuota
from kvstore.daemon.limits import Limits
from kvstore.errors import InvalidArgumentError
from kvstore.memory.disk import DiskConfig
from kvstore.protocol import wire
from kvstore.protocol.url import Endpoint, default_socket_url

#: the smallest --max-frame: the largest fixed-size replies (a commit of 4,096 objects) still fit
MIN_MAX_FRAME = 256 << 10


@dataclass(frozen=True)
class ServerConfig:
    listen: tuple[str, ...] = field(default_factory=lambda: (default_socket_url(),))
    capacity: int = 1 << 30
    metrics_port: int | None = None
    token: str | None = None
    insecure: bool = False
    high_watermark: float = 0.9
    low_watermark: float = 0.8
    relocate: bool = True  # move unheld host objects to join free space before evicting (kvstore.core.relocation)
    heartbeat_timeout: float = 30.0
    grace: float = 10.0
    gpu_capacity: int = 0  # bytes of GPU segments (0: none)
    device: int | None = None  # the CUDA device holding them (default 0)
    # per-client limits (kvstore.core.quota); None: a share of the capacity
    max_pending_bytes: int | None = None  # default: half the capacity
    max_held_bytes: int | None = None  # default: three quarters of the capacity
    max_leases: int = 16384
    arena_bytes: int | None = None  # a same-host client's arena (default: min(64 MiB, capacity / 16))
    # connections and deadlines (kvstore.daemon.limits)
    max_connections: int = 1024
    max_connections_per_peer: int = 256
    auth_timeout: float = 5.0
    transfer_timeout: float = 30.0
    #: the largest frame a connection sends or takes (requests and replies): less memory per connection
    max_frame: int = wire.MAX_FRAME
    disk: DiskConfig | None = None  # the disk tier (--disk-path, --disk-capacity, --disk-policy)
    #: stop gracefully (as on SIGTERM) when this process exits (--exit-with): a daemon owned by a supervisor,
    #: a serving process or a test run never outlives its owner
    exit_with: int | None = None
    endpoints: tuple[Endpoint, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        if not self.listen:
            raise InvalidArgumentError("give at least one --listen address")
        endpoints = tuple(Endpoint.parse(url) for url in self.listen)
        if all(ep.scheme == "ucx" for ep in endpoints) or sum(ep.scheme == "ucx" for ep in endpoints) > 1:
            raise InvalidArgumentError("ucx:// is a data endpoint: give one at most, next to a unix:// or tcp:// "
                                       "--listen address for the control connection")
        for ep in endpoints:  # loopback is no boundary: every local user can connect to it
            if ep.scheme != "unix" and self.token is None and not self.insecure:
                kind = "" if ep.is_loopback() else "non-loopback "
                raise InvalidArgumentError(f"refusing to listen on {kind}{ep} without a token (--token-file): "
                                           "any local user could read and write every object; give "
                                           "--insecure to do it anyway")
        if self.capacity <= 0:
            raise InvalidArgumentError(f"capacity must be positive, got {self.capacity}")
        self._check_gpu()
        if self.exit_with is not None and (isinstance(self.exit_with, bool) or not isinstance(self.exit_with, int)
                                           or self.exit_with <= 0):
            raise InvalidArgumentError(f"--exit-with takes a process id > 0, got {self.exit_with!r}")
        if isinstance(self.max_frame, bool) or not isinstance(self.max_frame, int) \
                or not MIN_MAX_FRAME <= self.max_frame <= wire.MAX_FRAME:
            raise InvalidArgumentError(f"max frame must be between {MIN_MAX_FRAME} and {wire.MAX_FRAME} bytes, "
                                       f"got {self.max_frame!r}")
        if self.arena_bytes is not None and (isinstance(self.arena_bytes, bool) or not isinstance(self.arena_bytes, int)
                                             or not 0 < self.arena_bytes <= self.capacity):
            raise InvalidArgumentError(f"arena size must be between 1 byte and the capacity ({self.capacity}), "
                                       f"got {self.arena_bytes!r}")
        try:
            self.quota, self.limits  # noqa: B018 (validates them once, here)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
        object.__setattr__(self, "endpoints", endpoints)

    @property
    def quota(self) -> ClientQuota:
        return ClientQuota(max_pending_bytes=self.max_pending_bytes or max(1, self.capacity // 2),
                           max_held_bytes=self.max_held_bytes or max(1, self.capacity * 3 // 4),
                           max_leases=self.max_leases)

    @property
    def arena_size(self) -> int:
        """Bytes of one arena granted to a same-host client (kvstore.core.arena)."""
        return self.arena_bytes or max(4096, min(64 << 20, self.capacity // 16))

    @property
    def limits(self) -> Limits:
        return Limits(self.max_connections, self.max_connections_per_peer, self.auth_timeout, self.transfer_timeout)

    def _check_gpu(self) -> None:
        if isinstance(self.gpu_capacity, bool) or not isinstance(self.gpu_capacity, int) or self.gpu_capacity < 0:
            raise InvalidArgumentError(f"gpu capacity must be a size >= 0, got {self.gpu_capacity!r}")
        if self.device is None:
            return
        if isinstance(self.device, bool) or not isinstance(self.device, int) or self.device < 0:
            raise InvalidArgumentError(f"device must be a CUDA device number >= 0, got {self.device!r}")
        if not self.gpu_capacity:
            raise InvalidArgumentError(f"--device {self.device} picks the GPU of the GPU segments; give "
                                       "--gpu-capacity too")

    @property
    def control_endpoints(self) -> tuple[Endpoint, ...]:
        """The unix:// and tcp:// addresses (control connections); ucx:// is a data endpoint."""
        return tuple(ep for ep in self.endpoints if ep.scheme != "ucx")
