"""Mixture-of-experts on a GPU as two grouped GEMMs over stacked expert weights (the "fused MoE" shape of
SGLang and vLLM), and the pure-torch reference it must match.

`align_by_expert` sorts a step's (token, slot) pairs by expert and pads each expert's segment to a whole number
of `block_m`-row blocks, so every block belongs to one expert. `grouped_gemm` then runs one launch over all
blocks: a program multiplies its block's rows (gathered from the activations by pair) by its expert's weight.
`fused_experts` is gate_up GEMM -> act(gate) * up -> down GEMM (scaled by the routing weight) -> the `k` slots
of each token summed. Nothing here reads a tensor's value on the host, so a step can be captured in a CUDA graph:
buffers are sized for the worst case of the shapes, and blocks past the used ones carry expert -1 and exit.

An expert id below 0 drops that pair (its slot contributes nothing): expert parallelism maps the experts held by
other ranks to -1. `triton` is optional; without it (or on CPU without the interpreter) `fused_experts` runs
`reference_fused_experts`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ringserve.kernels.activations import ACTIVATIONS
from ringserve.kernels.triton import dot_precision, interpreter_enabled, next_power_of_2

try:
    import triton
    import triton.language as tl
except ImportError:  # the base install has no triton: fused_experts falls back to the reference
    triton = None



def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs of `ids` `[T, k]` grouped by expert in blocks of `block_m` rows.

    Returns `sorted_token_ids` int32 `[num_blocks * block_m]`: flat pair indices (`token * k + slot`) sorted by
    expert (stable, so ascending within an expert), each expert's segment padded to a multiple of `block_m` with
    the sentinel `T * k`, and the tail past the used blocks all sentinel; `expert_of_block` int32 `[num_blocks]`:
    each block's expert, -1 for the unused tail; `num_tokens_padded` int32 `[1]`: the used length (a tensor, so
    no host sync). `num_blocks` is the worst case for the shape, `(T*k + min(E, T*k) * (block_m - 1)) // block_m`.
    Pairs whose id is negative are left out.
    """
    flat = ids.reshape(-1)
    n, device = flat.numel(), flat.device
    key = torch.where(flat >= 0, flat, num_experts)  # dropped pairs go to an extra bin, sorted last
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device).scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    first = torch.cumsum(counts, 0) - counts  # each bin's first position in the sorted pairs
    order = torch.argsort(key, stable=True)
    expert = key[order]
    valid = expert < num_experts
    num_blocks = (n + min(num_experts, n) * (block_m - 1)) // block_m
    capacity = num_blocks * block_m
    rank = torch.arange(n, device=device) - first[expert]  # the pair's position within its expert
    expert_start = (padded_end - padded)[expert.clamp(max=num_experts - 1)]
    dest = torch.where(valid, expert_start + rank, capacity)  # dropped pairs land in a spare slot, cut off below
    sorted_ids = torch.full((capacity + 1,), n, dtype=torch.int32, device=device)
    sorted_ids[dest] = order.to(torch.int32)
    blocks = torch.arange(num_blocks, device=device)
    # a block's expert: the first whose padded segment ends past the block's first row (empty experts skipped)
    block_expert = torch.searchsorted(padded_end // block_m, blocks, right=True)
    expert_of_block = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_ids[:capacity], expert_of_block, padded_end[-1:].to(torch.int32)


if triton is not None:

    @triton.jit
    def _grouped_gemm_kernel(A, W, Out, SortedIds, ExpertOfBlock, RouteWeights, num_pairs, N, K,
                             stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om, stride_on,
                             A_ROW_DIV: tl.constexpr, WEIGHTED: tl.constexpr, UPCAST: tl.constexpr,
                             DOT_PREC: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.load(ExpertOfBlock + pid_m)
        if expert < 0:  # past the used blocks
            return
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pairs = tl.load(SortedIds + rows)
        valid = pairs < num_pairs  # padding rows carry the sentinel
        a_rows = (pairs // A_ROW_DIV).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = A + a_rows[:, None] * stride_am + ks[None, :] * stride_ak
        w_ptrs = W + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn + ks[:, None] * stride_wk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = ks + k0 < K
            a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & (cols[None, :] < N), other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc += tl.dot(a, w, input_precision=DOT_PREC)
            a_ptrs += BLOCK_K * stride_ak
            w_ptrs += BLOCK_K * stride_wk
        if WEIGHTED:
            acc *= tl.load(RouteWeights + pairs, mask=valid, other=0.0)[:, None]
        out_ptrs = Out + pairs.to(tl.int64)[:, None] * stride_om + cols[None, :] * stride_on
        tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < N))


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, sorted_ids: torch.Tensor,
                 expert_of_block: torch.Tensor, block_m: int, a_row_div: int,
                 route_weights: torch.Tensor | None = None) -> torch.Tensor:
    """`out[p] = a[p // a_row_div] @ w[expert of p]^T` (times `route_weights[p]` if given) for every pair `p` in
    `sorted_ids`; rows of `out` for pairs not listed are left as they are.

    `a` `[*, K]`, `w` `[E, N, K]` stacked, `out` `[T*k, N]`; `sorted_ids` and `expert_of_block` from
    `align_by_expert` with the same `block_m`; `route_weights` float32 `[T*k]` flat. Accumulates in float32.
    """
    _, n, k = w.shape
    block_n = min(64, max(16, next_power_of_2(n)))
    block_k = min(64, max(16, next_power_of_2(k)))
    grid = (expert_of_block.numel(), triton.cdiv(n, block_n))
    weighted = route_weights is not None
    # the interpreter's tl.dot multiplies bfloat16 operands wrongly (their raw bits); float32 operands give the
    # same exact products, accumulated in float32 as on the GPU
    upcast = interpreter_enabled() and a.dtype == torch.bfloat16
    _grouped_gemm_kernel[grid](
        a, w, out, sorted_ids, expert_of_block, route_weights if weighted else out, out.shape[0], n, k,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        A_ROW_DIV=a_row_div, WEIGHTED=weighted, UPCAST=upcast,
        DOT_PREC=dot_precision(torch.float32 if upcast else a.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def _block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per block: about the mean rows per expert, 16 (tl.dot's minimum) to 64."""
    return min(64, max(16, next_power_of_2(-(-num_pairs // num_experts))))


def fused_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor,
                  w_down: torch.Tensor, activation: str) -> torch.Tensor:
    """The routed experts' weighted sum per token: `sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`, an expert
    being `down(act(gate(x)) * up(x))` with `w_gate_up` `[E, 2I, C]` (gate rows first, HF's fused layout) and
    `w_down` `[E, C, I]`.

    `x` `[T, C]` float32/bf16/fp16, `ids` `[T, k]` int64 (negative: dropped), `weights` `[T, k]` float32.
    The gate_up output is rounded to `x`'s dtype as an `nn.Linear` would; the weighted expert outputs are
    summed in float32 and rounded once. Runs the reference where triton is missing or `x` is on CPU without
    the interpreter.
    """
    if triton is None or (x.device.type != "cuda" and not interpreter_enabled()):
        return reference_fused_experts(x, ids, weights, w_gate_up, w_down, activation)
    act = ACTIVATIONS[activation]
    tokens, top_k = ids.shape
    if tokens == 0:
        return torch.zeros_like(x)
    num_experts, inner = w_gate_up.shape[0], w_down.shape[2]
    pairs = tokens * top_k
    block_m = _block_m(pairs, num_experts)
    sorted_ids, expert_of_block, _ = align_by_expert(ids, num_experts, block_m)
    x = x if x.stride(-1) == 1 else x.contiguous()
    gate_up = torch.empty(pairs, 2 * inner, dtype=x.dtype, device=x.device)
    grouped_gemm(x, w_gate_up, gate_up, sorted_ids, expert_of_block, block_m, a_row_div=top_k)
    hidden = act(gate_up[:, :inner]) * gate_up[:, inner:]
    down = torch.zeros(pairs, w_down.shape[1], dtype=torch.float32, device=x.device)  # dropped pairs stay 0
    grouped_gemm(hidden, w_down, down, sorted_ids, expert_of_block, block_m, a_row_div=1,
                 route_weights=weights.reshape(-1).float().contiguous())
    return down.view(tokens, top_k, -1).sum(dim=1).to(x.dtype)


def reference_fused_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor,
                            w_down: torch.Tensor, activation: str) -> torch.Tensor:
    """`fused_experts` in torch, one expert at a time in expert order, with the rounding of
    `SparseMoE.routed` (each expert's output times its weight in `x`'s dtype, index-added into the output)."""
    act = ACTIVATIONS[activation]
    top_k, inner = ids.shape[1], w_down.shape[2]
    flat, flat_weights = ids.reshape(-1), weights.reshape(-1, 1)
    out = torch.zeros_like(x)
    for expert in range(w_gate_up.shape[0]):
        picks = torch.nonzero(flat == expert).flatten()
        if picks.numel() == 0:
            continue
        rows = picks // top_k
        gate_up = F.linear(x[rows], w_gate_up[expert])
        y = F.linear(act(gate_up[:, :inner]) * gate_up[:, inner:], w_down[expert])
        out.index_add_(0, rows, y * flat_weights[picks].to(x.dtype))
    return out
