"""The step plan rank 0 of a tensor-parallel group hands its followers before each forward, and its transport.

Rank 0 alone schedules (requests, prefix cache, slot allocator); a follower only runs the same forward over
its shard of the weights, with its own KV pool (its heads) addressed by the same slot indices. So all a
follower needs per step is what `ModelRunner` lays out from a `Batch`: each row's token-table row, first
position and token count and LoRA adapter (`ForwardPlan`), then one tensor: the step's input ids `[T]` and the slot-table
rows of the batch `[B, W]` (`W`: the longest sequence the step attends over). A step whose prefill reaches images
also carries their embeddings: rank 0 alone runs the vision tower and projector (every rank holds them whole), and
sends the flat token indices the embeddings replace (with the ids) and the embeddings `[n, C]` themselves (one more
broadcast); the plan says how many (`image_tokens`) and which of them attend both ways (`image_spans`), so every
rank writes the same embeddings over the same tokens. Prefix-cache reuse, chunked
prefill and retraction need nothing more: a reused prefix is slots already on the row, a freed slot is simply
never addressed again until rank 0 hands it out anew (and the forward writing it overwrites its KV).

The plan travels as msgpack (`ringserve.bus.codec`, typed, never pickle) through `dist.broadcast` on a gloo group: a
length tensor, then the bytes as a uint8 tensor. The tensor follows on the tensor group (gloo on a CPU,
NCCL on a GPU, where it never leaves the device). Rank 0 sends a `keepalive` plan while idle so a follower's
wait, bounded by the group's timeout, only expires when rank 0 is gone or stopped; `stop` ends the follower.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ringserve.bus import codec

FORWARD, KEEPALIVE, STOP = "forward", "keepalive", "stop"
PLAN_KINDS = (FORWARD, KEEPALIVE, STOP)


@dataclass
class ForwardPlan:
    """One message to the followers: a forward to run (`rows`, `starts`, `extend_lens` as in `Batch`, and the
    width `W` of the slot-table rows that follow), a keepalive, or stop."""

    kind: str
    rows: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    width: int = 0
    live: int = 0  # requests rank 0 holds: what a follower reports as its own (it drains while rank 0 does)
    # LoRA: each row's adapter (None: the base model), and `[path, version]` of those adapters (LoraPool.sync)
    lora_names: list[str | None] = field(default_factory=list)
    lora_versions: dict[str, list[Any]] = field(default_factory=dict)
    # images: how many of the step's tokens take image embeddings, and `[first, length, position]` of each run of
    # them that attends both ways (models/vision/span_attention.py `BidirectionalSpan`, its key slots left out)
    image_tokens: int = 0
    image_spans: list[list[int]] = field(default_factory=list)
    rope_floors: list[int] | None = None  # each row's Req.rope_floor, for a length-dependent rotary (models/rope.py)
    # M-RoPE (models/mrope.py): each token's rope position when some differ from its position, and the image
    # tokens' [t, h, w] positions (the override's `rope_positions`, three rows of `image_tokens`)
    rope_positions: list[int] | None = None
    image_rope: list[list[int]] | None = None

    def check(self) -> None:
        """Raise ValueError when the plan is not self-consistent (a follower must never guess)."""
        if self.kind not in PLAN_KINDS:
            raise ValueError(f"unknown plan kind {self.kind!r}; one of {list(PLAN_KINDS)}")
        if not len(self.rows) == len(self.starts) == len(self.extend_lens):
            raise ValueError(f"plan rows, starts and extend_lens differ in length: {len(self.rows)}, "
                             f"{len(self.starts)}, {len(self.extend_lens)}")
        if self.rope_floors is not None and len(self.rope_floors) != len(self.rows):
            raise ValueError(f"plan has {len(self.rope_floors)} rope floors for {len(self.rows)} rows")
        if self.rope_positions is not None and len(self.rope_positions) != self.num_tokens:
            raise ValueError(f"plan has {len(self.rope_positions)} rope positions for {self.num_tokens} tokens")
        if self.image_rope is not None and (len(self.image_rope) != 3
                                            or any(len(row) != self.image_tokens for row in self.image_rope)):
            raise ValueError(f"plan image rope positions are not 3 rows of its {self.image_tokens} image tokens")
        ends = [s + n for s, n in zip(self.starts, self.extend_lens)]
        if self.kind == FORWARD and (not self.rows or self.width < max(ends)):
            raise ValueError(f"a forward plan needs rows and a width covering them, got width {self.width}")
        if not 0 <= self.image_tokens <= self.num_tokens or any(
                len(span) != 3 or not 0 <= span[0] < span[0] + span[1] <= self.num_tokens for span in self.image_spans):
            raise ValueError(f"plan image tokens {self.image_tokens} or spans {self.image_spans} are outside the "
                             f"step's {self.num_tokens} tokens")

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)


def encode_plan(plan: ForwardPlan) -> bytes:
    """The plan as msgpack bytes."""
    return codec.encode(plan)


def decode_plan(data: bytes) -> ForwardPlan:
    """A plan from `encode_plan`'s bytes, type-checked and consistency-checked (raises ValueError)."""
    plan = codec.decode(data, ForwardPlan)
    plan.check()
    return plan


def broadcast_plan(plan: ForwardPlan | None, group: dist.ProcessGroup | None) -> ForwardPlan:
    """Send `plan` from rank 0 (which passes it) to every rank of `group` (which pass None); each gets it back.
    Two broadcasts on CPU tensors: the length, then the msgpack bytes."""
    if plan is not None:
        data = encode_plan(plan)
        length = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(length, 0, group=group)
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, group=group)
        return plan
    length = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(length, 0, group=group)
    buf = torch.empty(int(length), dtype=torch.uint8)
    dist.broadcast(buf, 0, group=group)
    return decode_plan(buf.numpy().tobytes())


def broadcast_step_tensors(plan: ForwardPlan, input_ids: torch.Tensor | None, table_rows: torch.Tensor | None,
                           group: dist.ProcessGroup | None, device: torch.device,
                           image_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """After a forward plan: the step's input ids `[T]`, slot-table rows `[B, W]` and the `plan.image_tokens`
    flat indices of the tokens taking image embeddings (int64), from rank 0 (which passes them) to the followers
    (which pass None and get them, on `device`); one broadcast of all three."""
    t, n = plan.num_tokens, plan.image_tokens
    if input_ids is None or table_rows is None:
        flat = torch.empty(t + len(plan.rows) * plan.width + n, dtype=torch.int64, device=device)
    else:
        parts = [input_ids.reshape(-1), table_rows.reshape(-1)]
        flat = torch.cat(parts + ([image_index.to(torch.int64)] if n and image_index is not None else []))
    dist.broadcast(flat, 0, group=group)
    end = t + len(plan.rows) * plan.width
    return flat[:t], flat[t:end].view(len(plan.rows), plan.width), flat[end:]


def broadcast_image_embeds(plan: ForwardPlan, embeds: torch.Tensor | None, width: int, dtype: torch.dtype,
                           group: dist.ProcessGroup | None, device: torch.device) -> torch.Tensor:
    """After the step tensors of a plan with `image_tokens`: the image embeddings `[n, width]` in `dtype`, from
    rank 0 (which passes them) to the followers (which pass None and get them, on `device`)."""
    if embeds is None:
        embeds = torch.empty(plan.image_tokens, width, dtype=dtype, device=device)
    else:
        embeds = embeds.to(device=device, dtype=dtype).contiguous()
    dist.broadcast(embeds, 0, group=group)
    return embeds
