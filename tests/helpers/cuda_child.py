"""A second process for the GPU data-path tests: puts or reads one object with device memory.

Usage: cuda_child.py MODE URL KEY SIZE BACKEND TRANSPORT

  put   put SIZE bytes of the key-derived pattern from device memory under KEY; print DONE <transport>
  get   get_into device memory, compare with the pattern; print MATCH <transport> or MISMATCH <transport>

BACKEND: ``cuda`` (torch CUDA tensors on device 0) or ``fake`` (DeviceBuffers over host memory, with the fake
runtime of fake_cuda.py).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from client_child import pattern  # noqa: E402

import kvstore  # noqa: E402
from kvstore.memory.device import DeviceBuffer  # noqa: E402


def device_array(data: np.ndarray, backend: str):
    """(value to hand to the store, function returning its bytes)"""
    if backend == "cuda":
        import torch

        t = torch.from_numpy(data).to("cuda:0")
        return t, lambda: t.cpu().numpy().tobytes()
    import fake_cuda

    return DeviceBuffer(data.ctypes.data, data.nbytes, 0, 0, fake_cuda, owner=data), data.tobytes


def main() -> int:
    mode, url, key, size, backend, transport = sys.argv[1:7]
    size = int(size)
    expected = pattern(key, size)
    with kvstore.connect(url, transport=transport) as store:
        if mode == "put":
            value, _ = device_array(np.frombuffer(expected, np.uint8).copy(), backend)
            store.put(key, value)
            print("DONE", store.transport, flush=True)
            return 0
        out, read = device_array(np.zeros(size, np.uint8), backend)
        n = store.get_into(key, out)
        print("MATCH" if n == size and read() == expected else "MISMATCH", store.transport, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
