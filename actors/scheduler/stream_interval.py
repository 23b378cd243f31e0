"""`--stream-interval`: a request's token rows joined so that the ring carries one message per k tokens.

Every published row costs a message at each hop of the ring (scheduler -> NATS -> detokenizer -> NATS -> entry
-> client), and each hop wakes a process: on a small CPU host those wake-ups take the core a multi-threaded
decode step also needs (docs/benchmarks.md, "Stream interval"). With an interval of k a request's
rows are held here and joined until they carry k tokens. What is never held: a request's first row (its time
to first token stays as it is), its final row (finish, abort, error: nothing waits at the end), and a row of a
request that produced nothing in the step just run (a pause, a retraction, a step that only prefilled
others), so a held token waits one step at most. Interval 1 (the default) publishes every row as it comes.

A request whose sender reads only its whole output (`TokenizedRequest.stream` false: a non-streamed HTTP
answer) is held the same way, `WHOLE_OUTPUT_INTERVAL` tokens at a time (or the stream interval, if larger),
as SGLang holds non-streamed requests: nobody reads its tokens as they are made, so the ring need not carry
them one by one. The interval bounds what is held for it, and it still sends its first row at once.
"""

from __future__ import annotations

import dataclasses

from ringserve.bus.messages import TokenRow

WHOLE_OUTPUT_INTERVAL = 64  # tokens per published row of a request whose sender reads only the whole output


def joined(held: TokenRow, row: TokenRow) -> TokenRow:
    """`held` followed by `row`, the next row of the same request: one row with the tokens of both.

    Fields only a first row carries (`decode`, `queue_time`, the prompt's ids and logprobs, `traceparent`)
    come from `held`, counts and the finish from `row`."""
    return dataclasses.replace(
        held, token_ids=held.token_ids + row.token_ids, completion_tokens=row.completion_tokens,
        prompt_tokens=row.prompt_tokens, cached_tokens=row.cached_tokens, finish=row.finish,
        spec_drafted_tokens=row.spec_drafted_tokens, spec_accepted_tokens=row.spec_accepted_tokens,
        logprobs=held.logprobs + row.logprobs, top_ids=held.top_ids + row.top_ids,
        top_logprobs=held.top_logprobs + row.top_logprobs)


class StreamCoalescer:
    """Holds and joins the rows of live requests until each carries `interval` tokens (module docstring)."""

    def __init__(self, interval: int = 1) -> None:
        if interval < 1:
            raise ValueError(f"stream interval must be at least 1, got {interval}")
        self.interval = interval
        self._whole_interval = max(interval, WHOLE_OUTPUT_INTERVAL)
        self._held: dict[str, TokenRow] = {}
        self._whole: set[str] = set()  # live requests whose sender reads only their whole output

    def __len__(self) -> int:
        """Requests with a row held."""
        return len(self._held)

    def whole_output(self, rid: str) -> None:
        """Hold live request `rid`'s rows `WHOLE_OUTPUT_INTERVAL` tokens at a time: its sender reads only the
        whole output. Forgotten with its final row."""
        self._whole.add(rid)

    def take(self, rows: list[TokenRow], after_step: bool) -> list[TokenRow]:
        """The rows to publish now, given a step's rows (`after_step`) or rows from between steps (aborts,
        control commands: all published, each joined to what its request had held)."""
        if self.interval == 1 and not self._held and not self._whole:
            return rows
        out: list[TokenRow] = []
        seen: set[str] = set()
        for row in rows:
            held = self._held.pop(row.rid, None)
            if held is not None:
                row = joined(held, row)
            seen.add(row.rid)
            if row.finish is not None:
                self._whole.discard(row.rid)
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
        interval = self._whole_interval if row.rid in self._whole else self.interval
        return row.finish is not None or row.decode is not None or len(row.token_ids) >= interval
