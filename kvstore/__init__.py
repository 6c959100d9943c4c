"""kvstore: KV-cache transfer and storage for LLM serving.

``import kvstore`` is cheap: torch, the native extension and the daemon machinery load on first use.
"""

from __future__ import annotations

from kvstore.errors import *  # noqa: F401,F403  (the error hierarchy is part of the public API)
from kvstore.errors import __all__ as _error_names

__version__ = "0.1.0"

_LAZY = {
    "KVStore": ("kvstore.client.store", "KVStore"),
    "KVObject": ("kvstore.client.store", "KVObject"),
    "connect": ("kvstore.api", "connect"),
    "ObjectMeta": ("kvstore.core.meta", "ObjectMeta"),
    "KVLayout": ("kvstore.layout", "KVLayout"),
    "KVLayoutKind": ("kvstore.layout", "KVLayoutKind"),
    "ops": ("kvstore.ops", None),
}


def __getattr__(name: str):
    try:
        module_name, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'kvstore' has no attribute {name!r}") from None
    import importlib

    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


__all__ = list(_LAZY) + list(_error_names) + ["__version__"]
