"""OpenAI's `POST /v1/embeddings`, from the served model itself.

Each input (a string, token ids, or a list of either) runs through the ring as an embedding request
(`GenerateRequest.embed`, nothing generated): the scheduler prefills it beside generation and answers with the
pooled final-norm hidden state of its prompt (actors/engine/core/embedding.py). Here only shapes are
checked and the vector is shaped for the client: `dimensions` keeps its first d components (re-normalised
when `normalize`), `encoding_format` base64 sends the little-endian float32 bytes OpenAI's client decodes.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ringserve.actors.entry.openai import protocol as oai
from ringserve.actors.entry.http_common import handles_errors, read_json
from ringserve.actors.entry.request_flow import EntryService
from ringserve.bus.errors import ApiError, quote
from ringserve.bus.messages import GenerateRequest, RequestOutput
from ringserve.bus.param_spec import Spec
from ringserve.bus.params import EMBED_SPECS, EmbedParams
from ringserve.bus.subjects import new_rid

EMBEDDINGS_PATH = "/v1/embeddings"
ENCODING_FORMAT = Spec("float: a list of numbers; base64: the vector's little-endian float32 bytes, base64-encoded",
                       kind="string", name="encoding_format", choices=("float", "base64"))
DIMENSIONS = Spec("keep the first d components (re-normalised to unit length unless normalize is false)",
                  kind="integer", name="dimensions", low=1)
USER = Spec("an end-user id (accepted; no effect)", kind="string", name="user")
FIELDS = {"input", "model", ENCODING_FORMAT.name, DIMENSIONS.name, USER.name, *EMBED_SPECS}


def parse_embeddings(body: dict[str, Any], rid: str, served_model: str) -> tuple[list[GenerateRequest], str, int | None]:
    """A /v1/embeddings body as one embedding request per input (rids `{rid}-{i}`), the encoding format and
    `dimensions`; ApiError 400 naming the field that is wrong. A `model` naming a LoRA adapter embeds with it."""
    unknown = sorted(str(name) for name in set(body) - FIELDS)
    if unknown:
        raise ApiError(f"Unrecognized request argument supplied: {quote(unknown[0])}", param=unknown[0])
    lora_name = oai.adapter_of(body.get("model"), served_model)
    if body.get("input") is None:
        raise ApiError("input is required", param="input")
    inputs = oai.prompt_forms(body["input"], "input")
    if any(p == "" for p in inputs):
        raise ApiError("input must not contain an empty string", param="input")
    if len(inputs) > oai.MAX_CHOICES:
        raise ApiError(f"input holds {len(inputs)} inputs; at most {oai.MAX_CHOICES} per request", param="input")
    USER.read(body, None)
    embed = EmbedParams(pooling=EMBED_SPECS["pooling"].read(body, None),
                        normalize=EMBED_SPECS["normalize"].read(body, True))
    gen_reqs = [GenerateRequest(rid=f"{rid}-{i}", text=p if isinstance(p, str) else None,
                                input_ids=None if isinstance(p, str) else list(p), sampling={"max_new_tokens": 0} | ({"lora_name": lora_name} if lora_name else {}),
                                openai_names=True, stream=False, embed=embed)
                for i, p in enumerate(inputs)]
    return gen_reqs, ENCODING_FORMAT.read(body, "float"), DIMENSIONS.read(body, None)


def shaped(out: RequestOutput, dimensions: int | None, normalize: bool) -> np.ndarray:
    """The vector of a request's last output, cut to `dimensions` (and re-normalised when `normalize`); a 503
    when the request ended without one (aborted by an operator or a shutdown)."""
    if out.error is not None:
        raise out.error
    if not out.embedding:
        why = out.finish.type if out.finish is not None else "no finish"
        raise ApiError(f"the embedding request ended without its vector ({why})", 503, type="server_error")
    v = np.frombuffer(out.embedding, dtype="<f4")
    if dimensions is None:
        return v
    if dimensions > v.size:
        raise ApiError(f"dimensions must be at most the model's {v.size}, got {dimensions}", param="dimensions")
    v = v[:dimensions]
    return v / max(float(np.linalg.norm(v)), 1e-12) if normalize else v


def embedding_item(index: int, v: np.ndarray, encoding: str) -> dict[str, Any]:
    """One entry of the response's `data`."""
    value: Any = (base64.b64encode(v.astype("<f4").tobytes()).decode() if encoding == "base64"
                  else [float(x) for x in v])
    return {"object": "embedding", "index": index, "embedding": value}


def embeddings_route(service: EntryService) -> Route:
    """`POST /v1/embeddings` over `service`."""

    async def answer(request: Request) -> Response:
        body = await read_json(request)
        gen_reqs, encoding, dimensions = parse_embeddings(body, new_rid(), service.served_model)
        lora_name = gen_reqs[0].sampling.get("lora_name")
        await service.require_adapter(lora_name, body.get("model"))
        try:
            started = await service.start_many(request, gen_reqs)
        except ApiError as exc:
            if exc.param in ("prompt", "text", "input_ids", "max_tokens", "max_new_tokens"):
                exc.param = "input"
            raise
        try:
            lasts: list[RequestOutput] = []
            for stream, out in started:
                while not out.is_last:
                    out = await stream.next()
                lasts.append(out)
        finally:
            await service.release_all([stream for stream, _ in started])
        normalize = gen_reqs[0].embed is not None and gen_reqs[0].embed.normalize
        data = [embedding_item(i, shaped(out, dimensions, normalize), encoding)
                for i, out in enumerate(lasts)]
        prompt_tokens = sum(out.prompt_tokens for out in lasts)
        return JSONResponse({"object": "list", "data": data, "model": body.get("model") if lora_name else service.served_model,
                             "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}})

    return Route(EMBEDDINGS_PATH, handles_errors(answer), methods=["POST"])
