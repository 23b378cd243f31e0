"""`/generate`'s `meta_info`, built from the ring's `RequestOutput`s: one definition for the HTTP route
(`generate.py`) and the Python API (`ringserve.results`).

`meta_info` holds `id`, `finish_reason` (`{"type", "matched", "error"}`, None while unfinished),
`prompt_tokens`, `completion_tokens`, `cached_tokens`; with `return_prompt_ids` the `prompt_token_ids`; with
`return_logprob` (or `top_logprobs_num`) SGLang's `input_token_logprobs`, `input_top_logprobs`,
`output_token_logprobs` and `output_top_logprobs` (`[logprob, token_id, text]` each).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from ringserve.actors.entry.openai.logprobs import finite
from ringserve.bus.messages import RequestOutput, TokenLogprob


def wants_logprobs(sampling: dict[str, Any]) -> bool:
    """Whether a request's meta_info carries logprobs (as /generate decides)."""
    return bool(sampling.get("return_logprob") or sampling.get("top_logprobs_num"))


def logprob_meta(entries: list[TokenLogprob], prompt: list[TokenLogprob]) -> dict[str, Any]:
    """SGLang's logprob fields of meta_info: `[logprob, token_id, text]` per token, and per alternative; the
    prompt's from `logprob_start_len` on (the first token's logprob null, its alternatives null)."""
    def top(e: TokenLogprob) -> list[list[Any]] | None:
        return None if e.logprob is None else [[finite(t.logprob), t.token_id, t.token] for t in e.top]

    return {"input_token_logprobs": [[finite(e.logprob), e.token_id, e.token] for e in prompt],
            "input_top_logprobs": [top(e) for e in prompt],
            "output_token_logprobs": [[finite(e.logprob), e.token_id, e.token] for e in entries],
            "output_top_logprobs": [top(e) for e in entries]}


def meta_info(rid: str, out: RequestOutput, entries: list[TokenLogprob], first: RequestOutput,
              sampling: dict[str, Any]) -> dict[str, Any]:
    """/generate's meta_info of request `rid` as of output `out`; `entries`: the logprobs to report, `first`:
    the request's first output (it carries what is said of the prompt)."""
    info: dict[str, Any] = {"id": rid, "finish_reason": asdict(out.finish) if out.finish else None,
                            "prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
                            "cached_tokens": out.cached_tokens}
    if out.spec_drafted_tokens:  # speculative decoding: draft tokens verified so far, and accepted
        info.update(spec_drafted_tokens=out.spec_drafted_tokens, spec_accepted_tokens=out.spec_accepted_tokens)
    if sampling.get("return_prompt_ids") is True:
        info["prompt_token_ids"] = first.prompt_token_ids
    return {**info, **logprob_meta(entries, first.prompt_logprobs)} if wants_logprobs(sampling) else info
