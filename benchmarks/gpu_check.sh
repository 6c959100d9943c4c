#!/usr/bin/env bash
# GPU machine check (offline, <= 8 min on one H200; each check has its own time cap): build the CUDA extension
# for sm_90, run the CUDA tests, then measure, each against its physical baseline in the same run:
#   bench_pages        gather/scatter of paged KV (vLLM 0.32 HNC pages)  vs  a device-to-device copy
#   bench_cuda_ipc     put/get_into of CUDA tensors: D2H/H2D through the daemon's registered shared memory
#                      vs cudaMemcpy pinned<->device; cuda_ipc (client -> daemon process) vs a raw D2D copy
#   bench_block_io     the vLLM connector's block I/O on synthetic vLLM-shaped CUDA caches (no vLLM needed)
#                      vs cudaMemcpy of the same bytes
#   bench_handoff_cuda publish/fetch of CUDA caches through the hand-off
# and print one table, a line per check. Needs only what travels with the tree (the machine's python3 with
# torch, pybind11, setuptools, msgpack, xxhash, numpy, prometheus_client, pytest).
#
#   bash benchmarks/gpu_check.sh             # on the GPU machine
#   bash benchmarks/gpu_check.sh --dry-run   # here, without a GPU: the same plumbing, GPU parts skipped (said so)
#
# Logs go to results/gpu_check (or $LOG_DIR); with $OUT set (the device tool) the table and one archive of
# every log land in $OUT (the tool returns at most 8 files). Adding a check: one more `run_check NAME CAP_S
# COMMAND...` line below. A check passes when its command exits 0 (a GPU check skipped in a dry run shows
# "skip"); its output goes to $LOG_DIR/NAME.log; a command may write one headline line to "$SUMMARY".
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
# The caps budget the GPU machine (16 cores); a dry run on a small shared CPU machine gets CAP_SCALE times more.
CAP_SCALE=${CAP_SCALE:-$([ "$DRY" = 1 ] && echo 6 || echo 1)}
PY=${PYTHON:-python3}
LOG_DIR=${LOG_DIR:-results/gpu_check}
rm -rf "$LOG_DIR" && mkdir -p "$LOG_DIR"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
NAMES=() STATUSES=() SECONDS_TAKEN=() SUMMARIES=()
START=$SECONDS

run_check() {  # run_check NAME CAP_SECONDS COMMAND... ; records status, time and the optional one-line summary
    local name=$1 cap=$(($2 * CAP_SCALE))
    shift 2
    export SUMMARY="$LOG_DIR/$name.summary"
    rm -f "$SUMMARY"
    local start=$SECONDS status=ok rc=0
    # a child bash runs the (exported) check function, so that `timeout` can stop it and all it started
    timeout --kill-after=10 "$cap" bash -c '"$@"' "$name" "$@" >"$LOG_DIR/$name.log" 2>&1 || rc=$?
    if [ "$rc" = 77 ]; then
        status=skip
    elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        status=TIME
        echo "over its ${cap}s cap" >>"$SUMMARY"
    elif [ "$rc" != 0 ]; then
        status=FAIL
    fi
    if [ "$status" = FAIL ] || [ "$status" = TIME ]; then
        echo "---- $name: $status; last lines of $LOG_DIR/$name.log:" >&2
        tail -n 25 "$LOG_DIR/$name.log" >&2
    fi
    NAMES+=("$name")
    STATUSES+=("$status")
    SECONDS_TAKEN+=("$((SECONDS - start))")
    SUMMARIES+=("$(head -n 1 "$SUMMARY" 2>/dev/null || true)")
}

gpu_only() {  # in a dry run: say why the check is skipped, exit 77 (shown as "skip")
    if [ "$DRY" = 1 ]; then
        echo "dry run: needs a CUDA GPU, skipped" | tee "$SUMMARY"
        exit 77
    fi
}

print_table() {
    local failed=0 i
    printf '\n%-20s %-6s %7s  %s\n' check status seconds result
    printf '%s\n' "-------------------------------------------------------------------------------------------"
    for i in "${!NAMES[@]}"; do
        printf '%-20s %-6s %7s  %s\n' "${NAMES[$i]}" "${STATUSES[$i]}" "${SECONDS_TAKEN[$i]}" "${SUMMARIES[$i]}"
        case "${STATUSES[$i]}" in ok | skip) ;; *) failed=1 ;; esac
    done
    echo "total $((SECONDS - START)) s$([ "$DRY" = 1 ] && echo ', dry run (no GPU)'); logs: $LOG_DIR"
    return "$failed"
}

# -- checks -----------------------------------------------------------------------------------------------------
machine_info() {
    "$PY" -c "import msgpack, xxhash, numpy, prometheus_client, pybind11, pytest, torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
    command -v nvcc >/dev/null && nvcc --version | tail -n 2
    if [ "$DRY" = 1 ]; then
        echo "dry run on $(lscpu | sed -n 's/^Model name: *//p' | head -n 1); nvcc $(nvcc --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/\1/p')" >"$SUMMARY"
        return 0
    fi
    nvidia-smi
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -n 1 >"$SUMMARY"
}

build_cuda() {  # sm_90 (+ its PTX); no network: setuptools and pybind11 come from the machine's Python
    if [ "$DRY" = 1 ]; then  # compile only, into the log folder: nothing of the tree changes, nothing can run
        KVSTORE_CUDA=1 KVSTORE_CUDA_ARCHS=90 "$PY" setup.py build_ext --force --build-lib "$LOG_DIR/build/lib" \
            --build-temp "$LOG_DIR/build/tmp" || return 1
        ls "$LOG_DIR"/build/lib/kvstore/_C_cuda*.so >"$SUMMARY" && echo "compiled for sm_90 (not run: no GPU)" >"$SUMMARY"
        return 0
    fi
    rm -rf build
    KVSTORE_CUDA=1 KVSTORE_CUDA_ARCHS="${KVSTORE_CUDA_ARCHS:-90}" "$PY" setup.py build_ext --inplace || return 1
    "$PY" -c "import kvstore._C_cuda as c; print('sm_90 build,', c.sm_count(0), 'SMs')" | tee "$SUMMARY"
}

cuda_tests() {  # kernels vs the reference on CUDA, the device block I/O (fake runtime and real CUDA caches)
    local tests=(tests/unit/test_ops_cuda.py tests/integration/vllm/test_block_io_device.py)
    [ "$DRY" = 1 ] || tests+=(tests/unit/test_ops.py)
    "$PY" -m pytest -q -p no:cacheprovider "${tests[@]}" -x || return 1
    tail -n 1 "$LOG_DIR/cuda_tests.log" >"$SUMMARY"
}

cuda_ipc_tests() {  # real daemons: cuda_ipc between processes, GPU segments, device<->host through shared memory
    local select=()
    [ "$DRY" = 1 ] && select=(-k "fake_cuda_ipc_roundtrip")  # the fake-GPU daemon path only
    "$PY" -m pytest -q -p no:cacheprovider tests/integration/gpu/test_cuda_ipc.py -x "${select[@]}" || return 1
    tail -n 1 "$LOG_DIR/cuda_ipc_tests.log" >"$SUMMARY"
}

bench_pages() {  # gather/scatter vs a device-to-device copy of the same bytes
    local dev=cuda extra=(--blocks 16,256,2048 --iters 20)
    [ "$DRY" = 1 ] && dev=cpu extra=(--blocks 1,16 --iters 3 --layers 4)
    "$PY" -m benchmarks.bench_pages --device "$dev" --kind vllm_hnc "${extra[@]}" --json "$LOG_DIR/bench_pages.json" \
        || return 1
    "$PY" - "$LOG_DIR/bench_pages.json" >"$SUMMARY" <<'EOF'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
big = max(r["blocks"] for r in rows)
print("; ".join(f"{r['op']} {r['blocks']} blk: {r['op_gbps']:.0f} GB/s, {r['vs_memcpy']:.2f}x copy"
                for r in rows if r["blocks"] == big))
EOF
}

bench_cuda_ipc() {  # D2H/H2D through registered shm vs cudaMemcpy pinned<->device; cuda_ipc vs a raw D2D copy
    gpu_only
    "$PY" -m benchmarks.bench_cuda_ipc --sizes 1MiB,16MiB,256MiB --json "$LOG_DIR/bench_cuda_ipc.json" \
        --summary "$SUMMARY"
}

bench_block_io() {  # the connector's block I/O on vLLM-shaped caches vs one cudaMemcpy (memcpy on CPU)
    local extra=(--device cuda --blocks 16,64,256 --iters 10 --capacity 4GiB)
    [ "$DRY" = 1 ] && extra=(--device cpu --blocks 4,16 --iters 3 --layers 4 --capacity 256MiB)
    "$PY" -m benchmarks.bench_block_io --layout LBNHC --paths daemon-shm "${extra[@]}" \
        --json "$LOG_DIR/bench_block_io.json" --summary "$SUMMARY"
}

bench_handoff_cuda() {  # publish/fetch of CUDA caches: device gather, one D2H copy into the segment; the reverse
    gpu_only
    "$PY" -m benchmarks.bench_handoff --device cuda --blocks 1,16,64 --layouts llama --paths embedded,daemon-shm \
        --iters 10 --no-mooncake --json "$LOG_DIR/bench_handoff_cuda.json" || return 1
    "$PY" - "$LOG_DIR/bench_handoff_cuda.json" >"$SUMMARY" <<'EOF'
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["rows"] if r["blocks"] == 64 and r["op"] in ("publish", "fetch")]
print("; ".join(f"{r['path']} {r['op']} 64 blk: {r['gbps']:.1f} GB/s, {r['x_memcpy']:.2f}x host memcpy"
                for r in rows))
EOF
}

export DRY PY LOG_DIR
export -f gpu_only machine_info build_cuda cuda_tests cuda_ipc_tests bench_pages bench_cuda_ipc bench_block_io \
    bench_handoff_cuda
# caps add up to 480 s (8 min); the checks usually take far less
run_check machine_info 20 machine_info
run_check build_cuda 120 build_cuda
run_check cuda_tests 90 cuda_tests
run_check cuda_ipc_tests 75 cuda_ipc_tests
run_check bench_pages 45 bench_pages
run_check bench_cuda_ipc 45 bench_cuda_ipc
run_check bench_block_io 45 bench_block_io
run_check bench_handoff_cuda 40 bench_handoff_cuda

print_table | tee "$LOG_DIR/table.txt"
status=${PIPESTATUS[0]}
if [ -n "${OUT:-}" ]; then  # the device tool returns at most 8 files: the table and one archive
    cp "$LOG_DIR/table.txt" "$OUT/gpu_check_table.txt"
    tar czf "$OUT/gpu_check_logs.tgz" --exclude=build -C "$LOG_DIR" .
fi
exit "$status"
