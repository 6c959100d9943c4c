"""RequestTransfers: the KV bytes and seconds the connector moved for each request (a worker half's view).

The worker counts every load and save under the request it belongs to (the loader thread's and the saver
thread's too), so a caller can attribute transfers to requests exactly, whatever step they landed in:
``KVStoreConnector.request_transfers(req_id)`` pops one request's record. Records are kept for at most
``MAX_REQUESTS`` requests (the least recently updated go first), so nobody reading them costs bounded memory.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass

#: records kept at most (a request's is dropped once this many others were updated after it)
MAX_REQUESTS = 4096


@dataclass(slots=True)
class RequestTransfer:
    load_bytes: int = 0
    load_seconds: float = 0.0
    loaded_blocks: int = 0
    save_bytes: int = 0             # landed in the store
    save_seconds: float = 0.0
    saved_blocks: int = 0
    save_pending_bytes: int = 0     # queued or being written (not yet landed, not dropped)

    def add(self, other: RequestTransfer) -> None:
        for name, value in asdict(other).items():
            setattr(self, name, getattr(self, name) + value)

    def as_dict(self) -> dict[str, int | float]:
        return asdict(self)


class RequestTransfers:
    def __init__(self, max_requests: int = MAX_REQUESTS):
        self.max_requests = max_requests
        self._lock = threading.Lock()
        self._records: OrderedDict[str, RequestTransfer] = OrderedDict()

    def add(self, req_id: str, **deltas: float) -> None:
        with self._lock:
            record = self._records.get(req_id)
            if record is None:
                record = self._records[req_id] = RequestTransfer()
                while len(self._records) > self.max_requests:
                    self._records.popitem(last=False)
            else:
                self._records.move_to_end(req_id)
            for name, value in deltas.items():
                setattr(record, name, getattr(record, name) + value)

    def get(self, req_id: str) -> RequestTransfer | None:
        with self._lock:
            record = self._records.get(req_id)
            return None if record is None else RequestTransfer(**record.as_dict())

    def pop(self, req_id: str) -> RequestTransfer | None:
        with self._lock:
            return self._records.pop(req_id, None)

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._records)

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)
