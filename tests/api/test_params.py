"""The protocol's parameter declarations (bus/params.py) are the one source the validation, the OpenAI name map
and the OpenAPI schema follow: checked here for every declared parameter, not a hand-picked few."""

from __future__ import annotations

import dataclasses

import pytest

from ringserve.actors.entry.openai.protocol import parse_chat
from ringserve.actors.entry.openapi.document import openapi_document
from ringserve.actors.tokenizer.validation import validate_sampling
from ringserve.bus.codec import decode, encode
from ringserve.bus.errors import ApiError
from ringserve.bus.messages import TokenizedRequest
from ringserve.bus.params import SPECS, SamplingParams, default_of, openai_names

CTX, VOCAB, EOS = 100, 1000, [2]
RANGED = [spec for spec in SPECS.values() if spec.kind in ("integer", "number")]


def check(raw: dict) -> SamplingParams:
    return validate_sampling(raw, 10, CTX, VOCAB, EOS)


def test_every_field_is_declared_with_a_doc() -> None:
    assert [f.name for f in dataclasses.fields(SamplingParams)] == list(SPECS)
    assert all(spec.doc for spec in SPECS.values())


@pytest.mark.parametrize("spec", RANGED, ids=lambda s: s.name)
def test_validation_follows_each_declared_range(spec) -> None:
    if spec.low is not None:
        below = spec.low - 1
        with pytest.raises(ApiError) as err:
            check({spec.name: below})
        assert err.value.param == spec.error_name and err.value.code == 400
        if not spec.low_open and spec.name != "max_new_tokens":
            assert getattr(check({spec.name: spec.low}), spec.name) in (spec.low, -1)  # top_k's low is "off"
    if spec.high is not None:
        with pytest.raises(ApiError) as err:
            check({spec.name: spec.high + 1})
        assert err.value.param == spec.error_name
        if spec.name != "min_new_tokens":
            assert getattr(check({spec.name: spec.high}), spec.name) == spec.high
    with pytest.raises(ApiError):
        check({spec.name: "1"})


def test_defaults_come_from_the_declaration() -> None:
    params = check({})
    for name in SPECS:
        if name not in ("max_new_tokens", "stop_token_ids", "seed"):
            assert getattr(params, name) == default_of(name), name
    assert params.stop_token_ids == EOS and params.seed is None


def test_openapi_schema_has_every_parameter_with_its_range() -> None:
    schemas = openapi_document()["components"]["schemas"]
    native = schemas["GenerateRequest"]["properties"]["sampling_params"]["properties"]
    assert set(native) == set(SPECS) | {"n"}  # n: the entry runs the samples (ChoiceGroup)
    chat = schemas["ChatCompletionRequest"]["properties"]
    for alias, name in openai_names().items():
        assert chat[alias] == SPECS[name].json_schema()
    top_p = native["top_p"]
    assert (top_p["exclusiveMinimum"], top_p["maximum"]) == (0, 1)
    assert "maximum" not in native["temperature"]  # validation accepts any temperature >= 0


def test_openai_names_map_to_native_sampling_names() -> None:
    gen_req, _ = parse_chat({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "min_tokens": 1,
                             "presence_penalty": 0.5, "ignore_eos": True}, "r", "m")
    assert gen_req.sampling == {"max_new_tokens": 5, "min_new_tokens": 1, "presence_penalty": 0.5,
                                "ignore_eos": True}
    params = check(gen_req.sampling)
    assert (params.max_new_tokens, params.presence_penalty, params.stop_token_ids) == (5, 0.5, [])


def test_validated_params_are_the_wire_struct() -> None:
    params = check({"max_new_tokens": 7, "logit_bias": {"5": 1.5}, "stop": "x", "seed": 3})
    req = TokenizedRequest("r", [1, 2], params)
    assert decode(encode(req), TokenizedRequest) == req


def test_errors_name_every_bad_logit_bias_key_and_token_id() -> None:
    with pytest.raises(ApiError) as err:
        check({"logit_bias": {"5": 1, "²": 1, "1000": 2, "-3": 1}})
    assert all(k in err.value.message for k in ("'²'", "'1000'", "'-3'")) and "'5'" not in err.value.message
    assert err.value.param == "logit_bias"
    with pytest.raises(ApiError) as err:
        check({"stop_token_ids": [1, 1000, 2, 5000]})
    assert "1000" in err.value.message and "5000" in err.value.message and err.value.param == "stop_token_ids"
