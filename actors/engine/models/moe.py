"""The mixture-of-experts block: a router, routed experts and optional shared experts (Mixtral, Qwen2/3-MoE,
DeepSeek-V2/V3).

The router scores every expert per row and keeps `top_k`: a softmax with or without renormalising the kept
weights (Mixtral, Qwen), DeepSeek-V2's softmax limited to the best expert groups, or DeepSeek-V3's sigmoid with a
correction bias for the choice and groups ranked by their best two scores; then `routed_scaling_factor`. Its
math is transformers' (scores in float32).

Each expert is a `GatedMLP` of its own (HF's per-expert checkpoint layout, gate and up fused), so quantization
swaps its linears like any other (`--quantization int8/int4`: the experts' shape gets its own kernel plan) and
tensor parallelism slices every expert like a dense MLP. A step's rows are grouped by expert once (one sort) and
each selected expert runs once on its rows: a decode step of one row reads only its `top_k` experts' weights
(`moe_path` "sorted", the execution plan's choice on a CPU). Inside a compiled decode graph the routed part is one
opaque op (`torch.ops.ringserve.moe_experts`, keyed by the layer), so the graph stays whole while the expert choice
varies per step. On a GPU (`moe_path` "grouped") the experts run as two grouped GEMMs over their weights stacked
once (kernels/triton/moe_gemm.py; GPU weights are float), with no host sync, so CUDA graphs capture the block.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ringserve.actors.engine.execution_plan import MoePath
from ringserve.actors.engine.models.blocks import GatedMLP
from ringserve.actors.engine.models.spec import LayerShape, MoEShape

# Every SparseMoE by key, for the op a compiled graph calls (it takes tensors and ints, not modules).
_LAYERS: dict[int, weakref.ReferenceType[SparseMoE]] = {}
_LIBRARY = torch.library.Library("ringserve", "FRAGMENT")
_LIBRARY.define("moe_experts(Tensor x, Tensor ids, Tensor weights, int key) -> Tensor")


class Router(nn.Module):
    """Scores and picks `top_k` experts per row; `weight` `[E, C]` is HF's `gate.weight`."""

    def __init__(self, hidden: int, moe: MoEShape) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden))
        if moe.score_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(moe.num_experts))
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`x` `[T, C]` -> (weights `[T, k]` float32, expert ids `[T, k]` int64)."""
        moe = self.moe
        logits = F.linear(x.float(), self.weight.float())  # [T, E]
        scores = logits.sigmoid() if moe.scoring == "sigmoid" else logits.softmax(dim=-1)
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
        if moe.group_score is not None:
            choice = _best_groups(choice, moe)
        if moe.group_score is None and moe.scoring == "softmax":
            weights, ids = torch.topk(choice, moe.top_k, dim=-1)
        else:
            ids = torch.topk(choice, moe.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
        if moe.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if moe.scoring == "sigmoid" else 0.0))
        if moe.routed_scale != 1.0:
            weights = weights * moe.routed_scale
        return weights, ids


def _best_groups(choice: torch.Tensor, moe: MoEShape) -> torch.Tensor:
    """`choice` with the experts outside each row's `top_groups` best groups masked out (DeepSeek's group-limited
    routing: a group ranks by its best score (V2) or its best two summed (V3))."""
    grouped = choice.view(choice.shape[0], moe.num_groups, -1)
    group_scores = grouped.max(dim=-1).values if moe.group_score == "max" else grouped.topk(2, dim=-1)[0].sum(dim=-1)
    keep = torch.zeros_like(group_scores).scatter_(1, torch.topk(group_scores, moe.top_groups, dim=-1,
                                                                 sorted=False)[1], 1.0)
    mask = keep.unsqueeze(-1).expand_as(grouped).reshape_as(choice).bool()
    # V2 zeroes the other groups' softmax scores, V3 sets its choice scores to -inf: the same top-k either way
    return choice.masked_fill(~mask, float("-inf") if moe.group_score == "top2" else 0.0)


class SparseMoE(nn.Module):
    """Router, routed experts and shared experts of one layer; `forward` `[T, C]` -> `[T, C]`; `path`: how the
    routed experts run (`ExecutionPlan.moe_path`)."""

    def __init__(self, shape: LayerShape, path: MoePath = "sorted") -> None:
        super().__init__()
        moe = shape.moe
        assert moe is not None
        self.top_k = moe.top_k
        self.gate = Router(shape.hidden, moe)
        expert = dataclasses.replace(shape, intermediate=moe.inner, mlp_bias=False)
        # an entry is None where expert parallelism put that expert on another rank
        self.experts = nn.ModuleList(GatedMLP(expert) for _ in range(moe.num_experts))
        self.shared_expert = (GatedMLP(dataclasses.replace(shape, intermediate=moe.shared_inner, mlp_bias=False))
                              if moe.shared_inner else None)
        # Qwen2-MoE: sigmoid(x · w) scales the shared expert's output; a vector, not a linear quantization swaps
        self.shared_expert_gate = nn.Parameter(torch.empty(1, shape.hidden)) if moe.shared_gate else None
        # tensor parallelism: every expert holds a slice of its inner dimension, so the block's output is a
        # partial sum, reduced once here (actors/engine/parallel/tensor_parallel.py sets it)
        self.all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.activation = shape.activation
        self.grouped = path == "grouped"
        self._stacks: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # the grouped path's
        self.key = id(self)
        _LAYERS[self.key] = weakref.ref(self)
        weakref.finalize(self, _LAYERS.pop, self.key, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        if torch.compiler.is_compiling():
            out = torch.ops.ringserve.moe_experts(x, ids, weights, self.key)
        else:
            out = self.routed(x, ids, weights)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(F.linear(x, self.shared_expert_gate)) * shared
            out = out + shared
        return self.all_reduce(out) if self.all_reduce is not None else out

    def routed(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum per row: rows sorted by expert once, each chosen expert run once on
        its rows, in expert order (transformers' order of accumulation). On the grouped path (a GPU's): one grouped
        GEMM per projection over the stacked experts (no host sync, so CUDA graphs capture it)."""
        if self.grouped:
            return self._grouped(x, ids, weights)
        out = torch.zeros_like(x)
        if x.shape[0] == 1:  # a one-row decode step: its k experts directly, without the sort and gathers
            for expert, weight in sorted(zip(ids[0].tolist(), weights[0].tolist())):
                if self.experts[expert] is not None:
                    out += self.experts[expert](x) * weight
            return out
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        flat_weights = weights.reshape(-1, 1)
        start = 0
        for expert, count in enumerate(counts):
            picks = order[start:start + count]  # indices into the [T * k] choices
            start += count
            if count == 0 or self.experts[expert] is None:  # None: held by another rank (expert parallelism)
                continue
            rows = picks // self.top_k
            y = self.experts[expert](x[rows]) * flat_weights[picks].to(x.dtype)
            out.index_add_(0, rows, y)
        return out

    def _grouped(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        from ringserve.kernels.triton.moe_gemm import fused_experts

        if self._stacks is None:
            self._stacks = self._stack_experts()
        gate_up, down, local = self._stacks
        return fused_experts(x, local[ids], weights, gate_up, down, self.activation)

    def _stack_experts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's experts' weights stacked (`[E', 2I, C]`, `[E', C, I]`), each expert's parameters becoming
        views of the stacks (no second copy; an in-place weight update reaches both), and expert id -> index
        in the stacks (-1: held by another rank)."""
        held = [e for e, expert in enumerate(self.experts) if expert is not None]
        gate_up = torch.stack([self.experts[e].gate_up_proj.weight.detach() for e in held])
        down = torch.stack([self.experts[e].down_proj.weight.detach() for e in held])
        for i, e in enumerate(held):
            self.experts[e].gate_up_proj.weight = nn.Parameter(gate_up[i], requires_grad=False)
            self.experts[e].down_proj.weight = nn.Parameter(down[i], requires_grad=False)
        local = torch.full((len(self.experts),), -1, dtype=torch.int64, device=gate_up.device)
        local[held] = torch.arange(len(held), device=gate_up.device)
        return gate_up, down, local


def _moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, key: int) -> torch.Tensor:
    layer = _LAYERS[key]()
    if layer is None:
        raise RuntimeError("the mixture-of-experts layer this graph was compiled for is gone")
    return layer.routed(x, ids, weights)


_LIBRARY.impl("moe_experts", _moe_experts, "CompositeExplicitAutograd")


@torch.library.register_fake("ringserve::moe_experts")
def _moe_experts_fake(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, key: int) -> torch.Tensor:
    return torch.empty_like(x)
