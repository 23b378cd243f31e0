"""What one step runs (`Batch`, decided by the scheduler side) and what the forward gives back (`ForwardOutput`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.engine.request import Req


@dataclass
class Batch:
    """One forward's plan, fixed before it runs; the model runner reads only this.

    Request `b` computes tokens `[starts[b], starts[b] + extend_lens[b])` of `reqs[b].ids`, whose slots are
    already on its table row. Decode rows come first (one token each), then prefill rows. A prefill row whose
    chunk does not reach the end of its sequence computes KV only; every other row samples one token.
    """

    reqs: list[Req]
    starts: list[int]
    extend_lens: list[int]
    samples: list[bool]
    input_ids: list[int]  # [T] the tokens computed, all rows concatenated
    num_decode: int  # the first `num_decode` rows are decode rows
    # overlap loop: decode row b's input token is feed[0][feed[1][b]], sampled on the device by the step still
    # in flight (its placeholder in `input_ids` is ignored)
    feed: tuple[torch.Tensor, list[int]] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def sampling_reqs(self) -> list[Req]:
        return [req for req, s in zip(self.reqs, self.samples) if s]


@dataclass
class ForwardOutput:
    """The tokens sampled for the batch's sampling rows (in order): on the device, and a copy on the host.

    The device tensor can feed the next step without a host round trip; the host copy is complete once
    `copy_done` has fired (None when the copy was synchronous, as on a CPU). Logprob tensors are None unless
    some request asked for logprobs.
    """

    tokens: torch.Tensor  # [S] int64 on the device
    tokens_cpu: torch.Tensor  # [S] int64 on the host
    copy_done: torch.cuda.Event | None = None
    logprobs_cpu: torch.Tensor | None = None  # [S]
    top_ids_cpu: torch.Tensor | None = None  # [S, K]
    top_logprobs_cpu: torch.Tensor | None = None  # [S, K]

    def wait(self) -> None:
        """Block until the host copies are complete."""
        if self.copy_done is not None:
            self.copy_done.synchronize()
