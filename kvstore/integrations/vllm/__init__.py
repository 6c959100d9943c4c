"""kvstore inside vLLM: ``KVStoreConnector``, loaded by vLLM from ``kv_connector_module_path``.

    KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.integrations.vllm",
                     kv_role="kv_both", kv_connector_extra_config={"url": "unix:///run/kvstore.sock"})

The connector (and vLLM) load on first attribute access, so ``kvstore.integrations.vllm.keys`` and
``.tiny_model`` import without vLLM. See ``docs/vllm.md``.
"""

from __future__ import annotations

_LAZY = {"KVStoreConnector": "kvstore.integrations.vllm.connector",
         "live_connectors": "kvstore.integrations.vllm.connector"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'kvstore.integrations.vllm' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


__all__ = list(_LAZY)
