"""`--stream-interval`: a request's token rows joined so that the ring carries one message per k tokens.

Every published row costs a message at each hop of the ring (scheduler -> NATS -> detokenizer -> NATS -> entry
-> client), and each hop wakes a process: on a small CPU host those wake-ups take the core a multi-threaded
decode step also needs (docs/benchmarks.md, "Fewer messages per token"). With an interval of k a request's
rows are held here and joined until they carry k tokens. What is never held: a request's first row (its time
to first token stays as it is), its final row (finish, abort, error: nothing waits at the end), and a row of a
request that produced nothing in the step just run (a pause, a retraction, a step that only prefilled
others), so a held token waits one step at most. Interval 1 (the default) publishes every row as it comes.
"""

from __future__ import annotations

import dataclasses

from bus.messages import TokenRow


def joined(held: TokenRow, row: TokenRow) -> TokenRow:
    """`held` followed by `row`, the next row of the same request: one row with the tokens of both.

    Fields only a first row carries (`decode`, `queue_time`, the prompt's ids and logprobs, `traceparent`)
    come from `held`, counts and the finish from `row`."""
    return dataclasses.replace(
        held, token_ids=held.token_ids + row.token_ids, completion_tokens=row.completion_tokens,
        prompt_tokens=row.prompt_tokens, cached_tokens=row.cached_tokens, finish=row.finish,
        logprobs=held.logprobs + row.logprobs, top_ids=held.top_ids + row.top_ids,
        top_logprobs=held.top_logprobs + row.top_logprobs)


class StreamCoalescer:
    """Holds and joins the rows of live requests until each carries `interval` tokens (module docstring)."""

    def __init__(self, interval: int = 1) -> None:
        if interval < 1:
            raise ValueError(f"stream interval must be at least 1, got {interval}")
        self.interval = interval
        self._held: dict[str, TokenRow] = {}

    def __len__(self) -> int:
        """Requests with a row held."""
        return len(self._held)

    def take(self, rows: list[TokenRow], after_step: bool) -> list[TokenRow]:
        """The rows to publish now, given a step's rows (`after_step`) or rows from between steps (aborts,
        control commands: all published, each joined to what its request had held)."""
        if self.interval == 1 and not self._held:
            return rows
        out: list[TokenRow] = []
        seen: set[str] = set()
        for row in rows:
            held = self._held.pop(row.rid, None)
            if held is not None:
                row = joined(held, row)
            seen.add(row.rid)
            if not after_step or self._due(row):
                out.append(row)
            else:
                self._held[row.rid] = row
        if after_step:  # a request that produced nothing this step may produce nothing for long
            out.extend(self._held.pop(rid) for rid in [rid for rid in self._held if rid not in seen])
        return out

    def flush(self) -> list[TokenRow]:
        """Every held row (the engine has no step to run, so none would follow soon)."""
        out, self._held = list(self._held.values()), {}
        return out

    def _due(self, row: TokenRow) -> bool:
        return row.finish is not None or row.decode is not None or len(row.token_ids) >= self.interval
