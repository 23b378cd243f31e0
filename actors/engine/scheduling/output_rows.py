"""The wire rows the engine emits for a request: what a step sampled for it, or how it ended."""

from __future__ import annotations

from ringserve.actors.engine.core.batch import ForwardOutput
from ringserve.actors.engine.core.request import Req
from ringserve.bus.messages import FinishReason, TokenRow


def output_row(req: Req, token_ids: list[int], finish: FinishReason | None) -> TokenRow:
    """`req`'s row for `token_ids` (its first row also carries its decode settings and reasoning plan, queue
    time and, where asked or scored, its prompt ids and prompt logprobs). Marks the first row sent."""
    first = not req.first_row_sent
    req.first_row_sent = True
    row = TokenRow(rid=req.rid, token_ids=token_ids, prompt_tokens=req.prompt_len,
                   completion_tokens=req.output_len, cached_tokens=req.cached_tokens, finish=finish,
                   decode=req.params.decode_params(req.reasoning) if first else None,
                   queue_time=req.queue_time if first else None, spec_drafted_tokens=req.spec_drafted,
                   spec_accepted_tokens=req.spec_accepted)
    scored = req.prompt_logprobs
    complete = scored is not None and scored.complete(req.prompt_len)
    if first and (req.params.return_prompt_ids or complete):
        row.prompt_ids = req.ids[: req.prompt_len]
    if first and complete:
        scored.fill(row)  # type: ignore[union-attr]
    return row


class StepLogprobs:
    """One step's sampled logprobs on the host (copied once), handed out per sampled request."""

    def __init__(self, out: ForwardOutput) -> None:
        self._logprobs = out.logprobs_cpu.tolist() if out.logprobs_cpu is not None else None
        self._top_ids = out.top_ids_cpu.tolist() if out.top_ids_cpu is not None else None
        self._top_lps = out.top_logprobs_cpu.tolist() if out.top_logprobs_cpu is not None else None

    def fill(self, row: TokenRow, req: Req, k: int, count: int = 1) -> None:
        """Put the logprobs of sampled tokens `k ... k + count - 1` (one request's: a verify step emits several)
        and `req`'s top alternatives on `row`, if `req` asked."""
        if self._logprobs is None or not req.params.return_logprob:
            return
        n = req.params.top_logprobs_num
        ks = range(k, k + count)
        row.logprobs = [self._logprobs[i] for i in ks]
        row.top_ids = [self._top_ids[i][:n] if self._top_ids and n else [] for i in ks]
        row.top_logprobs = [self._top_lps[i][:n] if self._top_lps and n else [] for i in ks]
