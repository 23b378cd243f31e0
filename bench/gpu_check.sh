#!/usr/bin/env bash
# The GPU check on one offline CUDA machine, in at most $GPU_CHECK_SECONDS (default 470) by construction: the
# GPU tests and the decode benchmarks (bench/gpu_check.py), every phase under `timeout`, every log in $OUT as
# it is written. docs/gpu.md#the-gpu-check says what the host needs and what comes out.
#
#   1. Here (with network), once per checkout: fetch the wheels the device image lacks into .gpu/wheels
#      (git-ignored through .git/info/exclude; about 22 MB, under the device tool's 64 MiB transfer):
#        bash bench/gpu_check.sh fetch
#   2. On the GPU machine, with the device tool's `carry` option naming that folder:
#        run(command="bash bench/gpu_check.sh", carry=[".gpu"], timeout_s=540)
#      Everything lands in $OUT (bench/out/ without it), partial results included.
#
# Any machine with a GPU and network can skip step 1: pip install -e .[gpu,test] && bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
WHEELS=${GPU_WHEELS:-.gpu/wheels}
FLASHINFER_VERSION=${FLASHINFER_VERSION:-0.6.18.post1}
MAX_CARRY_MIB=60  # the device tool carries 64 MiB at most; keep a margin

if [ "${1:-}" = "fetch" ]; then
    # 0.7.x's wheel is about 101 MB, over one transfer: stay on 0.6.x.
    case "$FLASHINFER_VERSION" in
        0.6.*) ;;
        *) echo "fetch: flashinfer $FLASHINFER_VERSION is not 0.6.x" >&2; exit 1;;
    esac
    mkdir -p "$WHEELS"
    rm -f "$WHEELS"/*.whl  # a stale wheel of another version would be installed next to the pinned one
    [ -d .git/info ] && { grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude; }
    # The device machine runs CPython 3.12 on x86-64. flashinfer-python is pure Python (its kernels JIT-compile
    # there with nvcc); it imports pynvml (nvidia-ml-py) and apache-tvm-ffi, and builds with ninja; gguf reads
    # SmolLM2's GGUF. Its other requirements (cuda-python, cutlass-dsl, cudnn-frontend, ...) serve kernels the
    # engine does not use and are left out (--no-deps).
    "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$WHEELS" \
        "flashinfer-python==$FLASHINFER_VERSION" "apache-tvm-ffi==0.1.15.post2" "nvidia-ml-py==13.615.71" \
        "ninja==1.13.2" "gguf==0.19.0" || exit 1
    ls -la "$WHEELS"
    case "$WHEELS" in .gpu/*|./.gpu/*) CARRY=.gpu;; *) CARRY=$WHEELS;; esac  # what `carry` will take
    total=$(du -sb "$CARRY" | cut -f1)
    echo "fetch: $CARRY holds $((total / 1024)) KiB in all (limit $MAX_CARRY_MIB MiB)"
    if [ "$total" -gt $((MAX_CARRY_MIB * 1024 * 1024)) ]; then
        echo "fetch: $CARRY is over $MAX_CARRY_MIB MiB" >&2
        exit 1
    fi
    exit 0
fi

OUT=${OUT:-$ROOT/bench/out}
mkdir -p "$OUT"
rm -f "$OUT"/gpu_check.{json,jsonl,txt,log} "$OUT"/gpu_*tests.log "$OUT"/gpu_bench.log "$OUT"/flashinfer_warmup.log
exec > >(tee -a "$OUT/gpu_check.log") 2>&1  # the whole run's console, as it goes
START=$SECONDS
TOTAL=${GPU_CHECK_SECONDS:-470}
GRACE=10  # after `timeout`'s SIGINT (pytest prints its summary, python its traceback), SIGKILL this much later

# Phases in run order, with the seconds each is sure of. A phase may run until the deadline minus what the
# phases after it are sure of, so it also gets what the ones before it left unused, and the last ends by the
# deadline whatever happens before it. The caps are scaled down when they do not fit TOTAL.
PHASES=(setup core tests kernels flashinfer rest)
CAPS=(30 110 120 45 100 50)
NOMINAL=0; for c in "${CAPS[@]}"; do NOMINAL=$((NOMINAL + c)); done
if [ "$NOMINAL" -gt "$TOTAL" ]; then
    for i in "${!CAPS[@]}"; do CAPS[$i]=$((CAPS[i] * TOTAL / NOMINAL)); done
fi
SUM=0; for c in "${CAPS[@]}"; do SUM=$((SUM + c)); done
[ "$SUM" -le "$TOTAL" ] || { echo "gpu_check: phase caps add up to $SUM s, over $TOTAL s" >&2; exit 1; }
DEADLINE=$((START + TOTAL))
echo "gpu_check: $TOTAL s in all; phases ${PHASES[*]} sure of ${CAPS[*]} s (sum $SUM)"

# phase I: start phase number I; sets PHASE_END, the deadline minus the caps of the phases after it.
phase() {
    local later=0 j
    for ((j = $1 + 1; j < ${#CAPS[@]}; j++)); do later=$((later + CAPS[j])); done
    PHASE_END=$((DEADLINE - later))
    echo "== $(date +%T) phase ${PHASES[$1]}: $((PHASE_END - SECONDS)) s (t=$((SECONDS - START)) s)"
}
# seconds a command may still take in this phase, its kill grace left out (0 when there is none)
left() { local l=$((PHASE_END - SECONDS - GRACE)); [ "$l" -lt 0 ] && l=0; echo "$l"; }
# capped SECONDS CMD...: run CMD under timeout, or skip it when under 10 s are left
capped() {
    local s=$1; shift
    if [ "$s" -lt 10 ]; then echo "gpu_check: skipped (no time left): $*"; return 124; fi
    timeout -s INT -k "$GRACE" "$s" "$@"
}
# bench SECONDS ARGS...: bench/gpu_check.py with its own budget inside the cap
bench() {
    local s=$1; shift
    capped "$s" "$PY" bench/gpu_check.py --out "$OUT/gpu_check.json" --time-budget $((s > 15 ? s - 15 : 1)) \
        --pytest-log "$OUT/gpu_tests.log" --pytest-log "$OUT/gpu_kernel_tests.log" \
        --pytest-log "$OUT/gpu_flashinfer_tests.log" --append "$@" 2>&1 | tee -a "$OUT/gpu_bench.log"
}
stop_warmup() { [ -n "${WARM_PID:-}" ] && { kill -- -"$WARM_PID" 2>/dev/null || kill "$WARM_PID" 2>/dev/null; }; }
gpu_pytest() {  # gpu_pytest SECONDS LOG ARGS...: -v, so every finished test is in the log before a kill
    local s=$1 log=$2; shift 2
    capped "$s" "$PY" -m pytest -v -p no:cacheprovider -rfEs "$@" 2>&1 | tee "$log"
}

# 0. setup: the carried wheels, the environment, and FlashInfer's kernels compiling in the background (nvcc,
#    minutes) while the other phases run; two cores stay free so the measurements are not starved.
phase 0
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    capped "$(left)" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$WHEELS"/*.whl || echo "gpu_check: installing the wheels failed"
    export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH  # ninja's binary lands in bin/
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
[ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda ] && export CUDA_HOME=/usr/local/cuda
[ -n "${CUDA_HOME:-}" ] && export PATH=$PATH:$CUDA_HOME/bin
NPROC=$(nproc)
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-$((NPROC > 3 ? NPROC - 2 : 1))}
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer-cache}
WARM_PID=
if "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('flashinfer') is None)" 2>/dev/null; then
    # first, so it has the most time; its own process group (setsid keeps the pid), so that stopping it stops
    # its ninja and nvcc too
    $(command -v setsid) "$PY" bench/flashinfer_warmup.py > "$OUT/flashinfer_warmup.log" 2>&1 &
    WARM_PID=$!
    trap stop_warmup EXIT
    export GPU_CHECK_WARMUP_PID=$WARM_PID  # figures measured meanwhile say so
else
    echo "gpu_check: flashinfer is not installed; its phase is skipped"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -2
for tool in nvcc ninja c++; do echo "$tool: $(command -v "$tool" || echo none)"; done
capped "$(left)" "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda,
    torch.cuda.is_available(), 'triton', triton.__version__)"

# 1. core: greedy equality on SmolLM2, decode tok/s at batch 1 and 32, graphs off and on (one process each).
phase 1
bench "$(left)" --backends triton,torch,transformers --phases core

# 2. tests: all GPU tests but FlashInfer's (torch and triton vs transformers, graphs and the overlap loop).
phase 2
gpu_pytest "$(left)" "$OUT/gpu_tests.log" -m gpu tests/gpu -k "not flashinfer"

# 3. kernels: the Triton kernels compiled, and the graph runner with real capture.
phase 3
gpu_pytest "$(left)" "$OUT/gpu_kernel_tests.log" tests/kernels/test_kernels_triton.py tests/engine/test_decode_graph_runner.py

# 4. flashinfer: once its JIT is done (at most until 60 s before this phase ends), its core figures and tests.
phase 4
FI_OK=
if [ -n "$WARM_PID" ]; then
    w=$(($(left) - 60)); [ "$w" -gt 0 ] && timeout "$w" tail --pid="$WARM_PID" -f /dev/null
    if kill -0 "$WARM_PID" 2>/dev/null; then
        stop_warmup; echo "gpu_check: FlashInfer's JIT did not finish in time; its phases are skipped"
    elif wait "$WARM_PID"; then
        FI_OK=1
    else
        echo "gpu_check: FlashInfer's warm-up failed; its phases are skipped"
    fi
    cat "$OUT/flashinfer_warmup.log"
fi
if [ -n "$FI_OK" ]; then
    bench $(($(left) * 55 / 100)) --backends flashinfer --phases core
    gpu_pytest "$(left)" "$OUT/gpu_flashinfer_tests.log" -m gpu tests/gpu -k flashinfer
fi

# 5. rest: other batch sizes, the overlap loop off, the 1B Llama, then TP=2 (skipped on one GPU); whatever
#    time is left, shared by backend.
phase 5
bench "$(left)" --backends "triton${FI_OK:+,flashinfer},torch,transformers" --phases rest,tp
echo "gpu_check: $((SECONDS - START)) s of $TOTAL; results in $OUT (gpu_check.txt is the table)"
