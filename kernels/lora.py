"""The segmented low-rank (LoRA) matmul of a batch mixing adapters: BGMV, as in Punica and S-LoRA.

`torch.ops.ringserve.lora_shrink_expand(y, x, a, b_t, slot_ids, slots, rank, part_rows)` adds to `y`, in place,
for each token `t` whose `slot_ids[t]` is a slot `s >= 0`, the update of that slot's adapter only, per fused
part `p` of the linear: `y[t, part p] += B_{p,s} (A_{p,s} x[t])`. Rows of slot -1 (the base model) are left
as they are. The layout is `LoraLinear`'s (actors/engine/lora/lora_linear.py): `a` `[P*S*R, in]`, `b_t`
(B transposed) `[P*S*R, out]`, the `R` rows of part `p`, slot `s` at `(p*S + s)*R`; part `p`'s outputs are
`part_rows[p]` consecutive rows of `y`'s columns. `slot_ids` is int64 with at least `T` entries (the first `T`
are read: a graph captures the whole buffer, which the runner refills in place every step).

Implementations: on CPU the C++ kernel `kernels/cpu/lora_bgmv.cpp` (loaded with the other CPU kernels), on CUDA
the Triton kernels `kernels/triton/lora_bgmv.py`, and `reference_lora_shrink_expand` (tokens grouped by slot,
two matmuls per slot and part) wherever neither is there. The schema and fake are declared here, so the op
traces into `torch.compile` graphs as one opaque call.
"""

from __future__ import annotations

import importlib.util

import torch

OP = "ringserve::lora_shrink_expand"
# a fragment of the `ringserve` namespace (kernels/attention/kv_store.py defines it)
_LIBRARY = torch.library.Library("ringserve", "FRAGMENT")
# in place: `y` is the base linear's fresh output (no second [T, out] buffer, no copy of the base rows)
_LIBRARY.define("lora_shrink_expand(Tensor(a!) y, Tensor x, Tensor a, Tensor b_t, Tensor slot_ids, int slots, "
                "int rank, int[] part_rows) -> ()")


def reference_lora_shrink_expand(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor,
                                 slot_ids: torch.Tensor, slots: int, rank: int, part_rows: list[int]) -> None:
    """The op in torch: the tokens of each slot in use gathered, then `(x_s @ A_{p,s}^T) @ B_{p,s}^T` per part."""
    ids = slot_ids[:x.shape[0]]
    offsets = [sum(part_rows[:p]) for p in range(len(part_rows))]
    for s in ids.unique().tolist():
        if s < 0:
            continue
        rows = (ids == s).nonzero().squeeze(1)
        xs = x[rows].to(a.dtype)
        for p, (start, n) in enumerate(zip(offsets, part_rows)):
            c = (p * slots + s) * rank
            low = xs @ a[c:c + rank].T
            y[rows, start:start + n] += (low @ b_t[c:c + rank, start:start + n]).to(y.dtype)


_LIBRARY.impl("lora_shrink_expand", reference_lora_shrink_expand, "CompositeExplicitAutograd")


@torch.library.register_fake(OP)
def _lora_shrink_expand_fake(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor,
                             slot_ids: torch.Tensor, slots: int, rank: int, part_rows: list[int]) -> None:
    return None


def _triton_lora_shrink_expand(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor,
                               slot_ids: torch.Tensor, slots: int, rank: int, part_rows: list[int]) -> None:
    from ringserve.kernels.triton.lora_bgmv import lora_bgmv  # imports triton: only once a CUDA step needs it

    lora_bgmv(y, x, a, b_t, slot_ids, slots, rank, part_rows)


if importlib.util.find_spec("triton") is not None:  # else CUDA tensors take the reference
    _LIBRARY.impl("lora_shrink_expand", _triton_lora_shrink_expand, "CUDA")

_LOADED: set[str] = set()  # device types whose kernels were looked for


def lora_shrink_expand(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor, slot_ids: torch.Tensor,
                       slots: int, rank: int, part_rows: list[int]) -> None:
    """Add each token's own slot's low-rank update to `y` in place (the module docstring says the layout);
    inside a compiled graph too. The first eager call on CPU loads the C++ kernels (or leaves the reference to run)."""
    if x.device.type not in _LOADED and not torch.compiler.is_compiling():
        if x.device.type == "cpu":
            from ringserve.kernels.cpu import compiled

            compiled()  # loads the library, whose TORCH_LIBRARY_IMPL registers the CPU kernel
        _LOADED.add(x.device.type)
    torch.ops.ringserve.lora_shrink_expand.default(y, x, a, b_t, slot_ids, slots, rank, part_rows)
