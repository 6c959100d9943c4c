"""``--inject-fault decode-crash@T`` on the vLLM fleet: a decode-capable instance SIGKILLed ``T`` s into a run.

The victim: disaggregated, the decode instance (``kv_consumer``); colocated / chunked, the instance with the
most requests outstanding (ties: the highest index). The router learns of the death from the process's
pipe (its ``exit`` event), starts a replacement with the same spec, and:

- colocated / chunked: re-sends the victim's requests to the live instance at once (``recomputed``: their
  prompts are prefilled again); new requests go to the live instances until the replacement is ready.
- disaggregated: holds the victim's requests and every later hand-off until the replacement consumer is
  ready, then sends them (``refetched``: the producer's blocks are still in the store, so the new consumer
  loads them instead of the prompt being prefilled again).

Definitions of the summary's ``fault`` block are fault.py's (:func:`benchmarks.pd.fault.recovery_report`).
"""

from __future__ import annotations

import os
import signal

from benchmarks.pd.fault import FaultLog, FaultSpec


class FaultInjector:
    """Kills at ``spec.at_s``; then routes around the dead instance until its replacement is ready."""

    def __init__(self, spec: FaultSpec, serving):
        self.log = FaultLog(spec)
        self.serving = serving
        self.dead: int | None = None  # index of the instance being replaced
        self.held: list[str] = []  # disaggregated: hand-offs waiting for the replacement consumer

    def due(self, now: float) -> bool:
        return not self.log.injected and now >= self.log.spec.at_s

    def kill(self, now: float) -> None:
        s = self.serving
        if s.disagg:
            victim = 1
        else:
            victim = max(range(len(s.on)), key=lambda i: (len(s.on[i]), i))
        self.log.victim, self.log.killed_at_s = victim, now
        self.dead = victim  # nothing more is sent to it
        os.kill(s.fleet.instances[victim].proc.pid, signal.SIGKILL)

    def usable(self, index: int) -> bool:
        return index != self.dead

    def on_exit(self, index: int, now: float) -> bool:
        """The exit of instance ``index``; True when it is the injected fault (handled), else False."""
        if index != self.log.victim or self.log.detected_at_s is not None:
            return False
        s = self.serving
        self.log.detected_at_s = now
        s.fleet.respawn(index)
        lost = sorted(s.on[index])
        self.log.interrupted = lost
        s.on[index].clear()
        s.outstanding[index] = 0
        for rid in lost:
            rec = s.records[rid]
            if s.disagg:
                rec.refetch(f"decode instance {index} killed")
                self.log.refetched.append(rid)
                self.held.append(rid)
            else:
                rec.restart(f"instance {index} killed")
                self.log.recomputed.append(rid)
                s.dispatch(rid)
        return True

    def hold(self, rid: str) -> bool:
        """Disaggregated: keep a hand-off back while the consumer is being replaced."""
        if self.dead == 1 and self.serving.disagg:
            self.held.append(rid)
            return True
        return False

    def on_ready(self, index: int, now: float) -> None:
        self.log.replacement_ready_at_s, self.dead = now, None
        s = self.serving
        for rid in self.held:
            s.send_decode(rid)
        self.held = []
