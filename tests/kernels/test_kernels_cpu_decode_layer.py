"""The whole-layer CPU decode op (kernels/cpu/decode_layer.cpp) against its torch reference and against the
model's own layer: every packed format, biases, GQA shapes on and off the vector paths, odd sizes (K not a
multiple of 32, output rows not a multiple of 16), 1 to 5 rows, 1 and 2 threads (bit-equal), the KV it
writes, a layer's sliding window and logit soft-cap; the model takes the op exactly where it applies; its errors
name what is wrong."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

import ringserve.kernels.cpu as cpu_kernels
from ringserve.actors.engine.config import EngineConfig
from ringserve.actors.engine.execution_plan import resolve_execution
from ringserve.actors.engine.models.causal_lm import CausalLM
from ringserve.actors.engine.models.causal_lm import build_model
from ringserve.kernels.attention.backend import ForwardInfo
from ringserve.kernels.attention.torch_paged import TorchPagedBackend
from ringserve.kernels.cpu.decode_layer import reference_decode_layer
from ringserve.kernels.cpu.packing import pack
from ringserve.kernels.quantization import quantize_linears

needs_build = pytest.mark.skipif(not cpu_kernels.compiled(), reason="the C++ kernels did not build here")


def layer_case(m: int, hidden: int, inner: int, heads: int, kv_heads: int, head_dim: int, fmt: str, bias: bool,
               slots: int = 1024, seed: int = 0, lens: list[int] | None = None) -> dict:
    """The op's arguments for `m` rows over a pool whose table rows hold scattered slots (no two rows share one)."""
    torch.manual_seed(seed)
    shapes = [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim), (2 * inner, hidden),
              (hidden, inner)]
    packed = [pack(torch.randn(n, k) / k**0.5, fmt) for n, k in shapes]
    biases = [torch.randn(n) * 0.1 if bias else None for n, _ in shapes]
    lens = lens or [1 + (37 * r) % 90 for r in range(m)]
    width = max(lens) + 3
    table = torch.randperm(slots)[: (m + 1) * width].reshape(m + 1, width)
    rows = torch.randperm(m + 1)[:m]
    out_slots = torch.stack([table[rows[r], lens[r] - 1] for r in range(m)])  # each row's new token's slot
    positions = torch.tensor(lens) - 1
    freqs = positions[:, None].float() / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    emb = torch.cat((freqs, freqs), dim=-1)
    return dict(
        x=torch.randn(m, hidden), cos=emb.cos(), sin=emb.sin(), norm1=torch.rand(hidden) + 0.5,
        norm2=torch.rand(hidden) + 0.5, eps=1e-5, qweights=[p.qweight for p in packed],
        scales=[p.scales for p in packed], mins=[p.mins for p in packed], biases=biases,
        bits=[p.bits for p in packed], out_features=[p.out_features for p in packed],
        k_pool=torch.randn(3, slots, kv_heads, head_dim), v_pool=torch.randn(3, slots, kv_heads, head_dim), layer=1,
        out_slots=out_slots, table=table, rows=rows, kv_lens=torch.tensor(lens), num_heads=heads,
        scale=head_dim**-0.5)


def run_op(args: dict, threads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    args = {**args, "k_pool": args["k_pool"].clone(), "v_pool": args["v_pool"].clone()}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.ops.ringserve_cpu.decode_layer(*args.values())
    finally:
        torch.set_num_threads(before)
    return out, args["k_pool"], args["v_pool"]


def run_reference(args: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    args = {**args, "k_pool": args["k_pool"].clone(), "v_pool": args["v_pool"].clone()}
    return reference_decode_layer(*args.values()), args["k_pool"], args["v_pool"]


@needs_build
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("shape", [(64, 96, 4, 2, 16), (72, 100, 3, 1, 24), (48, 80, 6, 6, 8), (40, 56, 4, 2, 10)],
                         ids=["gqa2", "odd-k-mqa", "mha", "head-dim-10"])
@pytest.mark.parametrize("m", [1, 2, 5])
def test_the_op_matches_the_reference(fmt: str, shape: tuple[int, ...], m: int) -> None:
    hidden, inner, heads, kv_heads, head_dim = shape
    args = layer_case(m, hidden, inner, heads, kv_heads, head_dim, fmt, bias=m == 2, seed=m + hidden)
    got, got_k, got_v = run_op(args, threads=2)
    want, want_k, want_v = run_reference(args)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(got_k, want_k, atol=1e-5, rtol=1e-5)  # the rows' keys (rotated) and values
    torch.testing.assert_close(got_v, want_v, atol=1e-5, rtol=1e-5)
    untouched = torch.ones(args["k_pool"].shape[1], dtype=torch.bool)
    untouched[args["out_slots"]] = False
    assert torch.equal(got_k[:, untouched], args["k_pool"][:, untouched])  # nothing else written
    assert torch.equal(got_k[[0, 2]], args["k_pool"][[0, 2]])  # nor another layer


@needs_build
@pytest.mark.parametrize("lens", [[191, 192, 500], [1000], [97, 1500, 3, 300, 290]], ids=["3-rows", "1-row", "5-rows"])
def test_long_keys_split_into_parts_match_the_reference(lens: list[int]) -> None:
    """Few (request, KV head) pairs: each request's keys are split into parts of ~96 and combined."""
    args = layer_case(len(lens), 64, 96, 6, 2, 16, "q4_1", bias=False, slots=16384, seed=len(lens), lens=lens)
    got, got_k, _ = run_op(args, threads=2)
    want, want_k, _ = run_reference(args)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(got_k, want_k, atol=1e-5, rtol=1e-5)


@needs_build
@pytest.mark.parametrize("lens,window,soft_cap", [([5, 40, 90], 37, 0.0), ([1000], 400, 4.0), ([300, 20], 0, 3.0)],
                         ids=["window", "window-split-parts", "soft-cap"])
def test_a_sliding_window_and_a_soft_cap_match_the_reference(lens: list[int], window: int, soft_cap: float) -> None:
    """Attention inside the op over the last `window` keys only (split into parts when long), logits capped."""
    args = layer_case(len(lens), 64, 96, 6, 2, 16, "q8_0", bias=False, slots=4096, seed=7, lens=lens)
    args = {**args, "scale": 0.3, "window": window, "soft_cap": soft_cap}
    got, got_k, _ = run_op(args, threads=2)
    want, want_k, _ = run_reference(args)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(got_k, want_k, atol=1e-5, rtol=1e-5)
    plain, _, _ = run_reference({**args, "window": 0, "soft_cap": 0.0})
    assert not torch.allclose(got, plain, atol=1e-3), "the window and cap changed nothing: the case tests nothing"


@needs_build
@pytest.mark.parametrize("m,lens", [(1, None), (3, None), (1, [700]), (2, [300, 1000])])
def test_two_threads_give_one_threads_output_bit_for_bit(m: int, lens: list[int] | None) -> None:
    """The thread tuner switches counts between steps: a request's greedy tokens must not change with it
    (split keys included: the parts depend on the lengths only)."""
    args = layer_case(m, 64, 96, 9, 3, 16, "q4_1", bias=False, slots=4096, seed=3, lens=lens)
    one, one_k, _ = run_op(args, threads=1)
    two, two_k, _ = run_op(args, threads=2)
    assert torch.equal(one, two) and torch.equal(one_k, two_k)


@needs_build
def test_errors_name_what_is_wrong() -> None:
    args = layer_case(2, 64, 96, 4, 2, 16, "q8_0", bias=False)
    with pytest.raises(RuntimeError, match="slot 9999 outside the pool"):
        run_op({**args, "out_slots": torch.tensor([0, 9999])}, threads=1)
    with pytest.raises(RuntimeError, match="kv_len 0 outside"):
        run_op({**args, "kv_lens": torch.tensor([0, 3])}, threads=1)
    with pytest.raises(RuntimeError, match="linear 0 has 128 outputs, the layer's shapes need 96"):
        run_op({**args, "num_heads": 2}, threads=1)  # the QKV projection no longer fits the heads


def tiny_model(method: str) -> CausalLM:
    """A tiny Llama quantized with `method`, built with the execution plan an engine quantizing so resolves."""
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = build_model(config, resolve_execution(EngineConfig(device="cpu", quantization=method)))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    for layer in model.model.layers:
        layer.input_layernorm.weight.data.uniform_(0.5, 1.5)
        layer.post_attention_layernorm.weight.data.uniform_(0.5, 1.5)
    model.model.norm.weight.data.fill_(1.0)
    return quantize_linears(model.eval(), method) if method != "none" else model.eval()


def decode_step(model: CausalLM, backend: TorchPagedBackend, lens: list[int]) -> torch.Tensor:
    """Logits of one eager decode step: request b's token at position lens[b] - 1, its keys at table row b."""
    b = len(lens)
    table = torch.arange(b * 64).reshape(b, 64)
    positions = torch.tensor(lens) - 1
    info = ForwardInfo(q_lens_cpu=[1] * b, kv_lens_cpu=list(lens), req_rows=torch.arange(b), token_table=table,
                       out_slots=table[torch.arange(b), positions])
    ids = torch.arange(b) * 7 % 97
    return model(ids, positions, backend, backend.prepare(info), torch.arange(b))


@needs_build
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_the_model_runs_each_decode_layer_as_one_op_with_the_same_logits(method: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Same pool contents, same step: the fused layers' logits and KV writes match the layers' own modules."""
    model = tiny_model(method)
    pools = torch.randn(2, 2, 256, 2, 16)
    calls: list[int] = []
    real = torch.ops.ringserve_cpu.decode_layer.default

    def counted(*args: object) -> torch.Tensor:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(torch.ops.ringserve_cpu.decode_layer, "default", counted)
    results = {}
    assert all(layer.fused_decode for layer in model.model.layers)
    for fused in (False, True):
        for layer in model.model.layers:
            layer.fused_decode = fused  # the same weights through the layers' modules, then the op
        backend = TorchPagedBackend(pools[0].clone(), pools[1].clone(), num_heads=4)
        results[fused] = (decode_step(model, backend, [5, 17, 1]), backend.k_pool, backend.v_pool)
    assert len(calls) == 2  # one per layer, fused run only
    torch.testing.assert_close(results[True][0], results[False][0], atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(results[True][1], results[False][1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results[True][2], results[False][2], atol=1e-5, rtol=1e-5)


@needs_build
def test_the_op_is_not_taken_where_it_does_not_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 layers are never marked; a prefill (or a mixed step) runs the layers' modules."""
    assert not any(layer.fused_decode for layer in tiny_model("none").model.layers)
    model = tiny_model("int8")
    assert all(layer.fused_decode for layer in model.model.layers)
    monkeypatch.setattr(torch.ops.ringserve_cpu.decode_layer, "default",
                        lambda *args: pytest.fail("the fused op ran for a prefill"))
    backend = TorchPagedBackend(torch.zeros(2, 256, 2, 16), torch.zeros(2, 256, 2, 16), num_heads=4)
    table = torch.arange(64).reshape(1, 64)
    info = ForwardInfo(q_lens_cpu=[4], kv_lens_cpu=[4], req_rows=torch.tensor([0]), token_table=table,
                       out_slots=table[0, :4])
    logits = model(torch.tensor([1, 2, 3, 4]), torch.arange(4), backend, backend.prepare(info), torch.tensor([3]))
    assert logits.shape == (1, 97)
