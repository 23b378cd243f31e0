"""A base linear plus the low-rank updates of every adapter slot, batched with static shapes.

`y = base(x)`, then each token of an adapter gets its own slot's update, `y[t] += B_s (A_s x[t])` per fused
part, by the segmented (BGMV) op `kernels/lora.py` `lora_shrink_expand` (our C++ kernel on CPU, Triton on CUDA).
`A [P*S*R, in]` and `B^T [P*S*R, out]` (B stored transposed) stack `S` slots of rank up to `R` for each of the
linear's `P` fused parts (q/k/v, gate/up: an adapter on q fills q's columns of B^T only), smaller ranks
zero-padded, the adapter's scale folded into B. `slot_ids [max_tokens]` (shared by every wrapped linear,
`LoraState`) holds each token's slot, -1 for base-model tokens; the runner fills it in place before each
forward, so compiled and CUDA graphs that captured it see each step's rows. The base is whatever module ran
before (float, int8/int4/gguf kernels): the adapter runs in float on top.

No dense form remains: `((x @ A^T) * mask) @ B^T` (over the slots up to the highest in use) was slower than the
op at every shape measured on the 2-core AMD EPYC host, one thread, SmolLM2-135M's four projections at rank 16
with 8 slots: 4.7x at one token, 2.2x at 32 tokens of one slot and 9.5x over eight slots, 1.4x at 1280 tokens
of one slot and 7.6x over eight.
"""

from __future__ import annotations

import torch
from torch import nn

from ringserve.actors.engine.parallel.tensor_parallel import RowParallelLinear
from ringserve.kernels.lora import lora_shrink_expand


class LoraState:
    """What all wrapped linears share: each token's slot `slot_ids [max_tokens]` (int64, -1: the base model),
    filled per step."""

    def __init__(self, slots: int, rank: int, max_tokens: int, dtype: torch.dtype, device: torch.device) -> None:
        self.slots, self.rank, self.dtype = slots, rank, dtype
        self.slot_ids = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        # slots [0, active) hold this step's adapters: 0 on an eager step of base-model rows only, which skips the
        # op; graphs (`fixed`) always run it, as a later step replaying them may have adapter rows
        self.active = slots
        self.fixed = True


class LoraLinear(nn.Module):
    """`base` with `parts` fused parts (their output rows `part_rows`), plus the slots' adapters."""

    def __init__(self, base: nn.Module, part_rows: list[int], state: LoraState) -> None:
        super().__init__()
        self.base = base
        self.state = state
        self.part_rows = list(part_rows)
        self.in_features, self.out_features = base.in_features, base.out_features
        width = len(part_rows) * state.slots * state.rank
        dtype, device = state.dtype, state.slot_ids.device
        # not in the state dict: adapters are loaded into slots, never saved with the model
        self.register_buffer("lora_a", torch.zeros(width, self.in_features, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("lora_b_t", torch.zeros(width, self.out_features, dtype=dtype, device=device),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        state = self.state
        if state.active == 0:  # an eager step of base-model rows only
            return y
        a, b_t = self.lora_a, self.lora_b_t
        args = (x.to(a.dtype), a, b_t, state.slot_ids, state.slots, state.rank, self.part_rows)
        if y.dtype == a.dtype and y.is_contiguous():  # y is the base's fresh output: add into it
            lora_shrink_expand(y, *args)
            return y
        delta = torch.zeros(y.shape, dtype=a.dtype, device=y.device)  # a base computing in another dtype
        lora_shrink_expand(delta, *args)
        return y + delta.to(y.dtype)

    @torch.no_grad()
    def set_slot(self, slot: int, parts: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put an adapter into `slot`: `parts` maps a fused part to its `(A [r, in], B [rows, r])` (B already
        scaled); parts it does not adapt, and the rows past its rank, are zeroed."""
        rank, slots = self.state.rank, self.state.slots
        offsets = [sum(self.part_rows[:p]) for p in range(len(self.part_rows))]
        for p, rows in enumerate(self.part_rows):
            start = (p * slots + slot) * rank
            self.lora_a[start:start + rank].zero_()
            self.lora_b_t[start:start + rank].zero_()
            if p in parts:
                a, b = parts[p]
                r = a.shape[0]
                self.lora_a[start:start + r].copy_(a)
                self.lora_b_t[start:start + r, offsets[p]:offsets[p] + rows].copy_(b.T)


def local_linear(owner: nn.Module, leaf: str) -> nn.Module:
    """The module computing `owner.<leaf>`'s matmul on this rank: under tensor parallelism a row-parallel
    linear's local shard (adapted before the all-reduce that sums the ranks' partial outputs), else the linear."""
    module = getattr(owner, leaf)
    return module.linear if isinstance(module, RowParallelLinear) else module
