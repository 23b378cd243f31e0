#!/usr/bin/env bash
# Build llama.cpp's llama-server, the baseline of `bench/bench_serving.py --llama-server`, from the llama.cpp
# sources vendored in llama-cpp-python's sdist (the package registry is the only source this machine has).
# cmake and ninja come from PyPI into .venv. The binary lands in .bench/llama.cpp/build/bin/llama-server.
#
#   bash bench/build_llama_server.sh            # about 5-10 minutes on 2 cores; idempotent
#   LLAMA_CPP_PYTHON_VERSION=0.3.36 bash bench/build_llama_server.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
WORK=.bench/llama.cpp
BIN=$WORK/build/bin/llama-server
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi
mkdir -p "$WORK"
.venv/bin/python -m pip install --quiet --disable-pip-version-check cmake ninja
if [ ! -d "$WORK/src" ]; then
  .venv/bin/python -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
    "llama-cpp-python==$VERSION" -d "$WORK"
  tar -xzf "$WORK/llama_cpp_python-$VERSION.tar.gz" -C "$WORK"
  mv "$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp" "$WORK/src"
  rm -rf "$WORK/llama_cpp_python-$VERSION"
fi
# GGML_NATIVE: built for this host's CPU, as a user would build it for theirs; no curl (no network here).
PATH="$PWD/.venv/bin:$PATH" cmake -S "$WORK/src" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DBUILD_SHARED_LIBS=OFF > "$WORK/cmake.log"
PATH="$PWD/.venv/bin:$PATH" cmake --build "$WORK/build" --target llama-server -j "${JOBS:-2}" > "$WORK/build.log"
echo "$BIN"
