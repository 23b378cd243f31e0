"""The grouped-GEMM mixture-of-experts path (kernels/triton/moe_gemm.py) against its per-expert torch reference
and against the model's own `GatedMLP` experts: on CPU under Triton's interpreter, on a GPU natively.

`TRITON_INTERPRET=1` is set before anything imports `triton` unless CUDA is available, as in
tests/kernels/test_kernels_triton.py; shapes are small so the interpreter stays fast.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed (it comes with the test extra: pip install -e .[test])")

from ringserve.kernels.triton.moe_gemm import align_by_expert, fused_experts, reference_fused_experts  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
E, K, C, I = 8, 2, 64, 32


def routing(tokens: int, used: int = E, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ids (distinct per token, only among the first `used` experts) and softmax weights."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(tokens, E, generator=g)
    scores[:, used:] = float("-inf")  # experts past `used` get no rows
    weights, ids = torch.topk(scores.softmax(dim=-1), K, dim=-1)
    return weights, ids


def expert_weights(dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w_gate_up = torch.randn(E, 2 * I, C, generator=g) * C**-0.5
    w_down = torch.randn(E, C, I, generator=g) * I**-0.5
    return w_gate_up.to(dtype), w_down.to(dtype)


def on_device(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEVICE) for t in tensors]


@pytest.mark.parametrize("tokens,used", [(1, E), (5, E), (33, 5)])  # (33, 5): experts 5-7 have no rows
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
def test_fused_experts_matches_reference_float32(tokens: int, used: int, activation: str) -> None:
    weights, ids = routing(tokens, used)
    x = torch.randn(tokens, C, generator=torch.Generator().manual_seed(2))
    w_gate_up, w_down = expert_weights(torch.float32)
    expected = reference_fused_experts(x, ids, weights, w_gate_up, w_down, activation)
    got = fused_experts(*on_device(x, ids, weights, w_gate_up, w_down), activation)
    assert got.dtype == torch.float32 and got.shape == (tokens, C)
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_experts_matches_reference_half(dtype: torch.dtype) -> None:
    weights, ids = routing(9)
    x = torch.randn(9, C, generator=torch.Generator().manual_seed(3)).to(dtype)
    w_gate_up, w_down = expert_weights(dtype)
    expected = reference_fused_experts(x.float(), ids, weights, w_gate_up.float(), w_down.float(), "silu")
    got = fused_experts(*on_device(x, ids, weights, w_gate_up, w_down), "silu")
    assert got.dtype == dtype
    # the interpreter rounds float32 to bfloat16 by truncation (the GPU rounds to nearest)
    torch.testing.assert_close(got.cpu().float(), expected, atol=3e-2, rtol=3e-2)


def test_fused_experts_matches_a_models_routed_experts() -> None:
    """Stacking a real `SparseMoE` layer's experts (tiny Qwen2-MoE) gives its `routed` output, on the ids and
    weights its own router picks: the call `SparseMoE.routed` makes on a GPU."""
    from ringserve.actors.engine.models.moe import SparseMoE
    from ringserve.actors.engine.models.weights import model_from_hf
    from tests.model_families import tiny_hf_model

    hf = tiny_hf_model("qwen2_moe")
    model = model_from_hf(hf.config, hf.state_dict())
    layer = next(m for m in model.modules() if isinstance(m, SparseMoE))
    x = torch.randn(11, hf.config.hidden_size, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        weights, ids = layer.gate(x)
        expected = layer.routed(x, ids, weights)
        w_gate_up = torch.stack([e.gate_up_proj.weight for e in layer.experts])
        w_down = torch.stack([e.down_proj.weight for e in layer.experts])
        activation = layer.experts[0].activation
        torch.testing.assert_close(reference_fused_experts(x, ids, weights, w_gate_up, w_down, activation), expected,
                                   atol=1e-5, rtol=1e-5)
        got = fused_experts(*on_device(x, ids, weights, w_gate_up, w_down), activation)
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)


def test_dropped_pairs_contribute_nothing() -> None:
    """An id of -1 (an expert on another rank under expert parallelism) leaves that slot out."""
    weights, ids = routing(7)
    dropped = ids.clone()
    dropped[::2, 1] = -1
    dropped[3, :] = -1  # a token with no local expert at all
    x = torch.randn(7, C, generator=torch.Generator().manual_seed(5))
    w_gate_up, w_down = expert_weights(torch.float32)
    kept = torch.where(dropped >= 0, weights, 0.0)
    expected = reference_fused_experts(x, ids, kept, w_gate_up, w_down, "silu")
    got = fused_experts(*on_device(x, dropped, weights, w_gate_up, w_down), "silu")
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)
    assert got[3].abs().max() == 0


@pytest.mark.parametrize("tokens,used,block_m", [(1, E, 16), (5, E, 16), (33, 3, 16), (40, E, 4)])
def test_align_by_expert_invariants(tokens: int, used: int, block_m: int) -> None:
    _, ids = routing(tokens, used)
    ids[0, 0] = -1  # a dropped pair
    sorted_ids, expert_of_block, num_padded = align_by_expert(ids.to(DEVICE), E, block_m)
    sorted_ids, expert_of_block, used_rows = sorted_ids.cpu().long(), expert_of_block.cpu().long(), int(num_padded)
    flat, pairs = ids.reshape(-1), ids.numel()
    assert sorted_ids.numel() == expert_of_block.numel() * block_m
    real = sorted_ids[sorted_ids < pairs]
    assert sorted(real.tolist()) == [p for p in range(pairs) if flat[p] >= 0], "every kept pair exactly once"
    assert (sorted_ids[used_rows:] == pairs).all(), "the tail past the used rows is sentinel"
    num_used = used_rows // block_m
    assert used_rows % block_m == 0 and (expert_of_block[num_used:] == -1).all()
    assert (expert_of_block[:num_used] >= 0).all()
    assert (expert_of_block[:num_used].diff() >= 0).all(), "blocks in expert order"
    for b in range(num_used):
        block = sorted_ids[b * block_m:(b + 1) * block_m]
        members = block[block < pairs]
        assert members.numel() > 0, "no block is all padding"
        assert (flat[members] == expert_of_block[b]).all(), "one expert per block"
        assert (members.diff() > 0).all(), "pairs ascending within an expert"
    counts = torch.bincount(flat[flat >= 0], minlength=E)
    assert used_rows == int(((counts + block_m - 1) // block_m * block_m).sum())


def test_no_tokens_give_an_empty_output() -> None:
    w_gate_up, w_down = expert_weights(torch.float32)
    x, ids, weights = torch.zeros(0, C), torch.zeros(0, K, dtype=torch.int64), torch.zeros(0, K)
    assert fused_experts(*on_device(x, ids, weights, w_gate_up, w_down), "silu").shape == (0, C)


def test_without_triton_the_reference_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    from ringserve.kernels.triton import moe_gemm

    monkeypatch.setattr(moe_gemm, "triton", None)  # as on an install without the test/gpu extra
    weights, ids = routing(4)
    x = torch.randn(4, C, generator=torch.Generator().manual_seed(7))
    w_gate_up, w_down = expert_weights(torch.float32)
    torch.testing.assert_close(moe_gemm.fused_experts(x, ids, weights, w_gate_up, w_down, "silu"),
                               reference_fused_experts(x, ids, weights, w_gate_up, w_down, "silu"), atol=0, rtol=0)


def test_a_layer_on_the_gpu_path_stacks_its_experts_once_and_matches_its_cpu_loop() -> None:
    """`SparseMoE._grouped` (what `routed` runs on CUDA) under the interpreter: the experts' parameters become
    views of the stacks, and the output is the per-expert loop's; with expert parallelism the experts of the
    other rank are dropped."""
    from torch import nn

    from ringserve.actors.engine.models.moe import SparseMoE
    from ringserve.actors.engine.models.weights import model_from_hf
    from tests.model_families import tiny_hf_model

    hf = tiny_hf_model("qwen2_moe")
    layer = next(l.mlp for l in model_from_hf(hf.config, hf.state_dict()).decoder_layers()
                 if isinstance(l.mlp, SparseMoE))
    x = torch.randn(7, hf.config.hidden_size, generator=torch.Generator().manual_seed(0))
    weights, ids = layer.gate(x)
    want = layer.routed(x, ids, weights)
    torch.testing.assert_close(layer._grouped(x, ids, weights), want, atol=1e-4, rtol=1e-4)
    gate_up, _, _ = layer._stacks
    assert layer.experts[3].gate_up_proj.weight.data_ptr() == gate_up[3].data_ptr()
    layer.experts = nn.ModuleList(e if i % 2 == 0 else None for i, e in enumerate(layer.experts))
    layer._stacks = None
    torch.testing.assert_close(layer._grouped(x, ids, weights), layer.routed(x, ids, weights), atol=1e-4,
                               rtol=1e-4)
