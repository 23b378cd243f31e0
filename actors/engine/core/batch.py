"""What one step runs (`Batch`, decided by the scheduler side) and what the forward gives back (`ForwardOutput`)."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
import dataclasses
from dataclasses import dataclass, field

import torch

from ringserve.actors.engine.core.embed_override import EmbedOverride
from ringserve.actors.engine.core.request import Req
from ringserve.kernels.sampling import SamplingRow


@dataclass
class Batch:
    """One forward's plan, fixed before it runs; the model runner reads only this and the token table.

    Request `b` computes tokens `[starts[b], starts[b] + extend_lens[b])` of its sequence on table row
    `reqs[b].row`: their slots are already on the row of `TokenTable.table`, and their ids are on the row of
    `TokenTable.ids` by the time the step runs on the device (written at admission, or by the sampling of the
    step before, which may still be in flight). Decode rows come first (one token each), then prefill rows.
    A prefill row whose chunk does not reach the end of its sequence computes KV only; every other row
    samples one token, which the runner writes to `ids` at column `starts[b] + extend_lens[b]`.
    """

    reqs: list[Req]
    starts: list[int]
    extend_lens: list[int]
    samples: list[bool]
    num_decode: int  # the first `num_decode` rows are decode rows
    # speculative decoding: a request verifying `k` draft tokens has `k + 1` consecutive decode rows, its last
    # real token's and one per draft (each one token at the next position, on the same table row: the step
    # writes every row's K/V before any row attends, so each sees the ones before it, and the decode graphs run
    # them as they run any decode batch). Keyed by the first of those rows; {} for most batches.
    drafts: dict[int, list[int]] = field(default_factory=dict)
    # image embeddings over the prefill chunks' image tokens (scheduling/images.py), set at launch; None for most
    override: EmbedOverride | None = None

    @property
    def draft_rows(self) -> set[int]:
        """The rows that compute a draft token (each verifying request's rows but its first)."""
        return {b + 1 + i for b, drafts in self.drafts.items() for i in range(len(drafts))}

    @classmethod
    def plan(cls, decodes: list[Req], drafts: dict[Req, list[int]], prefills: list[tuple[Req, int]]) -> Batch:
        """The step of decode requests `decodes` (each with its slot allocated; `drafts`: those verifying drafts,
        their slots allocated too) and prefill chunks `prefills` (request, tokens)."""
        rows: list[Req] = []
        starts: list[int] = []
        first_rows: dict[int, list[int]] = {}
        for req in decodes:  # a verifying request: one decode row per position, from its last real token's on
            k = len(drafts.get(req, ()))
            if k:
                first_rows[len(rows)] = drafts[req]
            rows += [req] * (k + 1)
            starts += range(req.cached_len - k - 1, req.cached_len)
        reqs = rows + [req for req, _ in prefills]
        extend_lens = [1] * len(rows) + [n for _, n in prefills]
        starts += [req.cached_len - n for req, n in prefills]
        samples = [True] * len(rows) + [req.cached_len == req.device_len for req, _ in prefills]
        return cls(reqs, starts, extend_lens, samples, num_decode=len(rows), drafts=first_rows)

    @property
    def num_tokens(self) -> int:
        """Tokens computed, all rows together."""
        return sum(self.extend_lens)

    @property
    def rows(self) -> list[int]:
        """Each request's table row."""
        return [req.row for req in self.reqs]  # type: ignore[misc]  # scheduled requests hold rows

    @property
    def sampling_reqs(self) -> list[Req]:
        return [req for req, s in zip(self.reqs, self.samples) if s]

    def drafted_before(self) -> list[list[int]]:
        """For each sampling row, the draft tokens before it in its request's verify rows (mostly empty)."""
        before: list[list[int]] = [[] for s in self.samples if s]
        for b, drafts in self.drafts.items():
            for i in range(1, len(drafts) + 1):
                before[b + i] = drafts[:i]
        return before

    def sampling_rows(self) -> list[SamplingRow]:
        """Each sampling row's settings; a verifying request's rows draw the output tokens after its next one
        (draws are a pure function of seed, position and logits, so a row draws what decoding one token a step
        would draw there), penalties counting the drafts before the row in a copy of the request's counts (its
        own record only the first row's token; the engine records the others it keeps)."""
        rows = [req.sampling_row() for req in self.sampling_reqs]
        for b, drafts in self.drafts.items():  # decode rows come first and all sample: row b is sampling row b
            for i in range(1, len(drafts) + 1):
                row = rows[b + i]
                penalties = row.penalties.fork(drafts[:i]) if row.penalties is not None else None
                rows[b + i] = dataclasses.replace(row, position=row.position + i, penalties=penalties)
        return rows

    def prompt_logit_spans(self) -> list[tuple[int, int, int]]:
        """`(row b, first position, count)` for each prefill row whose computed positions score prompt tokens
        it wants logprobs of (`logprob_start_len`); empty for most batches."""
        spans = []
        for b in range(self.num_decode, len(self.reqs)):
            first, count = self.reqs[b].prompt_logit_span(self.starts[b], self.extend_lens[b])
            if count:
                spans.append((b, first, count))
        return spans


@dataclass
class ForwardOutput:
    """The tokens sampled for the batch's sampling rows (in order): on the device, and a copy on the host.

    The next step does not need these: it reads the tokens from `TokenTable.ids`, where the runner wrote them
    on the device. The host copy (what the engine applies) is complete once `copy_done` has fired (None when
    the copy was synchronous, as on a CPU). Logprob tensors are None unless some request asked for logprobs.
    """

    tokens: torch.Tensor  # [S] int64 on the device
    tokens_cpu: torch.Tensor  # [S] int64 on the host
    copy_done: torch.cuda.Event | None = None
    logprobs_cpu: torch.Tensor | None = None  # [S]
    top_ids_cpu: torch.Tensor | None = None  # [S, K]
    top_logprobs_cpu: torch.Tensor | None = None  # [S, K]
    prompt: PromptScores | None = None  # when some row scores prompt tokens (`Batch.prompt_logit_spans`)

    def wait(self) -> None:
        """Block until the host copies are complete."""
        if self.copy_done is not None:
            self.copy_done.synchronize()


@dataclass
class PromptScores:
    """Prompt tokens scored by one step, on the host: the rows of `spans` (`Batch.prompt_logit_spans`) in
    order, `count` entries each."""

    spans: list[tuple[int, int, int]]
    logprobs_cpu: torch.Tensor  # [E] float32
    ranks_cpu: torch.Tensor  # [E] int64
    top_ids_cpu: torch.Tensor | None  # [E, K]
    top_logprobs_cpu: torch.Tensor | None  # [E, K]

    def give_to(self, reqs: list[Req], wanted: Callable[[Req], bool]) -> None:
        """Add each span's scores to its request (`reqs`: the batch's), if `wanted` (still live)."""
        logprobs, ranks = self.logprobs_cpu.tolist(), self.ranks_cpu.tolist()
        top_ids = self.top_ids_cpu.tolist() if self.top_ids_cpu is not None else None
        top_lps = self.top_logprobs_cpu.tolist() if self.top_logprobs_cpu is not None else None
        at = 0
        for b, _, count in self.spans:
            req, end = reqs[b], at + count
            if req.prompt_logprobs is not None and wanted(req):
                n = req.params.top_logprobs_num
                req.prompt_logprobs.extend(logprobs[at:end], ranks[at:end],
                                           [t[:n] for t in top_ids[at:end]] if top_ids and n else [[]] * count,
                                           [t[:n] for t in top_lps[at:end]] if top_lps and n else [[]] * count)
            at = end


def rope_positions(batch: Batch) -> list[int] | None:
    """The 1-D rope position of each of `batch`'s tokens: its sequence position plus its request's M-RoPE shift
    there (that of the last image before it); None when every request's shift is 0 (every model without M-RoPE),
    the rope positions then being the positions. An image token's is overridden (`EmbedOverride.rope_positions`)."""
    if not any(req.rope_shift for req in batch.reqs):
        return None
    out: list[int] = []
    for req, start, n in zip(batch.reqs, batch.starts, batch.extend_lens):
        ends = [image.end for image in req.images]
        shifts = [0] + [image.rope_shift for image in req.images]
        if not ends or start >= ends[-1]:  # decode rows, text after the last image
            out.extend(range(start + req.rope_shift, start + n + req.rope_shift))
            continue
        out.extend(p + shifts[bisect_right(ends, p)] for p in range(start, start + n))
    return out
