"""The segmented LoRA op (`ringserve::lora_shrink_expand`, kernels/lora.py) against the dense masked formula
`y + ((x @ A^T) * mask) @ B^T`, which computes every slot for every token and keeps a token's own slot by its
mask: the C++ kernel (AVX-512 and AVX2 paths, float32 and bfloat16), the Triton kernel (under Triton's
interpreter on CPU, natively on a GPU) and the torch reference. Batches mix base-model tokens and several slots,
adapters of ranks below the slots' rank, and fused q/k/v parts (an adapter on some parts only). A bfloat16
engine runs an adapter end to end.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ringserve.kernels import cpu  # noqa: E402
from ringserve.kernels.lora import lora_shrink_expand, reference_lora_shrink_expand  # noqa: E402

QKV = [24, 8, 8]  # fused q/k/v output rows


def weights(parts: list[int], k: int, slots: int, rank: int, dtype: torch.dtype,
            seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A `[P*S*R, k]` and B^T `[P*S*R, out]` laid out as LoraLinear stores them: slot s of rank `rank - s`
    (smaller ranks zero-padded), B^T non-zero only in its part's columns, the last slot's adapter on part 0 only."""
    g = torch.Generator().manual_seed(seed)
    width, out = len(parts) * slots * rank, sum(parts)
    a, b_t = torch.zeros(width, k), torch.zeros(width, out)
    for p, rows in enumerate(parts):
        for s in range(slots):
            if s == slots - 1 and p > 0 and slots > 1:
                continue
            r, start, col = max(1, rank - s), (p * slots + s) * rank, sum(parts[:p])
            a[start:start + r] = torch.randn(r, k, generator=g)
            b_t[start:start + r, col:col + rows] = torch.randn(r, rows, generator=g) / 4
    return a.to(dtype), b_t.to(dtype)


def dense(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor, ids: torch.Tensor, slots: int,
          rank: int, parts: int) -> torch.Tensor:
    """The dense masked formula in float64: all slots for every token, a token's own kept by the mask."""
    t = x.shape[0]
    mask = torch.zeros(t, slots * rank, dtype=torch.float64)
    for i, s in enumerate(ids[:t].tolist()):
        if s >= 0:
            mask[i, s * rank:(s + 1) * rank] = 1
    low = (x.double() @ a.double().T).view(t, parts, slots * rank) * mask[:, None, :]
    return y.double() + low.reshape(t, -1) @ b_t.double()


def batch(tokens: int, k: int, parts: list[int], slots: int, dtype: torch.dtype, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g).to(dtype)
    y = torch.randn(tokens, sum(parts), generator=g).to(dtype)
    ids = torch.randint(-1, slots, (tokens + 5,), generator=g)  # longer than the batch, as a graph's buffer is
    ids[:3] = torch.tensor([-1, 0, slots - 1])[:min(3, tokens)]
    return x, y, ids


SHAPES = [  # tokens, in, fused parts, slots, rank
    (11, 40, QKV, 3, 8),
    (70, 96, [64, 32, 32], 4, 16),  # enough work to split across threads
    (9, 33, [19], 2, 5),  # no whole vector of outputs, a tail of the input
    (6, 64, [48, 48], 1, 4),
]
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def check(run, dtype: torch.dtype, shape: tuple) -> None:
    tokens, k, parts, slots, rank = shape
    a, b_t = weights(parts, k, slots, rank, dtype)
    x, y, ids = batch(tokens, k, parts, slots, dtype)
    expected = dense(y, x, a, b_t, ids, slots, rank, len(parts))
    out = y.clone()
    run(out, x, a, b_t, ids, slots, rank, parts)
    scale = expected.abs().max().item()
    assert (out.double() - expected).abs().max().item() <= TOL[dtype] * scale
    base = (ids[:tokens] == -1).nonzero().squeeze(1)
    assert base.numel() > 0 and torch.equal(out[base], y[base]), "base-model rows are left as they are"


def isas() -> list[str]:
    if not cpu.compiled():
        return []
    return ["avx2"] if cpu.best_isa() == "avx2" else ["avx512vnni", "avx2"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_cpu_kernel_matches_the_dense_formula(dtype: torch.dtype, shape: tuple) -> None:
    if not cpu.compiled():
        pytest.skip("the CPU kernels are not built here (the reference runs instead; tested below)")
    try:
        for isa in isas():
            cpu.set_isa(isa)
            check(lora_shrink_expand, dtype, shape)
    finally:
        cpu.set_isa(cpu.best_isa())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_torch_reference_matches_the_dense_formula(dtype: torch.dtype) -> None:
    for shape in SHAPES:
        check(reference_lora_shrink_expand, dtype, shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_kernel_matches_the_dense_formula(dtype: torch.dtype) -> None:
    pytest.importorskip("triton", reason="triton is not installed (it comes with the test extra)")
    from ringserve.kernels.triton.lora_bgmv import lora_bgmv

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    kernel = lora_shrink_expand if device.type == "cuda" else lora_bgmv  # on a GPU through the op's dispatch

    def run(y, x, a, b_t, ids, slots, rank, parts) -> None:
        moved = [v.to(device) for v in (y, x, a, b_t, ids)]
        kernel(*moved, slots, rank, parts)
        y.copy_(moved[0].cpu())

    for shape in [(7, 40, QKV, 3, 8), (5, 33, [19], 2, 5)]:  # small: the interpreter runs every program in Python
        check(run, dtype, shape)


def test_a_slot_outside_the_pool_is_refused() -> None:
    a, b_t = weights(QKV, 40, 3, 8, torch.float32)
    x, y, ids = batch(4, 40, QKV, 3, torch.float32)
    ids[1] = 3
    with pytest.raises(RuntimeError, match="slot 3 of token 1 outside"):
        lora_shrink_expand(y, x, a, b_t, ids, 3, 8, QKV)


def test_the_op_traces_into_a_graph_that_reads_each_steps_slots() -> None:
    """Compiled with the op's fake (aot_eager: traced, functionalized, run), the slot buffer refilled in place
    between calls as the runner does: each call computes that step's slots."""
    a, b_t = weights(QKV, 40, 3, 8, torch.float32)
    x, y, ids = batch(6, 40, QKV, 3, torch.float32)
    buffer = ids.clone()

    def step(y0: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        out = y0 * 1  # a fresh tensor, as a base linear's output is
        lora_shrink_expand(out, x0, a, b_t, buffer, 3, 8, QKV)
        return out

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for mix in ([0, 1, 2, -1, 0, 2], [2, -1, -1, 1, 1, 0]):
        buffer[:6] = torch.tensor(mix)
        expected = dense(y, x, a, b_t, buffer, 3, 8, 3)
        assert torch.allclose(compiled(y, x).double(), expected, atol=1e-4)


def test_a_bfloat16_engine_runs_an_adapter_beside_the_base(tmp_path: Path) -> None:
    """End to end in bfloat16 (the op's bfloat16 path in every projection): a batch of an adapter's row and a
    base row gives PEFT's and the base model's greedy tokens (up to bfloat16's near-ties)."""
    from tests.engine_helpers import (assert_greedy_matches, engine_for, hf_greedy, run_to_completion,
                                      tiny_hf_llama, tokens_of)
    from tests.models.test_lora import N, PROMPTS, make_adapter, request

    hf = tiny_hf_llama()
    peft_model = make_adapter(hf, tmp_path / "a", seed=1)
    engine = engine_for(hf, lora_modules=f"a={tmp_path / 'a'}", dtype="bfloat16", disable_cuda_graph=True)
    rows = run_to_completion(engine, [request("bf16-a", PROMPTS[0], "a"), request("bf16-base", PROMPTS[0])])
    for model, rid in ((peft_model, "bf16-a"), (hf, "bf16-base")):
        assert_greedy_matches(model, PROMPTS[0], hf_greedy(model, PROMPTS[0], N, None), tokens_of(rows[rid]), tol=0.1)
    assert hf_greedy(peft_model, PROMPTS[0], N, None) != hf_greedy(hf, PROMPTS[0], N, None)
