"""Applying one step's sampled tokens on the host (`EngineCore.finish`): each request's token checked against
its grammar, its stop rules and jump-forward, a verify step's drafts kept or dropped, and the step's output
rows."""

from __future__ import annotations

from typing import Mapping

from ringserve.actors.engine.core.batch import Batch, ForwardOutput
from ringserve.actors.engine.core.request import Req
from ringserve.actors.engine.scheduling.grammar import GrammarManager
from ringserve.actors.engine.scheduling.jump_forward import JumpForward
from ringserve.actors.engine.scheduling.output_rows import StepLogprobs
from ringserve.actors.engine.scheduling.request_ends import RequestEnds
from ringserve.actors.engine.scheduling.stop_checker import StopChecker
from ringserve.actors.engine.speculative.verify_step import SpeculativeSteps
from ringserve.bus.messages import FinishReason, TokenRow


class StepFinish:
    """Turns a launched step's output into its rows, ending the requests it finished."""

    def __init__(self, live: Mapping[str, Req], grammars: GrammarManager, stop_checker: StopChecker,
                 jumper: JumpForward | None, speculation: SpeculativeSteps | None, ends: RequestEnds) -> None:
        """`live`: the engine's live requests by rid (a token for a request no longer live is dropped)."""
        self.live, self.grammars, self.stop_checker, self.jumper = live, grammars, stop_checker, jumper
        self.speculation, self.ends = speculation, ends

    def finish(self, batch: Batch, out: ForwardOutput) -> list[TokenRow]:
        """Apply the sampled tokens: stop checks, prefix caching, freeing; the step's output rows."""
        out.wait()
        tokens = out.tokens_cpu.tolist()
        logprobs = StepLogprobs(out)
        if out.prompt is not None:
            out.prompt.give_to(batch.reqs, lambda req: self.live.get(req.rid) is req)
        draft_rows = batch.draft_rows
        rows: list[TokenRow] = []
        for k, req in enumerate(batch.sampling_reqs):
            if k in draft_rows:  # decode rows come first and all sample: sampling row k is batch row k
                continue
            # Finished by a stop at the step before (launched before that one was applied), or aborted while
            # this step was in flight: the token is one too many; the request's slots are already freed.
            if self.live.get(req.rid) is not req:
                continue
            if req.params.max_new_tokens == 0:  # the prompt is scored: nothing to generate
                self.ends.release(req)
                rows.append(self.ends.row(req, [], FinishReason("length")))
                if req.embed is not None:
                    rows[-1].embedding = req.embed.vector()
                continue
            token = tokens[k]
            if k in batch.drafts:  # the target's token at each of the request's rows
                row = self._apply_verified(req, batch.drafts[k], tokens[k:k + len(batch.drafts[k]) + 1])
                logprobs.fill(row, req, k, len(row.token_ids))
                rows.append(row)
                continue
            if not self.grammars.accept(req, token):
                rows.append(self.ends.fail(req, f"the output constraint rejected the sampled token {token}"))
                continue
            new = [token]
            req.ids.append(token)
            finish = self.stop_checker.verdict(req)
            if finish is None and self.jumper is not None:
                finish = self.jumper.apply(req, new)
            if finish is not None:
                self.ends.release(req)
            row = self.ends.row(req, new, finish)
            logprobs.fill(row, req, k)
            rows.append(row)
        return rows

    def _apply_verified(self, req: Req, drafts: list[int], drawn: list[int]) -> TokenRow:
        """A verifying request's row: the tokens its step keeps (`SpeculativeSteps.apply`)."""
        assert self.speculation is not None
        applied, finish, error = self.speculation.apply(req, drafts, drawn)
        if error is not None:
            return self.ends.fail(req, error)
        if finish is not None:
            self.ends.release(req)
        return self.ends.row(req, applied, finish)
