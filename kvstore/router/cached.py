"""How much of a prompt the store already holds: the router's ``batch_exists`` of the prompt's block keys.

The keys are the connector's (:func:`kvstore.integrations.vllm.keys.prompt_block_keys`): the chained digest of
the token ids under an instance's layout fingerprint. The router learns the fingerprints (and block sizes) the
store's blocks were saved under from the model's layout index, which every connector worker publishes
(``vllm/layouts/<model digest>/<fingerprint>``, the layout as the object's meta; the model is the instance's
``/v1/models`` ``root``). A prompt's hit is its leading run of held blocks — what a decode instance loads —
under the best of the model's fingerprints of TP rank 0.

Every store call runs on one thread with one connection of its own (a slow or dead daemon never blocks the
event loop); an error is a miss (None), and the connection is opened again on the next call.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvstore.errors import KVStoreError
from kvstore.integrations.vllm.keys import model_layouts_prefix, prompt_block_keys

log = logging.getLogger("kvstore.router")
#: The daemon's limit on one batch_exists.
MAX_KEYS = 4096


@dataclass(frozen=True, slots=True)
class StoredLayout:
    fingerprint: str
    block_size: int


class StoreIndex:
    def __init__(self, url: str, timeout_s: float):
        self.url, self.timeout_s = url, timeout_s
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvstore-router-store")
        self._store = None
        #: model root -> the layouts its blocks are stored under (refreshed with the health checks)
        self.layouts: dict[str, tuple[StoredLayout, ...]] = {}

    async def refresh(self, roots: set[str]) -> None:
        """Read the layout index of every model in ``roots`` (errors leave the previous answer)."""
        if roots:
            await asyncio.get_running_loop().run_in_executor(self._pool, self._refresh, sorted(roots))

    async def held_tokens(self, root: str | None, token_ids: list[int], cache_salt: str = "") -> int | None:
        """Tokens of the prompt's leading blocks the store holds (0: none); None when that is not known (no
        layout of the model in the store yet, or the store did not answer)."""
        layouts = self.layouts.get(root or "")
        if not layouts:
            return None
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._held, layouts, token_ids,
                                                                 cache_salt)

    def close(self) -> None:
        self._pool.submit(self._drop)
        self._pool.shutdown(wait=True)

    # -- on the store thread -------------------------------------------------------------------------------
    def _client(self):
        if self._store is None:
            from kvstore.api import connect

            self._store = connect(self.url, timeout=self.timeout_s, transport="tcp", client_name="kvstore-router")
        return self._store

    def _drop(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            try:
                store.close()
            except (KVStoreError, OSError):
                pass

    def _refresh(self, roots: list[str]) -> None:
        try:
            store = self._client()
            for root in roots:
                prefix = model_layouts_prefix(root)
                found = []
                for key in store.keys(prefix):
                    meta = store.inspect(key).get("meta") or {}
                    size = meta.get("block_size")
                    if meta.get("tp_rank", 0) == 0 and isinstance(size, int) and size > 0:
                        found.append(StoredLayout(key[len(prefix):], size))
                if tuple(found) != self.layouts.get(root, ()):
                    log.info("store layouts of %s: %s", root, ", ".join(f"{x.fingerprint} (block {x.block_size})"
                                                                     for x in found) or "none")
                self.layouts[root] = tuple(found)
        except (KVStoreError, OSError, ValueError) as exc:
            log.debug("store layout index not read: %s", exc)
            self._drop()

    def _held(self, layouts: tuple[StoredLayout, ...], token_ids: list[int], cache_salt: str) -> int | None:
        best = 0
        try:
            store = self._client()
            for layout in layouts:
                keys = prompt_block_keys(token_ids, layout.fingerprint, layout.block_size, cache_salt=cache_salt)
                present: list[bool] = []
                for start in range(0, len(keys), MAX_KEYS):
                    present += store.batch_exists(keys[start:start + MAX_KEYS])
                run = next((i for i, p in enumerate(present) if not p), len(present))
                best = max(best, run * layout.block_size)
        except (KVStoreError, OSError, ValueError) as exc:
            log.debug("store lookup failed (a miss): %s", exc)
            self._drop()
            return None
        return best
