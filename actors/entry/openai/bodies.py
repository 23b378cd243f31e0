"""OpenAI's response bodies for chat and completions: the whole response, its streamed chunks (the role chunk, the
usage chunk) and the usage object, shaped from the ring's outputs and a request's `ApiOptions`
(protocol.py parses the request)."""

from __future__ import annotations

from typing import Any

from ringserve.actors.entry.openai.logprobs import vllm_prompt_logprobs
from ringserve.actors.entry.openai.protocol import ApiOptions
from ringserve.actors.entry.tools.response import tool_message
from ringserve.bus.messages import FinishReason, RequestOutput, TokenLogprob


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, drafted: int = 0,
          accepted: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens` are prompt tokens served from the prefix cache. With speculative
    decoding, `completion_tokens_details` says how many draft tokens were accepted and rejected (the fields
    OpenAI's predicted outputs use)."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens,
                           "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if drafted:
        out["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                            "rejected_prediction_tokens": drafted - accepted}
    return out


def choices_usage(lasts: list[RequestOutput], n: int = 1) -> dict[str, Any]:
    """Usage of a response, given each choice's last output (prompt-major: the n choices of each prompt).

    Completion tokens add up; each prompt is counted once, and so are its cached tokens (the least any of its
    choices found cached: choices that reused a sibling's just-computed prefix do not make it cheaper).
    """
    groups = [lasts[i:i + n] for i in range(0, len(lasts), n)]
    return usage(sum(group[0].prompt_tokens for group in groups), sum(out.completion_tokens for out in lasts),
                 sum(min(out.cached_tokens for out in group) for group in groups),
                 sum(out.spec_drafted_tokens for out in lasts), sum(out.spec_accepted_tokens for out in lasts))


def running_usage(latest: dict[int, RequestOutput], n: int) -> dict[str, Any]:
    """The usage so far of a streamed response, given the newest output of each choice that has started
    (`continuous_usage_stats`): each started prompt's tokens once, the choices' completion tokens so far."""
    prompts = {index // n: out for index, out in sorted(latest.items())}
    return usage(sum(out.prompt_tokens for out in prompts.values()),
                 sum(out.completion_tokens for out in latest.values()),
                 sum(out.cached_tokens for out in prompts.values()))


def full_response(rid: str, options: ApiOptions, choices: list[list[RequestOutput]]) -> dict[str, Any]:
    """The non-streamed response body; `choices[i]` holds every output of choice i, in order."""
    body_choices = []
    for index, outputs in enumerate(choices):
        finish = outputs[-1].finish
        entries: list[TokenLogprob] = [e for out in outputs for e in options.entries(out)]
        choice: dict[str, Any] = {"index": index, "finish_reason": finish.type if finish else None,
                                  "matched_stop": finish.matched if finish else None,
                                  "logprobs": options.logprob_formatter().format(entries)}
        text = "".join(out.text for out in outputs)
        if options.kind == "chat" and options.tools is not None:
            choice["message"], choice["finish_reason"] = tool_message(options.tools, text, choice["finish_reason"])
            with_reasoning(choice["message"], outputs)
        elif options.kind == "chat":
            choice["message"] = with_reasoning({"role": "assistant", "content": text}, outputs)
        else:
            choice["text"] = options.echo_text(index) + text
            if options.prompt_logprobs:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(outputs[0].prompt_logprobs)
            if options.token_ids:
                choice["prompt_token_ids"] = outputs[0].prompt_token_ids
        if options.token_ids:
            choice["token_ids"] = [t for out in outputs for t in out.token_ids]
        body_choices.append(choice)
    body = {"id": response_id(rid, options), "object": options.object_name, "created": options.created,
            "model": options.model, "system_fingerprint": options.fingerprint, "choices": body_choices,
            "usage": choices_usage([c[-1] for c in choices], options.n)}
    if options.kind == "chat" and options.prompt_logprobs:  # vLLM: one prompt, so on the response
        body["prompt_logprobs"] = vllm_prompt_logprobs(choices[0][0].prompt_logprobs)
    if options.kind == "chat" and options.token_ids:
        body["prompt_token_ids"] = choices[0][0].prompt_token_ids
    return body


def with_reasoning(message: dict[str, Any], outputs: list[RequestOutput]) -> dict[str, Any]:
    """`message` with the choice's thinking as `reasoning_content` (vLLM's and SGLang's field), if it thought;
    its `content` is then null unless there is answer text (a choice cut off while thinking has none)."""
    reasoning = "".join(out.reasoning_text for out in outputs)
    if reasoning:
        message["content"] = message["content"] or None
        message["reasoning_content"] = reasoning
    return message


def response_id(rid: str, options: ApiOptions) -> str:
    """The response id OpenAI clients see, derived from the rid."""
    return f"{'chatcmpl' if options.kind == 'chat' else 'cmpl'}-{rid}"


def stream_chunk(rid: str, options: ApiOptions, text: str | None, finish: FinishReason | None,
                 first: bool = False, index: int = 0, logprobs: dict[str, Any] | None = None,
                 out: RequestOutput | None = None) -> dict[str, Any]:
    """One streamed chunk of choice `index`; a choice's `first` completion chunk starts with the echo. With
    return_token_ids, the chunk carries `out`'s new token ids, and a choice's first chunk the prompt's."""
    choice: dict[str, Any] = {"index": index, "finish_reason": finish.type if finish else None}
    if options.kind == "chat":
        choice["delta"] = {} if text is None else {"content": text}
    else:
        choice["text"] = (options.echo_text(index) if first else "") + (text or "")
    choice["logprobs"] = logprobs
    if options.token_ids and out is not None:
        choice["token_ids"] = out.token_ids
        if first and out.prompt_token_ids:
            choice["prompt_token_ids"] = out.prompt_token_ids
    if finish is not None:
        choice["matched_stop"] = finish.matched
    chunk: dict[str, Any] = {"id": response_id(rid, options), "object": f"{options.object_name}.chunk"
                             if options.kind == "chat" else options.object_name,
                             "created": options.created, "model": options.model,
                             "system_fingerprint": options.fingerprint, "choices": [choice]}
    if options.include_usage:
        chunk["usage"] = None
    return chunk


def reasoning_chunk(rid: str, options: ApiOptions, out: RequestOutput, index: int, logprobs: dict[str, Any] | None,
                    first: bool = False) -> dict[str, Any]:
    """The chunk of one output's thinking, `delta.reasoning_content` (never in `content`), with the output's
    logprobs and token ids (they cover its answer text too, which follows in chunks of its own)."""
    chunk = stream_chunk(rid, options, None, None, first=first, index=index, logprobs=logprobs, out=out)
    chunk["choices"][0]["delta"] = {"reasoning_content": out.reasoning_text}
    return chunk


def role_chunk(rid: str, options: ApiOptions, index: int) -> dict[str, Any]:
    """The first chunk of chat choice `index`: only the role, as OpenAI sends it (content follows)."""
    chunk = stream_chunk(rid, options, None, None, index=index)
    chunk["choices"][0]["delta"] = {"role": "assistant", "content": ""}
    return chunk


def usage_chunk(rid: str, options: ApiOptions, lasts: list[RequestOutput]) -> dict[str, Any]:
    """The last streamed chunk when stream_options.include_usage is set: no choices, only usage."""
    chunk = stream_chunk(rid, options, None, None)
    chunk["choices"] = []
    chunk["usage"] = choices_usage(lasts, options.n)
    return chunk
