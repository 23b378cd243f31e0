"""JIT-build FlashInfer's kernels for the shapes the GPU check uses, so that the tests and benchmarks after it load
them instead of compiling (`bench/gpu_check.sh` runs this first, in the background, while other checks run).

`flashinfer-python` ships no compiled kernels: without its prebuilt `flashinfer-jit-cache` package (not
carried), each kernel module is compiled with nvcc and ninja on first use, minutes on one GPU host, and
cached under `$FLASHINFER_WORKSPACE_BASE` (`$MAX_JOBS` compiles at once). Each shape here runs one prefill and
one decode step through the `flashinfer` attention backend (bf16, head_dim 64; GQA groups 2, 3 and 4: the
tiny test Llama, SmolLM2 and the 1B Llama). It prints what the build needs first, then the time each shape
was ready at, and exits 1 with the traceback when a build fails.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
import traceback

from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: make `kernels.` importable

SHAPES = ((4, 2), (9, 3), (32, 8))  # (query heads, KV heads), head_dim 64
HEAD_DIM, SLOTS = 64, 256


def warm(num_heads: int, num_kv_heads: int, dtype: torch.dtype = torch.bfloat16) -> None:
    """One prefill step (two requests) and one decode step through the backend."""
    from ringserve.kernels.attention import ForwardInfo, create_backend

    k_pool = torch.zeros(1, SLOTS, num_kv_heads, HEAD_DIM, dtype=dtype, device="cuda")
    v_pool = torch.zeros_like(k_pool)
    backend = create_backend("flashinfer", k_pool, v_pool, num_heads)
    table = torch.arange(2 * 64, device="cuda").reshape(2, 64)
    rows = torch.tensor([0, 1], device="cuda")
    for q_lens, kv_lens in (([5, 3], [5, 3]), ([1, 1], [6, 4])):
        t = sum(q_lens)
        out_slots = torch.cat([table[r, k - q : k] for r, q, k in zip([0, 1], q_lens, kv_lens)])
        meta = backend.prepare(ForwardInfo(q_lens, kv_lens, rows, table, out_slots))
        q = torch.randn(t, num_heads, HEAD_DIM, dtype=dtype, device="cuda")
        kv = torch.randn(t, num_kv_heads, HEAD_DIM, dtype=dtype, device="cuda")
        backend.forward(q, kv, kv, 0, meta)
    torch.cuda.synchronize()


def environment() -> str:
    """One line: what the JIT build uses (a missing nvcc or ninja is the usual failure)."""
    names = ("CUDA_HOME", "FLASHINFER_CUDA_ARCH_LIST", "MAX_JOBS", "FLASHINFER_WORKSPACE_BASE")
    tools = " ".join(f"{tool}={shutil.which(tool) or 'MISSING'}" for tool in ("nvcc", "ninja", "c++"))
    return f"flashinfer warm-up: {tools} " + " ".join(f"{n}={os.environ.get(n, '')}" for n in names)


def main() -> int:
    """Warm every shape; 0 when all are built, 1 at the first failure."""
    print(environment(), flush=True)
    start = time.perf_counter()
    for heads in SHAPES:
        try:
            warm(*heads)
        except Exception:  # the log is all the GPU check gets back: say why in it
            traceback.print_exc()
            print(f"flashinfer warm-up: {heads} failed after {time.perf_counter() - start:.0f} s", flush=True)
            return 1
        print(f"flashinfer warm-up: {heads} ready after {time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
