"""A base linear plus the low-rank updates of every adapter slot, batched with static shapes.

`y = base(x) + ((x @ A.T) * mask) @ B.T` where `A [P*S*R, in]` and `B [out, P*S*R]` stack `S` slots of rank up
to `R` for each of the linear's `P` fused parts (q/k/v, gate/up: an adapter on q fills q's rows of B only),
smaller ranks zero-padded, the adapter's scale folded into B. `mask [T, S*R]` (shared by every wrapped linear,
`LoraState`) is 1 where a token's adapter owns a slot's R columns and all zero for base-model tokens; the runner
fills it in place before each forward, so compiled and CUDA graphs that captured it see each step's rows. The
base is whatever module ran before (float, int8/int4/gguf kernels): the adapter runs in float on top.
"""

from __future__ import annotations

import torch
from torch import nn


class LoraState:
    """What all wrapped linears share: the per-token slot mask `[max_tokens, S*R]`, filled per step."""

    def __init__(self, slots: int, rank: int, max_tokens: int, dtype: torch.dtype, device: torch.device) -> None:
        self.slots, self.rank = slots, rank
        self.mask = torch.zeros(max_tokens, slots * rank, dtype=dtype, device=device)
        # slots [0, active) computed this step: all of them where graphs captured the shapes (`fixed`), else
        # only up to the highest slot the step uses (eager steps: a step of one adapter pays for one slot)
        self.active = slots
        self.fixed = True


class LoraLinear(nn.Module):
    """`base` with `parts` fused parts (their output rows `part_rows`), plus the slots' adapters."""

    def __init__(self, base: nn.Module, part_rows: list[int], state: LoraState) -> None:
        super().__init__()
        self.base = base
        self.state = state
        self.part_rows = part_rows
        self.in_features, self.out_features = base.in_features, base.out_features
        width = len(part_rows) * state.slots * state.rank
        dtype, device = state.mask.dtype, state.mask.device
        # not in the state dict: adapters are loaded into slots, never saved with the model
        self.register_buffer("lora_a", torch.zeros(width, self.in_features, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("lora_b", torch.zeros(self.out_features, width, dtype=dtype, device=device),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        state = self.state
        if state.active == 0:  # an eager step of base-model rows only
            return y
        t, parts, width = x.shape[0], len(self.part_rows), state.slots * state.rank
        a, b = self.lora_a, self.lora_b
        if state.active < state.slots:  # the leading slots of each part only
            used = state.active * state.rank
            a = a.view(parts, width, -1)[:, :used].reshape(parts * used, -1)
            b = b.view(-1, parts, width)[:, :, :used].reshape(b.shape[0], parts * used)
            width = used
        low = (x.to(a.dtype) @ a.T).view(t, parts, width) * state.mask[:t, None, :width]
        return y + (low.reshape(t, -1) @ b.T).to(y.dtype)

    @torch.no_grad()
    def set_slot(self, slot: int, parts: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put an adapter into `slot`: `parts` maps a fused part to its `(A [r, in], B [rows, r])` (B already
        scaled); parts it does not adapt, and the columns past its rank, are zeroed."""
        rank, slots = self.state.rank, self.state.slots
        offsets = [sum(self.part_rows[:p]) for p in range(len(self.part_rows))]
        for p, rows in enumerate(self.part_rows):
            cols = slice((p * slots + slot) * rank, (p * slots + slot + 1) * rank)
            self.lora_a[cols].zero_()
            self.lora_b[:, cols].zero_()
            if p in parts:
                a, b = parts[p]
                r = a.shape[0]
                self.lora_a[cols.start:cols.start + r].copy_(a)
                self.lora_b[offsets[p]:offsets[p] + rows, cols.start:cols.start + r].copy_(b)


def local_linear(owner: nn.Module, leaf: str) -> nn.Module:
    """The module computing `owner.<leaf>`'s matmul on this rank: under tensor parallelism a row-parallel
    linear's local shard (adapted before the all-reduce that sums the ranks' partial outputs), else the linear."""
    from ringserve.actors.engine.parallel.tensor_parallel import RowParallelLinear

    module = getattr(owner, leaf)
    return module.linear if isinstance(module, RowParallelLinear) else module
