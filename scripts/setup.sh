#!/usr/bin/env bash
# Set up a fresh clone: torch (the local CPU wheel, pinned, installed first so that nothing later pulls a
# multi-GB CUDA build), the package with its extension (kvstore._C; kvstore._C_cuda too when nvcc is found),
# test and benchmark extras, and redis-server for the cluster tests. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q torch==2.13.0
fi
"$PY" -m pip install -q -e ".[test,fast,cluster,bench,ucx]"
if ! command -v redis-server >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1; then
        (apt-get update -qq && apt-get install -y -qq redis-server) >/dev/null
    else
        echo "setup: redis-server not found and apt-get unavailable; cluster tests will be skipped" >&2
    fi
fi
