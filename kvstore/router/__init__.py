"""``kvstore router``: an OpenAI-compatible front door for a fleet of vLLM servers — prefill and decode pools
with a verified hand-off through the store, colocated fallback, admission control (docs/router.md).

Needs the ``router`` extra (aiohttp)."""

from kvstore.router.config import AdmissionKind, RouterConfig

__all__ = ["AdmissionKind", "RouterConfig"]
