"""The engine's side of a verify step: drafts placed on their requests' rows before the step, and a verifying
request's tokens applied after it (actors/engine/speculative/speculator.py says what speculates and why the
output is unchanged)."""

from __future__ import annotations

from typing import Any

import torch

from ringserve.actors.engine.core.request import Req
from ringserve.actors.engine.speculative.speculator import Speculator
from ringserve.bus.messages import FinishReason


class SpeculativeSteps:
    """Places drafts (token ids and KV slots) and applies verified tokens for one engine."""

    def __init__(self, speculator: Speculator, algorithm: str, cache: Any, table: Any, grammars: Any,
                 stop_checker: Any) -> None:
        """`cache`, `table`, `grammars`, `stop_checker`: the engine's `CacheManager`, `TokenTable`,
        `GrammarManager` and `StopChecker`."""
        self.speculator = speculator
        self.algorithm = algorithm
        self.cache, self.table, self.grammars, self.stop_checker = cache, table, grammars, stop_checker

    def draft(self, decodes: list[Req], context_length: int, room: int) -> dict[Req, list[int]]:
        """Drafts for the decode rows that speculate (at most `room` KV slots in all), written after each one's
        last token: ids on its table row, slots allocated. A constrained request's stop where its grammar refuses."""
        drafts = self.speculator.propose(decodes, context_length, room)
        for req in [r for r in drafts if r.matcher is not None]:
            drafts[req] = self.grammars.valid_prefix(req, drafts[req])
            if not drafts[req]:
                del drafts[req]
        for req, tokens in drafts.items():
            self.table.write_ids_at(req.row, req.device_len, tokens)
            self.cache.extend(req, len(tokens))
        return drafts

    def apply(self, req: Req, drafts: list[int], drawn: list[int]) -> tuple[list[int], FinishReason | None,
                                                                           str | None]:
        """Apply a verifying request's step: its accepted drafts and the token drawn where they part, each
        through the grammar and the stop checks; the KV of the positions not kept is freed (it never reaches the
        prefix cache). `drawn`: the token each of its rows drew (already after each row's position in
        `TokenTable.ids`, so the kept tokens are there). Returns (tokens applied, finish, error message)."""
        known = req.seq_len  # the rows computed positions known - 1 ... known - 1 + len(drafts)
        new = self.speculator.verify(req, drafts, drawn)
        req.spec_drafted += len(drafts)
        req.spec_accepted += len(new) - 1
        applied: list[int] = []
        finish = None
        for token in new:
            if not self.grammars.accept(req, token):  # masked by the grammar's state at its row: never expected
                return applied, None, f"the output constraint rejected the sampled token {token}"
            req.ids.append(token)
            applied.append(token)
            finish = self.stop_checker.verdict(req)
            if finish is not None:
                break
        if req.penalties is not None:  # the first row counted the first token itself
            for token in applied[1:]:
                req.penalties.record(torch.tensor([token], device=req.penalties.counts.device))
        # KV stays for the last real token and the accepted drafts that were applied; the newest token has none
        self.cache.truncate(req, known + min(len(new) - 1, len(applied) - 1))
        req.device_len = req.seq_len
        return applied, finish, None

    def report(self) -> dict[str, Any]:
        """The totals, as `SchedulerInfo` names them."""
        s = self.speculator.stats
        return {"speculative": self.algorithm, "spec_drafted_tokens": s.drafted, "spec_accepted_tokens": s.accepted,
                "spec_emitted_tokens": s.emitted, "spec_verify_rows": s.verify_rows}
