"""The set of engine workers a router drives: separate processes, or inline in the router's own process.

Both pools speak the same small interface, so the router does not care which one it has. A process that
dies shows up as a ``lost`` message (the router re-routes its requests); nothing else is special-cased.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from multiprocessing.connection import wait as wait_any
from typing import Any, Protocol

import msgpack

from benchmarks.pd.channel import Channel, ChannelClosedError
from benchmarks.pd.worker import IDLE_WAIT_S, Worker, WorkerSpec, process_main

#: what the worker processes' parent (the forkserver) imports once, so that each worker does not
WORKER_PRELOAD = ("torch", "torch._dynamo", "kvstore.handoff", "benchmarks.pd.worker")


def _mp_context():
    """Workers fork from a forkserver that has imported torch and the store once, so a worker starts in well
    under a second instead of importing torch anew (seconds each on a busy 2-core machine). The forkserver
    holds no model, no tensors and no threads of ours; it starts on first use and ends with this process.
    Spawn where there is no forkserver."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(WORKER_PRELOAD))
    return ctx


class WorkerPool(Protocol):
    def start(self) -> list[dict]: ...  # build every worker; their ``ready`` infos in index order

    def begin(self, t0: float) -> None: ...  # the run's clock origin (time.monotonic())

    def send(self, index: int, op: str, **fields: Any) -> None: ...

    def pump(self, timeout: float) -> list[dict]: ...  # messages from workers, waiting at most ``timeout``

    def stop(self) -> list[dict]: ...  # every live worker's ``stats``; the pool is unusable afterwards

    def kill(self, index: int) -> None: ...  # SIGKILL one worker (fault injection); reported ``lost``

    def respawn(self, index: int) -> None: ...  # replace a lost worker; its ``ready`` arrives via pump

    def abort(self) -> None: ...  # tear everything down now, collecting nothing (after an error)


class ProcessPool:
    """One process per worker, each talking msgpack over its own pipe."""

    def __init__(self, specs: list[WorkerSpec], ready_timeout_s: float = 180.0):
        self.specs = specs
        self.ready_timeout_s = ready_timeout_s
        self.procs: dict[int, Any] = {}
        self.chans: dict[int, Channel] = {}
        self.ready: set[int] = set()  # built and warmed up (a replacement may still be starting)

    def start(self) -> list[dict]:
        for spec in self.specs:
            self._spawn(spec)
        return [self._await_ready(spec.index) for spec in self.specs]

    def _spawn(self, spec: WorkerSpec) -> None:
        ctx = _mp_context()
        parent, child = ctx.Pipe()
        frame = msgpack.packb(spec.to_wire(), use_bin_type=True)
        proc = ctx.Process(target=process_main, args=(frame, child), name=f"pd-worker-{spec.index}", daemon=True)
        proc.start()
        child.close()
        self.procs[spec.index], self.chans[spec.index] = proc, Channel(parent)

    def respawn(self, index: int) -> None:
        """Start a replacement for a worker that was reported ``lost``; its ``ready`` message (with the
        same ``worker`` index) comes through :meth:`pump` once it is built and warmed up."""
        if index in self.procs:
            raise ValueError(f"worker {index} is still running; only a lost worker can be respawned")
        self._spawn(self.specs[index])

    def _await_ready(self, index: int) -> dict:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.chans[index].poll(0.2):
                msg = self.chans[index].recv()
                if msg.pop("op") != "ready":
                    raise RuntimeError(f"worker {index} sent a message before 'ready'")
                msg.pop("v", None)
                self.ready.add(index)
                return msg
            if not self.procs[index].is_alive():
                raise RuntimeError(f"worker {index} exited with code {self.procs[index].exitcode} while starting")
        raise TimeoutError(f"worker {index} not ready after {self.ready_timeout_s} s")

    def begin(self, t0: float) -> None:
        for chan in self.chans.values():
            chan.send("start", t0=t0)

    def send(self, index: int, op: str, **fields: Any) -> None:
        self.chans[index].send(op, **fields)

    def pump(self, timeout: float) -> list[dict]:
        by_conn = {chan.conn: index for index, chan in self.chans.items()}
        out: list[dict] = []
        for conn in wait_any(list(by_conn), timeout=max(0.0, timeout)):
            index = by_conn[conn]
            try:
                while self.chans[index].poll(0):
                    out.append(self.chans[index].recv())
                    if out[-1]["op"] == "ready":
                        self.ready.add(index)
            except ChannelClosedError:
                out.append(self._lost(index))
        return out

    def kill(self, index: int) -> None:
        """SIGKILL one worker (fault injection); the next pump reports it ``lost``."""
        self.procs[index].kill()

    def _lost(self, index: int) -> dict:
        self.ready.discard(index)
        proc = self.procs.pop(index)
        self.chans.pop(index).close()
        proc.join(timeout=5)
        return {"op": "lost", "worker": index, "exitcode": proc.exitcode}

    def stop(self) -> list[dict]:
        stats = []
        for index, chan in list(self.chans.items()):
            if index not in self.ready:  # a replacement still starting: it has served nothing
                self.procs[index].kill()
                continue
            try:
                chan.send("stop")
                stats.append(self._await_stats(index))
            except (ChannelClosedError, TimeoutError):
                pass  # already gone; nothing to collect
        for proc in self.procs.values():
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        for chan in self.chans.values():
            chan.close()
        return stats

    def abort(self) -> None:
        for proc in self.procs.values():
            proc.kill()
            proc.join(timeout=5)
        for chan in self.chans.values():
            chan.close()
        self.procs.clear()
        self.chans.clear()

    def _await_stats(self, index: int, timeout_s: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.chans[index].poll(0.1):
                msg = self.chans[index].recv()
                if msg["op"] == "stats":
                    return msg
        raise TimeoutError(f"worker {index} sent no stats within {timeout_s} s")


class InlinePool:
    """Every worker in this process, stepped in turn; prefill and decode roles share one embedded store."""

    def __init__(self, specs: list[WorkerSpec], ports: dict[int, Any] | None = None):
        """``ports``: per worker index, a KV port replacing the store hand-off (tests, fault injection)."""
        self.specs = specs
        self.ports = ports or {}
        self.workers: list[Worker] = []
        self.store: Any = None

    def start(self) -> list[dict]:
        store_specs = [s.store for s in self.specs if s.store is not None and s.index not in self.ports]
        if store_specs:
            from benchmarks.pd.transfer import open_store

            self.store = open_store(store_specs[0])
        self.workers = [Worker(spec, store=self.store, port=self.ports.get(spec.index)) for spec in self.specs]
        return [w.ready_info() for w in self.workers]

    def begin(self, t0: float) -> None:
        for w in self.workers:
            w.start(t0)

    def send(self, index: int, op: str, **fields: Any) -> None:
        self.workers[index].handle({"op": op, **fields})

    def pump(self, timeout: float) -> list[dict]:
        busy = [w for w in self.workers if w.has_work()]
        if not busy:
            time.sleep(min(max(timeout, 0.0), IDLE_WAIT_S))
        return [msg for w in busy for msg in w.step()]

    def kill(self, index: int) -> None:
        raise NotImplementedError("fault injection needs worker processes (ProcessPool), not an inline pool")

    def respawn(self, index: int) -> None:
        raise NotImplementedError("an inline pool cannot lose, so cannot respawn, a worker")

    def stop(self) -> list[dict]:
        stats = [w.stats() for w in self.workers]
        self.abort()
        return stats

    def abort(self) -> None:
        for w in self.workers:
            w.close()
        self.workers = []
        if self.store is not None:
            self.store.close()
            self.store = None
