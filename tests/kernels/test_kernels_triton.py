"""Every Triton kernel against the torch reference: on CPU under Triton's interpreter, on a GPU natively.

`TRITON_INTERPRET=1` is set here, before anything imports `triton`, unless CUDA is available (then the same
tests run the compiled kernels on the GPU). Shapes are small so the interpreter stays fast; layouts are paged
with scattered (non-contiguous) slots, ragged lengths and several GQA head ratios.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed (it comes with the test extra: pip install -e .[test])")

from tests.engine_helpers import engine_for, greedy, run_to_completion, tiny_hf_llama, tokens_of  # noqa: E402
from tests.kernels.test_kernels_attention import dense_reference  # noqa: E402

from ringserve.actors.engine.execution_plan import ExecutionPlan  # noqa: E402
from ringserve.actors.engine.models.blocks import RMSNorm  # noqa: E402
from ringserve.actors.engine.models.rope import Rotary  # noqa: E402
from ringserve.actors.engine.models.weights import model_from_hf  # noqa: E402
from ringserve.actors.engine.models.rope import apply_rotary as torch_apply_rotary  # noqa: E402
from ringserve.kernels.attention import ForwardInfo, TorchPagedBackend, backend_names, create_backend  # noqa: E402
from ringserve.kernels.triton.decode_attention import decode_attention, decode_buffers  # noqa: E402
from ringserve.kernels.triton.extend_attention import extend_attention  # noqa: E402
from ringserve.kernels.triton.kv_indices import build_kv_indices  # noqa: E402
from ringserve.kernels.triton.rmsnorm import rms_norm  # noqa: E402
from ringserve.kernels.triton.rotary import apply_rotary  # noqa: E402
from ringserve.kernels.triton.store_kv import store_kv  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TRITON_NORMS = ExecutionPlan(norm_rotary_kernels="triton")  # what the triton backend's plan builds on a GPU
NUM_SLOTS, NUM_LAYERS, HEAD_DIM = 160, 2, 16


def paged_batch(shape: list[tuple[int, int]], num_kv_heads: int, seed: int = 0):
    """Pools, a table with reversed rows and scattered slots, and each request's full K/V.

    `shape` is `(prefix, q_len)` per request; the prefix K/V is already in the pool, the new K/V is not.
    """
    g = torch.Generator().manual_seed(seed)
    k_pool = torch.zeros(NUM_LAYERS, NUM_SLOTS, num_kv_heads, HEAD_DIM)
    v_pool = torch.zeros_like(k_pool)
    slots = torch.randperm(NUM_SLOTS, generator=g)
    kv_lens = [p + n for p, n in shape]
    table = torch.zeros(len(shape) + 1, max(kv_lens) + 5, dtype=torch.int64)
    rows = torch.arange(len(shape), 0, -1)
    used, keys, values, out_slots = 0, [], [], []
    for b, (prefix, q_len) in enumerate(shape):
        page = slots[used : used + prefix + q_len]
        used += prefix + q_len
        seq_k = torch.randn(prefix + q_len, num_kv_heads, HEAD_DIM, generator=g)
        seq_v = torch.randn(prefix + q_len, num_kv_heads, HEAD_DIM, generator=g)
        k_pool[1, page[:prefix]] = seq_k[:prefix]
        v_pool[1, page[:prefix]] = seq_v[:prefix]
        table[rows[b], : len(page)] = page
        keys.append(seq_k)
        values.append(seq_v)
        out_slots.append(page[prefix:])
    return k_pool, v_pool, table, rows, keys, values, torch.cat(out_slots)


def expected_outputs(q: torch.Tensor, shape, keys, values) -> torch.Tensor:
    out, start = [], 0
    for (_, n), k, v in zip(shape, keys, values):
        out.append(dense_reference(q[start : start + n], k, v))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_decode_attention_matches_dense(num_heads: int, num_kv_heads: int) -> None:
    shape = [(0, 1), (40, 1), (6, 1), (77, 1)]  # ragged, one longer than the split count * block
    k_pool, v_pool, table, rows, keys, values, out_slots = paged_batch(shape, num_kv_heads)
    for b, slot in enumerate(out_slots):  # decode reads the new token from the pool: store it first
        k_pool[1, slot], v_pool[1, slot] = keys[b][-1], values[b][-1]
    q = torch.randn(len(shape), num_heads, HEAD_DIM)
    kv_lens = torch.tensor([p + n for p, n in shape], dtype=torch.int32)
    buffers = decode_buffers(8, num_heads, HEAD_DIM, DEVICE, num_splits=4)  # more rows than used, as in graphs
    got = decode_attention(q.to(DEVICE), k_pool[1].to(DEVICE), v_pool[1].to(DEVICE), table.to(DEVICE),
                           rows.to(DEVICE), kv_lens.to(DEVICE), HEAD_DIM**-0.5, buffers=buffers)
    torch.testing.assert_close(got.cpu(), expected_outputs(q, shape, keys, values), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2)])
def test_extend_attention_matches_dense(num_heads: int, num_kv_heads: int) -> None:
    shape = [(0, 5), (7, 1), (3, 40), (0, 1), (10, 3)]  # prefill, decode, extend over a prefix, > BLOCK_M
    k_pool, v_pool, table, rows, keys, values, out_slots = paged_batch(shape, num_kv_heads)
    new_k = torch.cat([k[-n:] for k, (_, n) in zip(keys, shape)])
    new_v = torch.cat([v[-n:] for v, (_, n) in zip(values, shape)])
    k_pool[1, out_slots], v_pool[1, out_slots] = new_k, new_v
    q_lens = torch.tensor([n for _, n in shape], dtype=torch.int32)
    q_starts = torch.cumsum(q_lens, 0) - q_lens
    kv_lens = torch.tensor([p + n for p, n in shape], dtype=torch.int32)
    q = torch.randn(int(q_lens.sum()), num_heads, HEAD_DIM)
    got = extend_attention(q.to(DEVICE), k_pool[1].to(DEVICE), v_pool[1].to(DEVICE), table.to(DEVICE),
                           rows.to(DEVICE), q_starts.to(DEVICE), q_lens.to(DEVICE), kv_lens.to(DEVICE),
                           int(q_lens.max()), HEAD_DIM**-0.5)
    torch.testing.assert_close(got.cpu(), expected_outputs(q, shape, keys, values), atol=2e-5, rtol=2e-5)


def test_store_kv_writes_only_valid_slots_of_one_layer() -> None:
    k_pool = torch.zeros(NUM_LAYERS, NUM_SLOTS, 2, HEAD_DIM, device=DEVICE)
    v_pool = torch.zeros_like(k_pool)
    kv = torch.randn(5, 2, 3 * HEAD_DIM, device=DEVICE)  # non-contiguous k and v views, as split qkv gives
    k, v = kv[..., :HEAD_DIM], kv[..., HEAD_DIM : 2 * HEAD_DIM]
    slots = torch.tensor([17, 3, -1, 99, 42], device=DEVICE)  # -1: not stored
    store_kv(k, v, k_pool[1], v_pool[1], slots)
    valid = slots >= 0
    torch.testing.assert_close(k_pool[1, slots[valid]], k[valid])
    torch.testing.assert_close(v_pool[1, slots[valid]], v[valid])
    assert int((k_pool[1] != 0).any(-1).any(-1).sum()) == 4, "only the four valid slots are written"
    assert k_pool[0].abs().sum() == 0, "only the given layer is written"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_reference(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    ref = RMSNorm(48, eps=1e-5)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(48))
    ref = ref.to(dtype)
    x = torch.randn(7, 48).to(dtype)
    got = rms_norm(x.to(DEVICE), ref.weight.detach().to(DEVICE), ref.eps).cpu()
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: two roundings, truncated by the interpreter on CPU
    torch.testing.assert_close(got, ref(x).detach(), atol=tol, rtol=tol)


def test_model_with_triton_norms_gives_the_same_logits() -> None:
    from ringserve.kernels.triton.rmsnorm import TritonRMSNorm

    hf = tiny_hf_llama()
    model = model_from_hf(hf.config, hf.state_dict(), DEVICE)
    x = torch.randn(3, hf.config.hidden_size, device=DEVICE)
    expected = [model.model.norm(x), model.model.layers[1].post_attention_layernorm(x)]
    model = model_from_hf(hf.config, hf.state_dict(), DEVICE, TRITON_NORMS)
    assert isinstance(model.model.norm, TritonRMSNorm)
    assert not any(isinstance(m, RMSNorm) for m in model.modules()), "every RMSNorm is swapped"
    got = [model.model.norm(x), model.model.layers[1].post_attention_layernorm(x)]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


def test_engine_with_triton_norms_and_rotary_generates_the_same_tokens() -> None:
    from ringserve.bus.messages import TokenizedRequest
    from ringserve.kernels.triton.rotary import apply_rotary as triton_apply_rotary

    hf = tiny_hf_llama()
    prompts = [[5, 9, 2, 7, 11, 3], [4, 8]]

    def generate(swap: bool) -> dict[str, list[int]]:
        engine = engine_for(hf, device=DEVICE.type, build=TRITON_NORMS if swap else None)
        if swap:
            assert engine.stats().execution["norm_rotary_kernels"] == "triton"
            assert all(layer.self_attn.rotary is triton_apply_rotary for layer in engine.runner.model.model.layers)
        rows = run_to_completion(engine, [TokenizedRequest(f"r{i}", p, greedy(6)) for i, p in enumerate(prompts)])
        return {rid: tokens_of(r) for rid, r in rows.items()}

    expected = generate(swap=False)
    assert generate(swap=True) == expected and all(len(t) == 6 for t in expected.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_reference(dtype: torch.dtype) -> None:
    rotary = Rotary({"rope_type": "default", "rope_theta": 10000.0}, HEAD_DIM, 4096)
    positions = torch.tensor([0, 5, 1, 300, 7])
    cos, sin = rotary(positions, dtype)
    qkv = torch.randn(5, 10, HEAD_DIM).to(dtype)
    q = qkv[:, :6]  # a strided view, as the model's split of the fused projection gives
    got = apply_rotary(q.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE)).cpu()
    expected = torch_apply_rotary(q, cos, sin)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    elif DEVICE.type == "cuda":
        assert torch.equal(got, expected), "bf16 rounding follows the reference op by op"
    else:
        # Triton's interpreter casts float32 to bfloat16 by truncation, not round-to-nearest as the GPU does,
        # so on CPU the bf16 result can be one unit in the last place off at each of the three roundings.
        torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


def test_kv_indices_flatten_rows_in_csr_order() -> None:
    table = torch.arange(4 * 600, dtype=torch.int64).reshape(4, 600)
    rows = torch.tensor([2, 0, 3])
    kv_lens = torch.tensor([3, 550, 1], dtype=torch.int32)  # one row longer than a kernel block
    indptr = torch.zeros(4, dtype=torch.int32)
    indptr[1:] = torch.cumsum(kv_lens, 0)
    out = torch.full((int(indptr[-1]) + 2,), -7, dtype=torch.int32)
    got = build_kv_indices(table.to(DEVICE), rows.to(DEVICE), indptr.to(DEVICE), kv_lens.to(DEVICE),
                           out.to(DEVICE)).cpu()
    expected = torch.cat([table[r, :n] for r, n in zip(rows.tolist(), kv_lens.tolist())]).int()
    assert torch.equal(got[: len(expected)], expected)
    assert got[len(expected) :].tolist() == [-7, -7]


@pytest.mark.parametrize("shape", [[(0, 5), (7, 1), (3, 4), (10, 1)], [(4, 1), (9, 1), (1, 1)]])
def test_triton_backend_matches_torch_backend(shape: list[tuple[int, int]]) -> None:
    assert "triton" in backend_names()
    num_heads, num_kv_heads = 6, 2
    k_pool, v_pool, table, rows, keys, values, out_slots = paged_batch(shape, num_kv_heads)
    q_lens = [n for _, n in shape]
    kv_lens = [p + n for p, n in shape]
    q = torch.randn(sum(q_lens), num_heads, HEAD_DIM)
    new_k = torch.cat([k[-n:] for k, n in zip(keys, q_lens)])
    new_v = torch.cat([v[-n:] for v, n in zip(values, q_lens)])
    outs = {}
    for name in ("torch", "triton"):
        kp, vp = k_pool.clone().to(DEVICE), v_pool.clone().to(DEVICE)
        backend = create_backend(name, kp, vp, num_heads)
        meta = backend.prepare(ForwardInfo(q_lens, kv_lens, rows.to(DEVICE), table.to(DEVICE), out_slots.to(DEVICE)))
        outs[name] = (backend.forward(q.to(DEVICE), new_k.to(DEVICE), new_v.to(DEVICE), 1, meta).cpu(), kp.cpu())
    assert isinstance(create_backend("torch", k_pool, v_pool, num_heads), TorchPagedBackend)
    torch.testing.assert_close(outs["triton"][0], outs["torch"][0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(outs["triton"][1], outs["torch"][1])


@pytest.mark.parametrize("family", ["gemma2", "phi3"])
def test_the_triton_backend_serves_other_families_with_their_tokens(family: str) -> None:
    """Gemma 2 (sliding and global layers, soft-capped logits, its own softmax scale, `1 + weight` norms the
    Triton norm does not swap) and Phi-3 (partial rotary, which the Triton rotary does not take) through the
    Triton attention backend: the torch backend's greedy tokens, prompts crossing the window."""
    from ringserve.bus.messages import TokenizedRequest
    from tests.model_families import WINDOW, tiny_hf_model

    hf = tiny_hf_model(family)
    prompts = [list(range(3, 3 + 2 * WINDOW + 1)), [7, 9, 11]]

    def generate(backend: str) -> dict[str, list[int]]:
        engine = engine_for(hf, device=DEVICE.type, attention_backend=backend,
                            build=TRITON_NORMS if backend == "triton" else None)
        rows = run_to_completion(engine, [TokenizedRequest(f"r{i}", p, greedy(WINDOW)) for i, p in enumerate(prompts)])
        return {rid: tokens_of(r) for rid, r in rows.items()}

    assert generate("triton") == generate("torch")
