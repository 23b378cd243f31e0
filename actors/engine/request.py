"""The engine's per-request state: tokens so far, how many of them have K/V in the pool, and its generator."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from bus.messages import SamplingParams
from kernels.sampling import SamplingRow


@dataclass(eq=False)
class Request:
    """One live request.

    The tokens to run next are always `all_ids[num_cached:]`: the whole sequence after admission or
    preemption (prompt plus any kept output), a single token while decoding. Either way the step yields
    exactly one new token, so a preempted request resumes without repeating output.
    """

    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    generator: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V sit in the pool (the first `num_cached` of the page-table row)
    row: int | None = None  # page-table row while running
    first_row_sent: bool = False

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_new(self) -> int:
        """Tokens this request feeds into the next forward."""
        return self.seq_len - self.num_cached

    def new_ids(self) -> list[int]:
        """The tokens this request feeds into the next forward."""
        if self.num_cached >= len(self.prompt_ids):
            return self.output_ids[self.num_cached - len(self.prompt_ids) :]
        return self.all_ids[self.num_cached :]

    def sampling_row(self) -> SamplingRow:
        """This request's settings in the shape `kernels.sampling` takes."""
        s = self.sampling
        return SamplingRow(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, generator=self.generator)
