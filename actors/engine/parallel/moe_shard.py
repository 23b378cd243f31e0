"""Mixture-of-experts layers over tensor-parallel ranks, two ways.

- Sliced (the default with `--tp N`): every rank holds `1/N` of every expert's inner dimension (and of the shared
  experts'), as a dense MLP is split; each rank runs the experts its rows chose on its slice, and the block's
  partial output is all-reduced once (not once per expert).
- Expert-parallel (`--ep N`, with `--tp N`): every rank holds whole experts, `E/N` of them (expert `e` on rank
  `e % N`), and the shared experts sliced. Attention stays head-sharded, so after its all-reduce every rank has
  every row; each runs its own experts on the rows routed to them and the same one all-reduce sums the block.
  The trade-off: sliced ranks all read every chosen expert (a slice each), so a step with few rows costs every
  rank `top_k` small matmuls; expert-parallel ranks read whole experts but only their own, so the work per rank
  follows how the step's rows spread over experts (bench/bench_moe.py measures both).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ringserve.actors.engine.parallel.tensor_parallel import TPGroup, shard_mlp


def shard_experts(moe: Any, group: TPGroup, expert_parallel: bool = False) -> None:
    """Keep `group.rank`'s part of `moe` (a `SparseMoE`), in place; its output is all-reduced over `group`."""
    tp, rank = group.size, group.rank
    if expert_parallel:
        if len(moe.experts) % tp:
            raise ValueError(f"--ep {tp} must divide the model's {len(moe.experts)} experts")
        moe.experts = nn.ModuleList(expert if e % tp == rank else None for e, expert in enumerate(moe.experts))
    else:
        for expert in moe.experts:
            shard_mlp(expert, group, reduce=False)
    if moe.shared_expert is not None:
        shard_mlp(moe.shared_expert, group, reduce=False)
    moe.all_reduce = group.all_reduce
