"""Plain-torch paged attention: the reference backend, and the one that runs on CPU.

Every step is an "extend": each request's new queries attend to its gathered (prefix + new) keys under a
causal mask shifted by the prefix length, through `scaled_dot_product_attention` with a boolean mask.
Requests are padded to the longest query and key length of their group. Decode rows (one query) and
extend rows form separate groups, so a long prefill does not pad every decode row of a mixed batch to its
length; both groups go through the same code.

GQA without copying K/V: the `rep = n_heads / n_kv_heads` query heads sharing one KV head are folded into
the query-length axis, `[Bg, n_kv_heads, rep * max_q, head_dim]`, and the mask is repeated to match.

Each layer's `LayerAttention` applies: its scale, its logit soft-cap (`dense.attend`, SDPA's math by hand when
capped) and its sliding window. `prepare` builds the groups once per distinct window of the model (a Gemma 2 has
two sets, a Llama one). With a window a row gathers only the keys its queries can see: a decode row its last
`window` keys, an extend row's queries in chunks of `window`, each chunk its own padded row reading at most
`2 * window - 1` keys, so a long sliding prefill never builds a full-length score matrix.

On a CPU with float32 KV and our C++ kernels built (kernels/cpu), the decode rows skip the gather: the paged
decode attention kernel reads each request's K/V where it lies in the pool (`DecodeRows`). Extend rows take the
gather path, except under `--enable-deterministic-inference` (`row_invariant`): then every query is a row of the
decode kernel (the rows of one request share its table row, each seeing its causal prefix), so a row's attention
is computed alike in a decode, a verify and a prefill step.

Graph decode (`init_graph_buffers` and the two prepare hooks) uses static shapes. Where the CPU kernel runs,
the static buffers are the rows, KV lengths and output slots the kernel reads, so a compiled CPU decode graph
(actors/engine/runner/graphs/decode_graph.py) reads the pool in place too (the kernel takes each layer's window and
cap). Elsewhere every row gathers the full width of the token table (a windowed layer: `window` keys ending at
its length) and masks keys past its length: slow for long contexts, it exists so the graph runner's logic can be
checked against the eager path on any device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ringserve.kernels.attention.backend import AttentionBackend, AttentionMetadata, ForwardInfo, LayerAttention
from ringserve.kernels.attention.dense import attend
from ringserve.kernels.host_copy import host_to_device, to_device


@dataclass
class PaddedGroup:
    """A sub-batch of requests padded to common query and key lengths."""

    q_index: torch.Tensor  # [Bg, max_q] flat token index per padded query row (padding repeats the last one)
    kv_slots: torch.Tensor  # [Bg, max_kv] pool slots to gather keys/values from (a window's keys, when it has one)
    mask: torch.Tensor  # [Bg, 1, rep * max_q, max_kv] bool, True = may attend
    src: torch.Tensor  # [Tg] padded output rows (of Bg * max_q) that hold real tokens
    dst: torch.Tensor  # [Tg] flat token index of each of those rows


@dataclass
class DecodeRows:
    """Decode rows for the CPU paged kernel: one query token each, K/V read in place through the table."""

    table: torch.Tensor  # [R, max_len] int64 the request-to-token table
    tokens: torch.Tensor  # [Bd] flat token index of each row's query
    rows: torch.Tensor  # [Bd] int64 rows of the token table
    kv_lens: torch.Tensor  # [Bd] int64 keys per row


@dataclass
class TorchPagedMetadata(AttentionMetadata):
    """Metadata plus the padded groups the torch backend runs: one list per distinct window of the backend's
    layers (`TorchPagedBackend.windows` order)."""

    groups: list[list[PaddedGroup]] = field(default_factory=list)
    decode: DecodeRows | None = None  # the decode rows, when the CPU kernel runs them


@dataclass
class TorchGraphMetadata(AttentionMetadata):
    """Static decode metadata for graphs: views of the backend's graph buffers for `bs` rows. Either the
    paged kernel's inputs (`table`, `rows`, `kv_lens`) or, per distinct window, the gathered slots and mask."""

    gathered: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()  # per window: slots [bs, Wg], mask [bs, 1, 1, Wg]
    table: torch.Tensor | None = None  # [R, W] int64 the request-to-token table (the CPU kernel reads it)
    rows: torch.Tensor | None = None  # [bs] int64 table rows
    kv_lens: torch.Tensor | None = None  # [bs] int64 keys per row


class TorchPagedBackend(AttentionBackend):
    """Reference paged attention in plain torch (gather + masked SDPA)."""

    supports_cuda_graph = True

    def __init__(self, k_pool: torch.Tensor, v_pool: torch.Tensor, num_heads: int,
                 layers: Sequence[LayerAttention] | None = None) -> None:
        super().__init__(k_pool, v_pool, num_heads, layers)
        self.rep = num_heads // self.num_kv_heads
        # the distinct windows of the layers (None: full attention), and each layer's index into them
        self.windows: tuple[int | None, ...] = tuple(dict.fromkeys(spec.window for spec in self.layers))
        self.window_index = [self.windows.index(spec.window) for spec in self.layers]
        self._graph: dict[str, Any] = {}
        self.in_place_decode = _in_place_decode(k_pool)
        # --enable-deterministic-inference: every query (an extend's too) is a row of the paged decode kernel
        self.row_invariant = False

    def compiles_decode(self) -> bool:
        return self.in_place_decode

    def in_place_decode_inputs(self, meta: AttentionMetadata, layer: int) -> tuple[
            torch.Tensor, torch.Tensor, torch.Tensor, LayerAttention] | None:
        if isinstance(meta, TorchGraphMetadata):
            if meta.rows is None or meta.table is None or meta.kv_lens is None:
                return None
            return meta.table, meta.rows, meta.kv_lens, self.layers[layer]
        d = meta.decode if isinstance(meta, TorchPagedMetadata) else None
        if d is None or any(meta.groups):  # type: ignore[union-attr]
            return None
        return d.table, d.rows, d.kv_lens, self.layers[layer]  # decode rows only: token b is row b

    def init_graph_buffers(self, max_bs: int, token_table: torch.Tensor) -> None:
        device, width = self.k_pool.device, token_table.shape[1]
        g = {"table": token_table, "out_slots": torch.zeros(max_bs, dtype=torch.int64, device=device)}
        if self.in_place_decode:
            g["rows"] = torch.zeros(max_bs, dtype=torch.int64, device=device)
            g["kv_lens"] = torch.ones(max_bs, dtype=torch.int64, device=device)  # dummy rows see one key
        else:
            g["gathered"] = []
            for window in self.windows:  # each window's rows gather at most `window` keys
                cols = min(width, window or width)
                mask = torch.zeros(max_bs, 1, 1, cols, dtype=torch.bool, device=device)
                mask[:, :, :, 0] = True  # dummy rows see one key
                g["gathered"].append((torch.zeros(max_bs, cols, dtype=torch.int64, device=device), mask))
        self._graph = g

    def prepare_for_capture(self, bs: int) -> TorchGraphMetadata:
        g = self._graph
        if self.in_place_decode:
            return TorchGraphMetadata(out_slots=g["out_slots"][:bs], table=g["table"], rows=g["rows"][:bs],
                                      kv_lens=g["kv_lens"][:bs])
        return TorchGraphMetadata(out_slots=g["out_slots"][:bs],
                                  gathered=tuple((slots[:bs], mask[:bs]) for slots, mask in g["gathered"]))

    def prepare_for_replay(self, bs: int, info: ForwardInfo) -> None:
        g = self._graph
        kv_lens = info.kv_lens
        if kv_lens is None:
            kv_lens = to_device(info.kv_lens_cpu, self.k_pool.device)
        g["out_slots"][:bs].copy_(info.out_slots)
        if self.in_place_decode:
            g["rows"][:bs].copy_(info.req_rows)
            g["kv_lens"][:bs].copy_(kv_lens)
            return
        table = g["table"]
        for window, (slots, mask) in zip(self.windows, g["gathered"]):
            cols = slots.shape[1]
            first = (kv_lens - cols).clamp(min=0) if window else torch.zeros_like(kv_lens)
            index = first[:, None] + torch.arange(cols, device=kv_lens.device)  # [bs, cols] key positions
            mask[:bs, 0, 0].copy_(index < kv_lens[:, None])
            slots[:bs].copy_(table[info.req_rows[:, None], index.clamp(max=table.shape[1] - 1)])

    def prepare(self, info: ForwardInfo) -> TorchPagedMetadata:
        q_lens_cpu = info.q_lens_cpu
        starts: list[int] = []
        total = 0
        for q_len in q_lens_cpu:
            starts.append(total)
            total += q_len
        decode = [b for b, q_len in enumerate(q_lens_cpu) if q_len == 1]
        extend = [b for b, q_len in enumerate(q_lens_cpu) if q_len > 1]
        rows = None
        if self.row_invariant and self.in_place_decode:
            return TorchPagedMetadata(out_slots=info.out_slots, groups=[[] for _ in self.windows],
                                      decode=_every_query_a_row(info, starts))
        if decode and self.in_place_decode:
            rows = DecodeRows(table=info.token_table, tokens=torch.tensor([starts[b] for b in decode]),
                              rows=info.req_rows[torch.tensor(decode)],
                              kv_lens=torch.tensor([info.kv_lens_cpu[b] for b in decode]))
            decode = []
        groups = [[self._group(members, info, starts, window) for members in (decode, extend) if members]
                  for window in self.windows]
        return TorchPagedMetadata(out_slots=info.out_slots, groups=groups, decode=rows)

    def _group(self, members: list[int], info: ForwardInfo, starts: list[int], window: int | None) -> PaddedGroup:
        """One padded row per segment: a request's queries, or with a window a chunk of `window` of them (the
        keys a chunk sees span at most its queries plus `window - 1` before them)."""
        # Index math runs on the host (nonzero() would sync a GPU), then moves to the pool's device once.
        segments = [(b, q0, min(window or q_len, q_len - q0)) for b in members
                    for q_len in (info.q_lens_cpu[b],) for q0 in range(0, q_len, window or q_len)]
        member, q0, q_n = (torch.tensor(column) for column in zip(*segments))
        pos0 = torch.tensor([info.kv_lens_cpu[b] - info.q_lens_cpu[b] for b in member.tolist()]) + q0
        key_end = pos0 + q_n  # keys [key_start, key_end) hold every key the segment's queries may see
        key_start = (pos0 - window + 1).clamp(min=0) if window else torch.zeros_like(pos0)
        max_q, max_kv = int(q_n.max()), int((key_end - key_start).max())
        i = torch.minimum(torch.arange(max_q)[None, :], q_n[:, None] - 1)  # padding repeats the last query
        q_index = torch.tensor([starts[b] for b in member.tolist()])[:, None] + q0[:, None] + i  # [S, max_q]
        src = (torch.arange(max_q)[None, :] < q_n[:, None]).flatten().nonzero().squeeze(1)  # [Tg]
        dst = q_index.flatten()[src]
        q_pos = (pos0[:, None] + i)[:, :, None]  # [S, max_q, 1]
        k_pos = (key_start[:, None] + torch.arange(max_kv))[:, None, :]  # [S, 1, max_kv]
        mask = (k_pos <= q_pos) & (k_pos < key_end[:, None, None])
        if window:
            mask &= k_pos > q_pos - window
        device = info.out_slots.device
        rows = info.req_rows[to_device(member.tolist(), device)]
        if window:
            cols = host_to_device(k_pos[:, 0].clamp(max=info.token_table.shape[1] - 1), device)
            kv_slots = info.token_table[rows[:, None], cols]
        else:
            kv_slots = info.token_table[rows, :max_kv]
        return PaddedGroup(
            q_index=host_to_device(q_index, device),
            kv_slots=kv_slots,
            mask=host_to_device(mask.repeat(1, self.rep, 1).unsqueeze(1), device),
            src=host_to_device(src, device),
            dst=host_to_device(dst, device),
        )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, meta: AttentionMetadata
    ) -> torch.Tensor:
        if isinstance(meta, TorchGraphMetadata):
            return self._forward_graph(q, k, v, layer, meta)
        assert isinstance(meta, TorchPagedMetadata)
        self.store_kv(k, v, layer, meta)
        out = torch.empty_like(q)  # [T, H, D]
        k_layer, v_layer = self.k_pool[layer], self.v_pool[layer]
        spec = self.layers[layer]
        d = meta.decode
        if d is not None:
            from ringserve.kernels.cpu import paged_decode_attention

            out.index_copy_(0, d.tokens, paged_decode_attention(q[d.tokens], k_layer, v_layer, d.table, d.rows,
                                                                d.kv_lens, spec.scale, spec.window or 0,
                                                                spec.soft_cap or 0.0))
        for g in meta.groups[self.window_index[layer]]:
            bg, max_q = g.q_index.shape
            qg = q[g.q_index].permute(0, 2, 1, 3)  # [Bg, H, max_q, D]
            qg = qg.reshape(bg, self.num_kv_heads, self.rep * max_q, self.head_dim)
            kg = k_layer[g.kv_slots].transpose(1, 2)  # [Bg, Hkv, max_kv, D]
            vg = v_layer[g.kv_slots].transpose(1, 2)
            og = attend(qg, kg, vg, g.mask, spec.scale, spec.soft_cap)
            og = og.reshape(bg, self.num_heads, max_q, self.head_dim).transpose(1, 2)  # [Bg, max_q, H, D]
            out.index_copy_(0, g.dst, og.reshape(bg * max_q, self.num_heads, self.head_dim)[g.src])
        return out

    def _forward_graph(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, meta: TorchGraphMetadata
    ) -> torch.Tensor:
        """Decode over static buffers: one query per row, read in place by the CPU kernel, or with keys gathered
        over the table's full width (a windowed layer: its window)."""
        self.store_kv(k, v, layer, meta)
        spec = self.layers[layer]
        if meta.rows is not None:
            return torch.ops.ringserve_cpu.paged_decode_attention.default(
                q, self.k_pool[layer], self.v_pool[layer], meta.table, meta.rows, meta.kv_lens, spec.scale,
                spec.window or 0, spec.soft_cap or 0.0)
        bs = q.shape[0]
        slots, mask = meta.gathered[self.window_index[layer]]
        qg = q.reshape(bs, self.num_kv_heads, self.rep, self.head_dim)  # [bs, Hkv, rep, D]
        kg = self.k_pool[layer][slots].transpose(1, 2)  # [bs, Hkv, Wg, D]
        vg = self.v_pool[layer][slots].transpose(1, 2)
        og = attend(qg, kg, vg, mask, spec.scale, spec.soft_cap)
        return og.reshape(bs, self.num_heads, self.head_dim)


def _in_place_decode(k_pool: torch.Tensor) -> bool:
    """Whether decode rows run the CPU paged kernel: a float32 pool on the CPU, and the C++ kernels built."""
    if k_pool.device.type != "cpu" or k_pool.dtype != torch.float32:
        return False
    from ringserve.kernels import cpu as cpu_kernels

    return cpu_kernels.compiled()


def _every_query_a_row(info: ForwardInfo, starts: list[int]) -> DecodeRows:
    """Every query token of the step as a row of the paged decode kernel: query i of a request with q_len
    queries and kv_len keys sees the first kv_len - q_len + i + 1 keys (its causal prefix; the kernel applies a
    layer's window). One kernel whose rows are computed alone, so a row's attention has the same bits whether
    it is a decode, a verify or a prefill query, whatever else runs in the step."""
    tokens, table_rows, kv_lens = [], [], []
    for b, (q_len, kv_len) in enumerate(zip(info.q_lens_cpu, info.kv_lens_cpu)):
        tokens.extend(range(starts[b], starts[b] + q_len))
        table_rows.extend([b] * q_len)
        kv_lens.extend(range(kv_len - q_len + 1, kv_len + 1))
    rows = info.req_rows[torch.tensor(table_rows, device=info.req_rows.device)]
    return DecodeRows(table=info.token_table, tokens=torch.tensor(tokens), rows=rows, kv_lens=torch.tensor(kv_lens))
