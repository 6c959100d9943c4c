"""Instances and pools: who serves a hop, what each one owes, who is ejected.

A :class:`Pool` holds the instances of one role (prefill, decode, colocated). The router sends a hop to the
live instance with the fewest outstanding tokens (prompt + output it has been sent and not yet finished);
consecutive failures — of requests or of health checks — eject an instance, and the next passing health check
readmits it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum


class Role(Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"


@dataclass(slots=True)
class Load:
    """One request's share of an instance's work, as the router predicts it."""

    prompt_tokens: int
    max_tokens: int
    interactive: bool = True


@dataclass(slots=True, eq=False)
class Instance:
    url: str
    role: Role
    healthy: bool = True
    failures: int = 0  # consecutive
    ejections: int = 0
    #: What the router has sent and not heard the end of: prefill (prompt not computed yet) and decode loads.
    prefilling: dict[str, Load] = field(default_factory=dict)
    decoding: dict[str, Load] = field(default_factory=dict)
    #: The model names it serves and its context length, from /v1/models.
    models: tuple[str, ...] = ()
    cards: list = field(default_factory=list)
    max_model_len: int | None = None
    checked_at: float = 0.0

    def outstanding_tokens(self) -> int:
        owed = sum(x.prompt_tokens + x.max_tokens for x in self.prefilling.values())
        return owed + sum(x.max_tokens for x in self.decoding.values())


class Pool:
    def __init__(self, role: Role, urls: Iterable[str], eject_after: int = 2):
        self.role = role
        self.instances = [Instance(u, role) for u in urls]
        self.eject_after = eject_after

    def __bool__(self) -> bool:
        return bool(self.instances)

    def live(self) -> list[Instance]:
        return [i for i in self.instances if i.healthy]

    def pick(self, exclude: Iterable[Instance] = ()) -> Instance | None:
        """The live instance with the fewest outstanding tokens (ties: the first listed), or None."""
        skip = set(map(id, exclude))
        live = [i for i in self.live() if id(i) not in skip]
        return min(live, key=lambda i: i.outstanding_tokens()) if live else None

    def failed(self, inst: Instance) -> bool:
        """Count a failure of ``inst``; True when it is ejected by it."""
        inst.failures += 1
        if inst.healthy and inst.failures >= self.eject_after:
            inst.healthy, inst.ejections = False, inst.ejections + 1
            return True
        return False

    def succeeded(self, inst: Instance) -> None:
        inst.failures = 0

    def checked(self, inst: Instance, ok: bool) -> None:
        """A health check's result: a pass readmits (and clears the count), a failure counts as one."""
        first, inst.checked_at = not inst.checked_at, time.monotonic()
        if first and not ok:  # never seen up: not admitted until a check passes
            inst.healthy = False
        elif ok:
            inst.healthy, inst.failures = True, 0
        else:
            self.failed(inst)
