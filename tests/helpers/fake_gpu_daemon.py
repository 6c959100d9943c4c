"""``kvstore serve`` with the fake CUDA runtime of fake_cuda.py (for GPU-path tests on machines without a GPU).

Usage: fake_gpu_daemon.py SERVE-ARGS...   (the arguments of ``kvstore serve``)
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fake_cuda  # noqa: E402

import kvstore.gpu.runtime  # noqa: E402

kvstore.gpu.runtime._native = fake_cuda

from kvstore.cli.main import main  # noqa: E402

sys.exit(main(["serve", *sys.argv[1:]]))
