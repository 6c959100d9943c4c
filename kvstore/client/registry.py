"""Store backends by name, resolved from module paths on first use.

The :class:`~kvstore.client.store.KVStore` ABC imports no backend: ``KVStore.embedded`` and
``kvstore.connect`` name one here and it is imported when first asked for, so a backend may live in any layer
above the client (the cluster's does) without an import cycle. ``register_backend`` adds one (a module path
and class name, like vLLM's connector factory), ``backend_for_url`` picks one by URL scheme.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvstore.errors import InvalidArgumentError

if TYPE_CHECKING:
    from kvstore.client.store import KVStore

_BACKENDS: dict[str, tuple[str, str]] = {
    "embedded": ("kvstore.client.embedded", "EmbeddedStore"),
    "remote": ("kvstore.client.remote", "RemoteStore"),
    "cluster": ("kvstore.cluster.store", "ClusterStore"),
}
#: URL scheme -> backend name.
_SCHEMES: dict[str, str] = {
    "unix": "remote", "tcp": "remote", "ucx": "remote",
    "kvcluster": "cluster", "kvclusters": "cluster", "kvcluster+sentinel": "cluster",
}


def register_backend(name: str, module: str, attr: str, *, schemes: tuple[str, ...] = ()) -> None:
    """Make ``name`` (and URLs with ``schemes``) resolve to ``module.attr``, a KVStore subclass."""
    if not name or not module or not attr:
        raise InvalidArgumentError(f"a backend needs a name, a module and a class, got {name!r}, {module!r}, {attr!r}")
    _BACKENDS[name] = (module, attr)
    for scheme in schemes:
        _SCHEMES[scheme] = name


def backend(name: str) -> Callable[..., KVStore]:
    """The backend class registered as ``name`` (imported now); its constructor's arguments are the backend's
    own (a capacity for ``embedded``, a URL and connection options for ``remote`` and ``cluster``)."""
    try:
        module, attr = _BACKENDS[name]
    except KeyError:
        raise InvalidArgumentError(f"unknown store backend {name!r}; known: {sorted(_BACKENDS)}") from None
    cls: Callable[..., KVStore] = getattr(importlib.import_module(module), attr)
    return cls


def backend_for_url(url: object) -> str:
    """The backend name for ``url``, by its scheme."""
    scheme = url.partition("://")[0] if isinstance(url, str) and "://" in url else None
    if scheme in _SCHEMES:
        return _SCHEMES[scheme]
    return "remote"  # the endpoint parser gives the precise error for anything malformed
