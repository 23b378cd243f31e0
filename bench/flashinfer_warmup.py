"""JIT-build FlashInfer's kernels for the shapes the GPU check uses, so the tests and benchmarks that follow
load them instead of compiling (`bench/gpu_check.sh` runs this in the background while other tests run).

Builds happen on first use and are cached under `$FLASHINFER_WORKSPACE_BASE`; each shape here runs one
prefill and one decode step through the `flashinfer` attention backend (bf16, head_dim 64; GQA groups 2, 3
and 4: the tiny test Llama, SmolLM2 and the 1B Llama).
"""

from __future__ import annotations

import sys
import time

import torch

SHAPES = ((4, 2), (9, 3), (32, 8))  # (query heads, KV heads), head_dim 64
HEAD_DIM, SLOTS = 64, 256


def warm(num_heads: int, num_kv_heads: int, dtype: torch.dtype = torch.bfloat16) -> None:
    """One prefill step (two requests) and one decode step through the backend."""
    from kernels.attention import ForwardInfo, create_backend

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


def main() -> int:
    start = time.perf_counter()
    for heads in SHAPES:
        warm(*heads)
        print(f"flashinfer warm-up: {heads} ready after {time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
