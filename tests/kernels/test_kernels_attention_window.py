"""Every attention backend honours each layer's `LayerAttention`: softmax scale, sliding window (HF semantics: key
j is visible from query i iff i - window < j <= i) and logit soft-cap, against dense masked softmax attention.

One step mixes decode rows and prefill/extend rows whose lengths cross the window (window 5, keys 1 to 17,
GQA heads) over a pool whose layers differ in spec (no window, two windows, capped and not, scales off
1/sqrt(d)); one `prepare` serves every layer. Backends: torch (its gather path, and its decode rows through the
CPU paged kernel on each ISA path), its static-buffer decode path eagerly and compiled (`torch.compile`, as the
CPU decode graphs do), Triton under its interpreter (natively on a GPU), FlashInfer on a GPU only.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import ringserve.kernels.cpu as cpu_kernels
from ringserve.kernels.attention import ForwardInfo, LayerAttention, TorchPagedBackend, backend_names, create_backend

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_SLOTS = 6, 2, 16, 512
LAYERS = (
    LayerAttention(0.3, window=5),
    LayerAttention(0.2, soft_cap=2.0),
    LayerAttention(HEAD_DIM**-0.5),
    LayerAttention(0.4, window=5, soft_cap=1.5),
    LayerAttention(0.25, window=3),
)
# (prefix, new tokens) per request: decode rows at 1 to 17 keys, prefills and extends shorter and longer than
# the window, an extend whose new tokens alone cross it twice
MIXED = [(0, 1), (3, 1), (4, 1), (5, 1), (9, 1), (16, 1), (0, 4), (0, 5), (0, 6), (0, 17), (3, 4), (7, 9), (12, 5)]
DECODE = [(0, 1), (2, 1), (4, 1), (5, 1), (10, 1), (16, 1)]


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: LayerAttention) -> torch.Tensor:
    """Attention of the last `len(q)` positions over `k`, `v` `[kv_len, Hkv, D]`: dense scores, the cap, the
    causal and window mask, the softmax (HF's eager attention, in float64)."""
    rep = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(rep, dim=1), v.double().repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * spec.scale
    if spec.soft_cap:
        scores = spec.soft_cap * torch.tanh(scores / spec.soft_cap)
    i = (k.shape[0] - q.shape[0] + torch.arange(q.shape[0]))[:, None]  # query positions
    j = torch.arange(k.shape[0])[None, :]
    allowed = (j <= i) & ((j > i - spec.window) if spec.window else True)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float()


@dataclass
class Step:
    """One step over a pool of `len(LAYERS)` layers: each request's K/V per layer (prefix already in the pool),
    the step's queries and new K/V per layer, and the `ForwardInfo`."""

    shape: list[tuple[int, int]]
    k_pool: torch.Tensor
    v_pool: torch.Tensor
    keys: list[list[torch.Tensor]]  # [layer][request] [kv_len, Hkv, D]
    values: list[list[torch.Tensor]]
    q: list[torch.Tensor]  # [layer] [T, H, D]
    info: ForwardInfo

    def new(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's new keys and values of `layer`, `[T, Hkv, D]`."""
        n = [q_len for _, q_len in self.shape]
        return (torch.cat([k[-m:] for k, m in zip(self.keys[layer], n)]),
                torch.cat([v[-m:] for v, m in zip(self.values[layer], n)]))

    def expected(self, layer: int) -> torch.Tensor:
        out, start = [], 0
        for b, (_, n) in enumerate(self.shape):
            out.append(dense_attention(self.q[layer][start : start + n], self.keys[layer][b], self.values[layer][b],
                                       LAYERS[layer]))
            start += n
        return torch.cat(out)

    def to(self, device: torch.device, dtype: torch.dtype) -> Step:
        info = ForwardInfo(self.info.q_lens_cpu, self.info.kv_lens_cpu, self.info.req_rows.to(device),
                           self.info.token_table.to(device), self.info.out_slots.to(device))
        return Step(self.shape, self.k_pool.to(device, dtype), self.v_pool.to(device, dtype), self.keys, self.values,
                    self.q, info)


def make_step(shape: list[tuple[int, int]], seed: int = 0) -> Step:
    """Scattered slots, table rows in reverse order with a spare row, every layer's prefix K/V in the pool."""
    g, layers = torch.Generator().manual_seed(seed), len(LAYERS)
    k_pool, v_pool = torch.zeros(2, layers, NUM_SLOTS, NUM_KV_HEADS, HEAD_DIM)
    kv_lens = [p + n for p, n in shape]
    pages = torch.randperm(NUM_SLOTS, generator=g)[: sum(kv_lens)].split(kv_lens)
    rows = torch.arange(len(shape), 0, -1)
    table = torch.zeros(len(shape) + 1, max(kv_lens) + 3, dtype=torch.int64)
    keys: list[list[torch.Tensor]] = [[] for _ in range(layers)]
    values: list[list[torch.Tensor]] = [[] for _ in range(layers)]
    out_slots = []
    for b, ((prefix, q_len), page) in enumerate(zip(shape, pages)):
        table[rows[b], : len(page)] = page
        out_slots.append(page[prefix:])
        for layer in range(layers):
            seq_k = torch.randn(prefix + q_len, NUM_KV_HEADS, HEAD_DIM, generator=g) * 1.5
            seq_v = torch.randn(prefix + q_len, NUM_KV_HEADS, HEAD_DIM, generator=g)
            k_pool[layer, page[:prefix]] = seq_k[:prefix]
            v_pool[layer, page[:prefix]] = seq_v[:prefix]
            keys[layer].append(seq_k)
            values[layer].append(seq_v)
    total = sum(n for _, n in shape)
    q = [torch.randn(total, NUM_HEADS, HEAD_DIM, generator=g) for _ in range(layers)]
    info = ForwardInfo([n for _, n in shape], kv_lens, rows, table, torch.cat(out_slots))
    return Step(shape, k_pool, v_pool, keys, values, q, info)


def run_layers(backend, step: Step, meta: object, forward: Callable | None = None) -> list[torch.Tensor]:
    """Every layer's output for one step (one metadata for all), in the pool's device and dtype."""
    forward = forward or backend.forward
    device, dtype = backend.k_pool.device, backend.k_pool.dtype
    outs = []
    for layer in range(len(LAYERS)):
        k, v = step.new(layer)
        outs.append(forward(step.q[layer].to(device, dtype), k.to(device, dtype), v.to(device, dtype), layer, meta))
    return outs


def check(outs: list[torch.Tensor], step: Step, tol: float = 1e-5) -> None:
    for layer, out in enumerate(outs):
        torch.testing.assert_close(out.float().cpu(), step.expected(layer), atol=tol, rtol=tol,
                                   msg=lambda m, layer=layer: f"layer {layer} ({LAYERS[layer]}): {m}")


def cpu_isas() -> list[str]:
    if not cpu_kernels.compiled():
        return []
    return ["avx2"] + (["avx512vnni"] if cpu_kernels.best_isa() == "avx512vnni" else [])


def in_isa(isa: str) -> Callable[[], None]:
    """Switch the CPU kernels to `isa`; returns the undo."""
    before = cpu_kernels.isa()
    cpu_kernels.set_isa(isa)
    return lambda: cpu_kernels.set_isa(before)


@pytest.mark.parametrize("shape", [MIXED, DECODE], ids=["mixed", "decode"])
def test_torch_gather_path(shape: list[tuple[int, int]]) -> None:
    step = make_step(shape)
    backend = TorchPagedBackend(step.k_pool, step.v_pool, NUM_HEADS, LAYERS)
    backend.in_place_decode = False
    check(run_layers(backend, step, backend.prepare(step.info)), step)


def test_torch_windowed_extend_reads_only_the_window() -> None:
    """A 17-token prefill under a window of 5 runs in chunks of 5 queries, each gathering at most 9 keys."""
    step = make_step([(0, 17), (12, 5)])
    backend = TorchPagedBackend(step.k_pool, step.v_pool, NUM_HEADS, LAYERS)
    meta = backend.prepare(step.info)
    by_window = dict(zip(backend.windows, meta.groups))
    assert set(by_window) == {None, 5, 3}
    (full,), (windowed,) = by_window[None], by_window[5]
    assert full.kv_slots.shape == (2, 17)
    assert windowed.kv_slots.shape == (5, 9)  # 4 chunks of the prefill, 1 of the extend; 5 + 5 - 1 keys
    assert by_window[3][0].kv_slots.shape[1] == 5  # 3 + 3 - 1
    check(run_layers(backend, step, meta), step)


@pytest.mark.skipif(not cpu_isas(), reason="the C++ kernels did not build here")
@pytest.mark.parametrize("isa", cpu_isas())
@pytest.mark.parametrize("shape", [MIXED, DECODE], ids=["mixed", "decode"])
def test_torch_with_the_cpu_paged_kernel(isa: str, shape: list[tuple[int, int]]) -> None:
    step = make_step(shape, seed=1)
    backend = TorchPagedBackend(step.k_pool, step.v_pool, NUM_HEADS, LAYERS)
    assert backend.in_place_decode
    undo = in_isa(isa)
    try:
        meta = backend.prepare(step.info)
        assert meta.decode is not None
        outs = run_layers(backend, step, meta)
        if shape is DECODE:
            assert backend.in_place_decode_inputs(meta, 3)[3] == LAYERS[3]  # what the fused layer op runs with
    finally:
        undo()
    check(outs, step)


def graph_meta(backend: TorchPagedBackend, step: Step, max_bs: int = 8):
    """The static-buffer decode metadata the graph runner uses, filled for `step` (decode rows only)."""
    bs = len(step.shape)
    backend.init_graph_buffers(max_bs, step.info.token_table)
    meta = backend.prepare_for_capture(bs)
    backend.prepare_for_replay(bs, step.info)
    return meta


def test_torch_graph_decode_gathering_the_window() -> None:
    """The static decode path where the CPU kernel does not run (CUDA graphs): windowed layers gather only
    `window` keys per row."""
    step = make_step(DECODE, seed=2)
    backend = TorchPagedBackend(step.k_pool, step.v_pool, NUM_HEADS, LAYERS)
    backend.in_place_decode = False
    meta = graph_meta(backend, step)
    width = step.info.token_table.shape[1]
    assert backend.windows == (5, None, 3)
    assert [slots.shape[1] for slots, _ in meta.gathered] == [5, width, 3]
    check(run_layers(backend, step, meta), step)


@pytest.mark.skipif(not cpu_isas(), reason="the C++ kernels did not build here")
def test_torch_compiled_decode_reads_the_pool_in_place() -> None:
    """The decode forward of every layer compiled whole (fullgraph, static shapes, as actors/engine/runner/
    graphs/graph_compiler.py does): the paged kernel runs in the graph with each layer's window and cap."""
    step = make_step(DECODE, seed=3)
    backend = TorchPagedBackend(step.k_pool, step.v_pool, NUM_HEADS, LAYERS)
    meta = graph_meta(backend, step)
    assert meta.rows is not None

    def decode(qs: list[torch.Tensor], ks: list[torch.Tensor], vs: list[torch.Tensor], meta: object) -> list:
        return [backend.forward(qs[layer], ks[layer], vs[layer], layer, meta) for layer in range(len(LAYERS))]

    compiled = torch.compile(decode, fullgraph=True, dynamic=False)
    new = [step.new(layer) for layer in range(len(LAYERS))]
    outs = compiled(step.q, [k for k, _ in new], [v for _, v in new], meta)
    check(outs, step)
    torch.testing.assert_close(backend.k_pool[3, step.info.out_slots], new[3][0])  # the graph wrote the new K


needs_triton = pytest.mark.skipif("triton" not in backend_names(), reason="triton is not installed")


@needs_triton
@pytest.mark.parametrize("shape", [MIXED, DECODE], ids=["mixed", "decode"])
def test_triton(shape: list[tuple[int, int]]) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    step = make_step(shape, seed=4).to(device, torch.float32)
    backend = create_backend("triton", step.k_pool, step.v_pool, NUM_HEADS, LAYERS)
    check(run_layers(backend, step, backend.prepare(step.info)), step, tol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available() or "flashinfer" not in backend_names(),
                    reason="FlashInfer needs a CUDA GPU and the flashinfer package")
@pytest.mark.parametrize("shape", [MIXED, DECODE], ids=["mixed", "decode"])
def test_flashinfer(shape: list[tuple[int, int]]) -> None:
    step = make_step(shape, seed=5).to(torch.device("cuda"), torch.bfloat16)
    backend = create_backend("flashinfer", step.k_pool, step.v_pool, NUM_HEADS, LAYERS)
    assert len(backend.specs) == len(LAYERS)
    outs = run_layers(backend, step, backend.prepare(step.info))
    check(outs, step, tol=5e-2)  # bf16 K/V and queries against a float64 reference
