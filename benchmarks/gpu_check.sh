#!/usr/bin/env bash
# GPU machine check (offline, < 5 min on one H200): build the CUDA extension, run the CUDA tests, run the
# kernel benchmark, run the GPU data-path tests (cuda_ipc between processes, GPU segments, device<->host
# through shared memory) and their benchmark, then print one table with a line per check.
#
#   bash benchmarks/gpu_check.sh            # logs and JSON go to $OUT if set (device tool), else ./results/gpu_check
#
# Adding a check: write one more `run_check NAME COMMAND...` line below (before `print_table`). A check
# passes when its command exits 0; its output goes to $LOG_DIR/NAME.log. To put a headline figure into the
# table, have the command write one line to "$SUMMARY" (a file path exported to every check).
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
LOG_DIR=${OUT:-results/gpu_check}
mkdir -p "$LOG_DIR"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
NAMES=() STATUSES=() SECONDS_TAKEN=() SUMMARIES=()

run_check() {  # run_check NAME COMMAND... ; records status, time and the optional one-line summary
    local name=$1
    shift
    export SUMMARY="$LOG_DIR/$name.summary"
    rm -f "$SUMMARY"
    local start=$SECONDS status=ok
    if ! "$@" >"$LOG_DIR/$name.log" 2>&1; then
        status=FAIL
        echo "---- $name failed; last lines of $LOG_DIR/$name.log:" >&2
        tail -n 25 "$LOG_DIR/$name.log" >&2
    fi
    NAMES+=("$name")
    STATUSES+=("$status")
    SECONDS_TAKEN+=("$((SECONDS - start))")
    SUMMARIES+=("$(head -n 1 "$SUMMARY" 2>/dev/null || true)")
}

print_table() {
    local failed=0 i
    printf '\n%-22s %-6s %7s  %s\n' check status seconds result
    printf '%s\n' "-------------------------------------------------------------------------------------------"
    for i in "${!NAMES[@]}"; do
        printf '%-22s %-6s %7s  %s\n' "${NAMES[$i]}" "${STATUSES[$i]}" "${SECONDS_TAKEN[$i]}" "${SUMMARIES[$i]}"
        [ "${STATUSES[$i]}" = ok ] || failed=1
    done
    echo "logs: $LOG_DIR"
    return "$failed"
}

# -- checks -----------------------------------------------------------------------------------------------------
gpu_info() {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -n 1 >"$SUMMARY"
    nvidia-smi
    "$PY" -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))"
}

build_cuda() {  # in place, no network: setuptools and pybind11 come from the machine's Python
    rm -rf build
    KVSTORE_CUDA=1 KVSTORE_CUDA_ARCHS="${KVSTORE_CUDA_ARCHS:-80;90}" "$PY" setup.py build_ext --inplace || return 1
    "$PY" -c "import kvstore._C_cuda as c; print('sm_count', c.sm_count(0))" | tee "$SUMMARY"
}

cuda_tests() {
    # --noconftest: these suites need no fixtures, so a conftest written for the daemon tests cannot break them
    "$PY" -m pytest -q -p no:cacheprovider --noconftest tests/unit/test_ops_cuda.py tests/unit/test_ops.py -x || return 1
    tail -n 1 "$LOG_DIR/cuda_tests.log" >"$SUMMARY" 2>/dev/null || true
}

bench_pages_cuda() {
    "$PY" -m benchmarks.bench_pages --device cuda --json "$LOG_DIR/bench_pages_cuda.json" || return 1
    "$PY" - "$LOG_DIR/bench_pages_cuda.json" >"$SUMMARY" <<'EOF'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
big = max(r["blocks"] for r in rows)
print("; ".join(f"{r['op']} {r['blocks']} blk: {r['op_gbps']:.0f} GB/s op, {r['kernel_gbps']:.0f} kernel, "
                f"{r['vs_memcpy']:.2f}x D2D, {r['vs_torch']:.1f}x torch" for r in rows if r["blocks"] == big))
EOF
}

cuda_ipc_tests() {  # needs the conftest: these tests start real daemons
    "$PY" -m pytest -q -p no:cacheprovider tests/integration/gpu/test_cuda_ipc.py -x || return 1
    tail -n 1 "$LOG_DIR/cuda_ipc_tests.log" >"$SUMMARY" 2>/dev/null || true
}

bench_cuda_ipc() {  # store put/get_into of CUDA tensors vs a raw copy: cuda_ipc vs D2D, shm vs pinned D2H/H2D
    "$PY" -m benchmarks.bench_cuda_ipc --json "$LOG_DIR/bench_cuda_ipc.json" --summary "$SUMMARY"
}

bench_handoff_cuda() {  # publish/fetch of CUDA caches: device gather, one D2H copy into the segment; the reverse
    "$PY" -m benchmarks.bench_handoff --device cuda --blocks 1,16,64 --layouts llama --paths embedded,daemon-shm \
        --iters 10 --json "$LOG_DIR/bench_handoff_cuda.json" || return 1
    "$PY" - "$LOG_DIR/bench_handoff_cuda.json" >"$SUMMARY" <<'EOF'
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["rows"] if r["blocks"] == 64 and r["op"] in ("publish", "fetch")]
print("; ".join(f"{r['path']} {r['op']} 64 blk: {r['gbps']:.1f} GB/s, {r['x_memcpy']:.2f}x host memcpy"
                for r in rows))
EOF
}

run_check gpu_info gpu_info
run_check build_cuda build_cuda
run_check cuda_tests cuda_tests
run_check bench_pages_cuda bench_pages_cuda
run_check cuda_ipc_tests cuda_ipc_tests
run_check bench_cuda_ipc bench_cuda_ipc
run_check bench_handoff_cuda bench_handoff_cuda
# (append transport and store checks here)

print_table  # the benchmark's full table is in $LOG_DIR/bench_pages_cuda.log, its rows in bench_pages_cuda.json
