"""SGLang's native `POST /generate`: one prompt or a batch (`text` or `input_ids` as a list), `n` samples of
each (`sampling_params.n`), errors under the native parameter names, and SGLang's streaming shape.

One prompt with n = 1 answers one object `{"text", "output_ids", "meta_info"}`; a batch or n > 1 answers a
flat list of them, prompt-major as SGLang orders it (result p * n + i is sample i of prompt p, run as rid
`{rid}-{p * n + i}` with seed + i; see `actors/entry/choices.py`). Streamed, every chunk carries the text and
output ids generated so far (cumulative, as SGLang clients read them), or only the new ones with
`"stream_deltas": true`; chunks of a batch or of n > 1 say which result they belong to in `index`. A top-level
field not in `FIELDS` is a 400 naming it, as OpenAI's routes answer (SGLang's fields we do not implement say why).
"""

from __future__ import annotations

import contextlib
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ringserve.actors.entry.choices import ChoiceGroup
from ringserve.actors.entry.http_common import handles_errors, read_json, sse
from ringserve.actors.entry.native.meta import meta_info
from ringserve.actors.entry.image_input import image_data_sources
from ringserve.actors.entry.field_checks import Refused, check_top_level, unrecognized
from ringserve.actors.entry.openai.protocol import MAX_CHOICES, N, STREAM
from ringserve.actors.entry.request_flow import EntryService
from ringserve.bus.errors import ApiError
from ringserve.bus.messages import GenerateRequest, RequestOutput, TokenLogprob
from ringserve.bus.param_spec import Spec
from ringserve.bus.params import PROCESSOR_KWARGS
from ringserve.bus.subjects import InvalidRidError, new_rid, validate_rid

DEFAULT_GENERATE_MAX_NEW_TOKENS = 128
# SGLang takes these next to sampling_params; here they are sampling parameters
_TOP_LEVEL_SAMPLING = ("return_logprob", "top_logprobs_num", "logprob_start_len")
STREAM_DELTAS = Spec("streamed: send only the text and output ids new in each chunk, not everything so far",
                     kind="boolean", name="stream_deltas")
# Every top-level field /generate reads (the OpenAPI GenerateRequest describes exactly these); any other is a 400
FIELDS = frozenset({"text", "input_ids", "sampling_params", "rid", STREAM.name, STREAM_DELTAS.name, "image_data",
                    PROCESSOR_KWARGS, *_TOP_LEVEL_SAMPLING})
# SGLang's GenerateReqInput fields we do not implement, refused with why (docs/api.md lists them); null is absent
REFUSED: dict[str, Refused] = {
    "lora_path": Refused("give the adapter's name as sampling_params.lora_name"),
    "lora_id": Refused("give the adapter's name as sampling_params.lora_name"),
    "return_text_in_logprobs": Refused("the logprob entries always carry the token's text", (True,)),
    "token_ids_logprob": Refused("logprobs of chosen token ids are not supported: use top_logprobs_num"),
    "return_hidden_states": Refused("hidden states are not returned (/v1/embeddings pools them)", (False,)),
    "input_embeds": Refused("prompts as embeddings are not supported: give text or input_ids"),
    "video_data": Refused("video input is not supported"),
    "audio_data": Refused("audio input is not supported"),
    "modalities": Refused("modalities are not supported: images come in image_data"),
    "session_params": Refused("sessions are not supported: send the whole prompt (the prefix cache reuses it)"),
    "custom_logit_processor": Refused("custom logit processors are not supported"),
    "data_parallel_rank": Refused("choosing the --dp replica is not supported: the router chooses it"),
    "priority": Refused("request priorities are not supported"),
    **{name: Refused("prefill/decode disaggregation is not supported")
       for name in ("bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key")},
}


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompts(body: dict[str, Any]) -> tuple[list[tuple[str | None, list[int] | None]], bool]:
    """The (text, input_ids) of every prompt, and whether the body is a batch (a list of prompts)."""
    text, input_ids = body.get("text"), body.get("input_ids")
    text_batch = isinstance(text, list)
    ids_batch = isinstance(input_ids, list) and bool(input_ids) and all(isinstance(p, list) for p in input_ids)
    if text_batch or ids_batch:
        if text is not None and input_ids is not None:
            raise ApiError("give exactly one of text or input_ids", param="input_ids")
    if text_batch:
        if not text or not all(isinstance(t, str) for t in text):
            raise ApiError("text must be a string or a non-empty list of strings", param="text")
        return [(t, None) for t in text], True
    if ids_batch:
        if not all(_is_ids(ids) for ids in input_ids):
            raise ApiError("input_ids must be a list of integers or a non-empty list of such lists",
                           param="input_ids")
        return [(None, list(ids)) for ids in input_ids], True
    if text is not None and not isinstance(text, str):
        raise ApiError("text must be a string or a non-empty list of strings", param="text")
    if input_ids is not None and not _is_ids(input_ids):
        raise ApiError("input_ids must be a list of integers or a non-empty list of such lists", param="input_ids")
    return [(text, input_ids)], False


def parse_generate(body: dict[str, Any]) -> tuple[list[GenerateRequest], int, bool]:
    """A /generate body as its prompts' GenerateRequests (all with the response's rid), n, and whether the
    answer is a list. Shapes only; the tokenizer validates the sampling values."""
    check_top_level(body, FIELDS, (), REFUSED, unrecognized)
    try:
        rid = validate_rid(body["rid"]) if body.get("rid") is not None else new_rid()
    except InvalidRidError as exc:
        raise ApiError(str(exc), param="rid") from exc
    sampling = body.get("sampling_params") or {}
    if not isinstance(sampling, dict):
        raise ApiError("sampling_params must be an object", param="sampling_params")
    sampling = dict(sampling)
    n = N.read(sampling, 1)
    sampling.pop("n", None)
    sampling.setdefault("max_new_tokens", DEFAULT_GENERATE_MAX_NEW_TOKENS)
    for name in _TOP_LEVEL_SAMPLING:
        if body.get(name) is not None:
            sampling.setdefault(name, body[name])
    prompts, batch = _prompts(body)
    if len(prompts) * n > MAX_CHOICES:
        raise ApiError(f"{len(prompts)} prompts × n={n} is more than {MAX_CHOICES} results",
                       param="n" if n > 1 else ("text" if body.get("text") is not None else "input_ids"))
    stream = STREAM.read(body, False)
    images = image_data_sources(body.get("image_data"), len(prompts), batch)
    gen_reqs = [GenerateRequest(rid=rid, text=text, input_ids=ids, sampling=dict(sampling), stream=stream,
                                image_data=sources, mm_processor_kwargs=body.get(PROCESSOR_KWARGS))
                for (text, ids), sources in zip(prompts, images)]
    return gen_reqs, n, batch or n > 1


def generate_route(service: EntryService) -> Route:
    """`POST /generate` over `service`."""

    async def answer(request: Request) -> Response:
        body = await read_json(request)
        gen_reqs, n, listed = parse_generate(body)
        if service.images is not None:
            await service.images.resolve_all(gen_reqs, batch=_prompts(body)[1])
        stream = gen_reqs[0].stream
        deltas = STREAM_DELTAS.read(body, False)
        sampling = gen_reqs[0].sampling  # the choices differ only in rid and seed
        group = await ChoiceGroup.start(service, request, gen_reqs, n)
        rids = [choice.stream.rid for choice in group.choices]

        def meta(index: int, out: RequestOutput, entries: list[TokenLogprob], first: RequestOutput) -> dict[str, Any]:
            """`first`: the request's first output, which carries what is said of its prompt."""
            return meta_info(rids[index], out, entries, first, sampling)

        if not stream:
            results = [{"text": "".join(out.text for out in outputs),
                        "output_ids": [t for out in outputs for t in out.token_ids],
                        "meta_info": meta(i, outputs[-1], [e for out in outputs for e in out.logprobs],
                                          outputs[0])}
                       for i, outputs in enumerate(await group.collect(request))]
            return JSONResponse(results if listed else results[0])

        async def events() -> AsyncIterator[str]:
            texts = ["" for _ in rids]
            ids: list[list[int]] = [[] for _ in rids]
            logprobs: list[list[TokenLogprob]] = [[] for _ in rids]
            firsts: dict[int, RequestOutput] = {}
            async with contextlib.aclosing(group.merged()) as outputs:
                async for index, out in outputs:
                    if out.error is not None:
                        yield sse(out.error.body())
                        break
                    first = firsts.setdefault(index, out)
                    if deltas:
                        chunk = {"text": out.text, "output_ids": out.token_ids,
                                 "meta_info": meta(index, out, out.logprobs, out)}
                    else:
                        texts[index] += out.text
                        ids[index] += out.token_ids
                        logprobs[index] += out.logprobs
                        chunk = {"text": texts[index], "output_ids": list(ids[index]),
                                 "meta_info": meta(index, out, logprobs[index], first)}
                    if listed:
                        chunk["index"] = index
                    yield sse(chunk)
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")

    return Route("/generate", handles_errors(answer), methods=["POST"])
