"""Tensor parallelism's rank group and the sharding of dense layers, from outside the model code (as gpt-fast's
tp.py does); model_sharding.py applies it to a whole model, each layer by its kind.

Each rank keeps `1/tp` of the attention heads and of the MLP's inner dimension: the fused `qkv_proj` and
`gate_up_proj` are column-parallel (their q, k, v and gate, up parts are sliced separately, then fused again),
`o_proj` and `down_proj` are row-parallel and followed by an all-reduce (two per layer). Embeddings, norms and
the LM head stay replicated (only rank 0 computes logits). `num_attention_heads % tp == 0` is required; the
KV heads split evenly when `tp` divides them and are replicated when `tp` is a multiple of them (each rank
keeps the one KV head its query heads read). Sharding happens before `--quantization`, so quantized layers
quantize their shard.

The group: one torch.distributed process group per replica (gloo on a CPU; NCCL for the all-reduces and the
step tensors on a GPU, plus a gloo group for the msgpack step plan, `tp_plan.py`), every collective bounded by
a short timeout. A collective that fails or times out (a rank died or hangs) marks the group broken and raises
`TPGroupError`; nothing of the group is used after that: the ranks exit and the group is restarted whole.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ringserve.actors.engine.parallel.tp_checks import DEFAULT_TIMEOUT_S


class TPGroupError(RuntimeError):
    """A collective of the tensor-parallel group failed or timed out: a rank died or hangs."""


@dataclass
class TPGroup:
    """This process's place in its replica's rank group, and the groups its collectives run on."""

    rank: int
    size: int
    device: torch.device
    tensor_group: Any = None  # all-reduces and step tensors (None: the default group)
    plan_group: Any = None  # the msgpack step plan, always gloo (None: the default group)
    broken: str | None = field(default=None)  # why the group is unusable, once a collective failed

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks in place (the row-parallel layers' partial outputs)."""
        self.collective(lambda: dist.all_reduce(x, group=self.tensor_group), "all-reduce")
        return x

    def collective(self, run: Callable[[], Any], what: str) -> Any:
        """Run one collective; a failure or timeout breaks the group and raises `TPGroupError` naming it."""
        if self.broken is not None:
            raise TPGroupError(self.broken)
        try:
            return run()
        except Exception as exc:  # gloo and NCCL raise RuntimeError subclasses of their own
            self.broken = f"tensor-parallel {what} failed on rank {self.rank} of {self.size}: {exc}"[:500]
            raise TPGroupError(self.broken) from exc


def init_group(rank: int, size: int, init_addr: str, device: str | torch.device,
               timeout_s: float = DEFAULT_TIMEOUT_S, rendezvous_timeout_s: float = 60.0) -> TPGroup:
    """Join the group of `size` ranks rendezvousing at `init_addr` (`host:port`, rank 0 listens there).

    The rendezvous may take `rendezvous_timeout_s` (ranks load their weights at different speeds); every
    collective afterwards `timeout_s`.
    """
    device = torch.device(device)
    cuda = device.type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://{init_addr}", rank=rank,
                            world_size=size, timeout=datetime.timedelta(seconds=rendezvous_timeout_s),
                            **({"device_id": device} if cuda else {}))
    timeout = datetime.timedelta(seconds=timeout_s)
    # the default group keeps the rendezvous timeout; everything that runs per step gets the short one
    tensor_group = dist.new_group(list(range(size)), timeout=timeout, backend="nccl" if cuda else "gloo")
    plan_group = dist.new_group(list(range(size)), timeout=timeout, backend="gloo") if cuda else tensor_group
    return TPGroup(rank, size, device, tensor_group, plan_group)


def close_group(group: TPGroup | None = None) -> None:
    """Leave the process group (best effort: a broken group may not tear down cleanly).

    With a healthy `group`, every rank first waits for the others on a barrier (the collective timeout): gloo
    aborts a process (`std::terminate`) whose peer tears its pairs down while it still has a receive in flight.
    """
    if not dist.is_initialized():
        return
    if group is not None and group.broken is None:
        try:
            group.collective(lambda: dist.barrier(group=group.plan_group), "leave barrier")
        except TPGroupError:
            pass
    try:
        dist.destroy_process_group()
    except Exception:
        pass


@dataclass(frozen=True)
class ShardSlice:
    """What of a linear this rank keeps, recorded on its block (`tp_shard[leaf]`; the block outlives the
    quantization that replaces the linear) for what adapts the linear from outside (LoRA): `rows`: per fused
    part, `(start, end, part size)` of its output rows; `cols`: one `(start, end, input features)`."""

    kind: str
    slices: list[tuple[int, int, int]]


class RowParallelLinear(nn.Module):
    """A linear over this rank's slice of the input features, its partial outputs summed over the ranks."""

    def __init__(self, linear: nn.Module, group: TPGroup) -> None:
        super().__init__()
        self.linear = linear  # an nn.Linear, or the QuantLinear `--quantization` makes of it
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.linear(x))


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An nn.Linear holding copies of `weight` `[out, in]` and `bias` (the full tensors can then be freed)."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.contiguous().clone(), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.contiguous().clone(), requires_grad=False)
    return linear


def column_parallel(linear: nn.Linear, parts: list[tuple[int, int]]) -> nn.Linear:
    """Output rows `[a, b)` of each part of a fused linear, fused again in the same order."""
    weight = torch.cat([linear.weight[a:b] for a, b in parts])
    bias = torch.cat([linear.bias[a:b] for a, b in parts]) if linear.bias is not None else None
    return _linear(weight, bias)


def row_parallel(linear: nn.Linear, a: int, b: int, group: TPGroup) -> RowParallelLinear:
    """Input columns `[a, b)`; the bias is added once, on rank 0, so the sum over ranks carries it once."""
    bias = linear.bias if linear.bias is not None and group.rank == 0 else None
    return RowParallelLinear(_linear(linear.weight[:, a:b], bias), group)


def local_heads(config: Any, tp: int, rank: int) -> tuple[int, int, int]:
    """(query heads, KV heads, first KV head) of `rank`: the query heads split evenly; the KV heads too when
    `tp` divides them, else each rank keeps the one KV head its query heads read (replicated over ranks)."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if kv_heads % tp == 0:
        return heads // tp, kv_heads // tp, rank * (kv_heads // tp)
    return heads // tp, 1, rank // (tp // kv_heads)


def shard_attention(attn: Any, config: Any, group: TPGroup) -> None:
    """Keep `group.rank`'s query heads and the KV heads they read: `qkv_proj` column-, `o_proj` row-parallel."""
    if getattr(attn, "norm_projection", False):
        raise ValueError("tensor parallelism does not split a q/k norm over all heads of a projection: "
                         "serve this model with --tp 1")
    hq, hkv, first_kv = local_heads(config, group.size, group.rank)
    d, q_size, kv_size = attn.head_dim, attn.q_size, attn.kv_size
    q0, kv0 = group.rank * hq * d, first_kv * d
    attn.qkv_proj = column_parallel(attn.qkv_proj, [(q0, q0 + hq * d),
                                                    (q_size + kv0, q_size + kv0 + hkv * d),
                                                    (q_size + kv_size + kv0, q_size + kv_size + kv0 + hkv * d)])
    attn.o_proj = row_parallel(attn.o_proj, q0, q0 + hq * d, group)
    attn.tp_shard = {"qkv_proj": ShardSlice("rows", [(q0, q0 + hq * d, q_size), (kv0, kv0 + hkv * d, kv_size),
                                                     (kv0, kv0 + hkv * d, kv_size)]),
                     "o_proj": ShardSlice("cols", [(q0, q0 + hq * d, q_size)])}
    attn.num_heads, attn.num_kv_heads = hq, hkv
    attn.q_size, attn.kv_size = hq * d, hkv * d


def shard_mlp(mlp: Any, group: TPGroup, reduce: bool = True) -> None:
    """Keep `group.rank`'s slice of a gated MLP's inner dimension: `gate_up_proj` column-parallel, `down_proj`
    row-parallel (all-reduced, unless `reduce` is False: a caller that sums several MLPs reduces once)."""
    inner, tp = mlp.inner, group.size
    i0, ni = group.rank * (inner // tp), inner // tp
    mlp.gate_up_proj = column_parallel(mlp.gate_up_proj, [(i0, i0 + ni), (inner + i0, inner + i0 + ni)])
    mlp.tp_shard = {"gate_up_proj": ShardSlice("rows", [(i0, i0 + ni, inner)] * 2),
                    "down_proj": ShardSlice("cols", [(i0, i0 + ni, inner)])}
    if reduce:
        mlp.down_proj = row_parallel(mlp.down_proj, i0, i0 + ni, group)
    else:
        down = mlp.down_proj
        mlp.down_proj = _linear(down.weight[:, i0:i0 + ni], down.bias if group.rank == 0 else None)
    mlp.inner = ni
