"""The OpenAPI schema of SGLang's native `/generate` body: the sampling parameters under their native names, in
`sampling_params`, with `n`."""

from __future__ import annotations

from ringserve.actors.entry.openai.protocol import N, STREAM
from ringserve.actors.entry.openapi.parts import IMAGE_PROCESSOR_OPTIONS, IMAGE_SOURCE, RID, TOKEN_IDS
from ringserve.bus.params import PROCESSOR_KWARGS, SPECS

# sampling parameters under their native (/generate) names
_NATIVE_SAMPLING = {name: spec.json_schema() for name, spec in SPECS.items()}
GENERATE_REQUEST = {"type": "object", "properties": {
    "text": {"oneOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": {"type": "string"}}],
             "description": "a prompt, or a list of prompts (a batch: a list of results)"},
    "input_ids": {"oneOf": [{**TOKEN_IDS, "minItems": 1},
                            {"type": "array", "minItems": 1, "items": {**TOKEN_IDS, "minItems": 1}}]},
    "stream_deltas": {"type": "boolean", "description": "streamed: send only what is new in each chunk, not "
                                                          "everything so far"},
    "image_data": {"description": "a vision-language model's images: one or a list for one prompt (the text "
                                  "holds the model's image placeholder where each goes); for a batch, one entry "
                                  "per prompt", "oneOf": [
        IMAGE_SOURCE, {"type": "array", "minItems": 1, "items": {"oneOf": [
            IMAGE_SOURCE, {"type": "array", "minItems": 1, "items": IMAGE_SOURCE}, {"type": "null"}]}}]},
    PROCESSOR_KWARGS: IMAGE_PROCESSOR_OPTIONS,
    "rid": RID,
    "stream": STREAM.json_schema(),
    "return_logprob": _NATIVE_SAMPLING["return_logprob"],
    "top_logprobs_num": _NATIVE_SAMPLING["top_logprobs_num"],
    "logprob_start_len": _NATIVE_SAMPLING["logprob_start_len"],
    "sampling_params": {"type": "object", "properties": {**_NATIVE_SAMPLING, "n": N.json_schema()},
                        "additionalProperties": False}},
    "additionalProperties": False,  # native/generate.py FIELDS: any other field is a 400
    "oneOf": [{"required": ["text"]}, {"required": ["input_ids"]}]}
