"""Sampling-parameter validation and prompt encoding, as the tokenizer actor runs them."""

from __future__ import annotations

import math

import pytest

from ringserve.actors.tokenizer.validation import validate_sampling
from ringserve.bus.errors import ApiError
from ringserve.bus.messages import SamplingParams

CTX, VOCAB, EOS = 100, 1000, [2]


def check(raw: dict, prompt_tokens: int = 10) -> SamplingParams:
    return validate_sampling(raw, prompt_tokens, CTX, VOCAB, EOS)


@pytest.mark.parametrize("raw, param", [
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_k": -5}, "top_k"),
    ({"top_k": "3"}, "top_k"),
    ({"max_new_tokens": -1}, "max_tokens"),
    ({"max_new_tokens": 5.0}, "max_tokens"),
    ({"max_new_tokens": 91}, "max_tokens"),
    ({"seed": -1}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"stop": ""}, "stop"),
    ({"stop": [1, 2]}, "stop"),
    ({"stop": ["x"] * 33}, "stop"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"frobnicate": 1}, "frobnicate"),
])
def test_invalid_parameters_name_the_parameter(raw: dict, param: str) -> None:
    with pytest.raises(ApiError) as err:
        check(raw)
    assert err.value.param == param


@pytest.mark.parametrize("prompt_tokens, raw", [(CTX, {}), (CTX * 1000, {}), (CTX, {"max_new_tokens": 1}),
                                                (CTX + 1, {"max_new_tokens": 5}), (CTX + 1, {"max_new_tokens": 0})])
@pytest.mark.parametrize("field", ["messages", "prompt", "text", "input_ids", "input"])
def test_a_prompt_too_long_for_the_context_names_its_field(prompt_tokens: int, raw: dict, field: str) -> None:
    """A prompt that does not fit the context, or leaves no room for output, is the prompt's fault whatever
    max_tokens says: the error names the field it came in and says how long it is and the limit."""
    with pytest.raises(ApiError) as err:
        validate_sampling(raw, prompt_tokens, CTX, VOCAB, EOS, prompt_field=field)
    assert err.value.param == field
    assert f"{prompt_tokens} tokens" in str(err.value) and f"context length of {CTX} tokens" in str(err.value)


def test_a_prompt_that_fits_is_never_blamed() -> None:
    """Only when the prompt fits but prompt + max_tokens does not is max_tokens named; a prompt that exactly fills
    the context may still be prefilled alone (max_tokens 0, as embeddings are)."""
    with pytest.raises(ApiError) as err:
        validate_sampling({"max_new_tokens": 2}, CTX - 1, CTX, VOCAB, EOS, prompt_field="messages")
    assert err.value.param == "max_tokens" and f"{CTX - 1} in the prompt" in str(err.value)
    assert validate_sampling({"max_new_tokens": 0}, CTX, CTX, VOCAB, EOS, prompt_field="input").max_new_tokens == 0
    assert validate_sampling({}, CTX - 1, CTX, VOCAB, EOS).max_new_tokens == 1


def test_prompt_param_is_the_field_the_prompt_came_in() -> None:
    from ringserve.actors.tokenizer.validation import prompt_param
    from ringserve.bus.messages import ChatMessage, GenerateRequest
    from ringserve.bus.params import EmbedParams

    chat = [ChatMessage("user", "hi")]
    assert prompt_param(GenerateRequest(rid="r", messages=chat, openai_names=True)) == "messages"
    assert prompt_param(GenerateRequest(rid="r", text="hi", openai_names=True)) == "prompt"  # /v1/completions
    assert prompt_param(GenerateRequest(rid="r", text="hi")) == "text"  # /generate
    assert prompt_param(GenerateRequest(rid="r", input_ids=[1, 2], openai_names=True)) == "input_ids"
    assert prompt_param(GenerateRequest(rid="r", text="hi", openai_names=True, embed=EmbedParams())) == "input"


def test_defaults_and_normalisation() -> None:
    params = check({"top_k": 0, "stop": "END", "stop_token_ids": [7]})
    assert params.max_new_tokens == CTX - 10
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, -1)
    assert params.stop == ["END"] and params.stop_token_ids == [7, 2]
    assert check({"ignore_eos": True}).stop_token_ids == []
    assert check({"max_new_tokens": 90, "temperature": 0}).max_new_tokens == 90


def test_chat_template_and_prompt_forms() -> None:
    from ringserve.actors.common.model_source import load_tokenizer, resolve_model
    from ringserve.actors.common.text_tokenizer import load_text_model
    from ringserve.actors.tokenizer.prompt import PromptEncoder
    from ringserve.bus.messages import ChatMessage, GenerateRequest

    tokenizer = load_tokenizer(resolve_model("SmolLM2-135M-Instruct"))  # transformers': the expected prompts
    encoder = PromptEncoder(load_text_model(resolve_model("SmolLM2-135M-Instruct")).tokenizer)  # the actor's
    chat = GenerateRequest(rid="r", messages=[ChatMessage("user", "你好 😀")])
    expected = tokenizer.apply_chat_template([{"role": "user", "content": "你好 😀"}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
    assert encoder.encode(chat) == list(expected)
    assert encoder.encode(GenerateRequest(rid="r", input_ids=[5, 6])) == [5, 6]
    assert encoder.encode(GenerateRequest(rid="r", text="Hello")) == tokenizer.encode("Hello")
    for bad in (GenerateRequest(rid="r"), GenerateRequest(rid="r", text="a", input_ids=[1]),
                GenerateRequest(rid="r", messages=[]), GenerateRequest(rid="r", messages=[ChatMessage("robot\n", "x")]),
                GenerateRequest(rid="r", input_ids=[encoder.vocab_size]), GenerateRequest(rid="r", text="")):
        with pytest.raises(ApiError):
            encoder.encode(bad)


def test_chat_template_switches() -> None:
    from ringserve.actors.common.model_source import load_tokenizer, resolve_model
    from ringserve.actors.common.text_tokenizer import load_text_model
    from ringserve.actors.tokenizer.prompt import PromptEncoder
    from ringserve.bus.messages import ChatMessage, GenerateRequest

    tokenizer = load_tokenizer(resolve_model("SmolLM2-135M-Instruct"))  # transformers': the expected prompts
    encoder = PromptEncoder(load_text_model(resolve_model("SmolLM2-135M-Instruct")).tokenizer)  # the actor's
    turns = [ChatMessage("user", "Name a fruit."), ChatMessage("assistant", "The fruit is")]
    dicts = [{"role": m.role, "content": m.content} for m in turns]

    def template(**kw) -> list[int]:
        return tokenizer.encode(tokenizer.apply_chat_template(dicts, tokenize=False, **kw), add_special_tokens=False)

    continued = encoder.encode(GenerateRequest(rid="r", messages=turns, add_generation_prompt=False,
                                               continue_final_message=True))
    assert continued == template(add_generation_prompt=False, continue_final_message=True)
    assert tokenizer.decode(continued).endswith("<|im_start|>assistant\nThe fruit is")
    closed = encoder.encode(GenerateRequest(rid="r", messages=turns, add_generation_prompt=False))
    assert tokenizer.decode(closed).endswith("The fruit is<|im_end|>\n")
    opened = encoder.encode(GenerateRequest(rid="r", messages=turns))
    assert tokenizer.decode(opened).endswith("The fruit is<|im_end|>\n<|im_start|>assistant\n")
    user_only = [ChatMessage("user", "Hi")]
    assert tokenizer.decode(encoder.encode(GenerateRequest(rid="r", messages=user_only, add_generation_prompt=False))
                            ).endswith("Hi<|im_end|>\n")

    for bad in (GenerateRequest(rid="r", messages=turns, continue_final_message=True),  # with add_generation_prompt
                GenerateRequest(rid="r", messages=user_only, add_generation_prompt=False, continue_final_message=True),
                GenerateRequest(rid="r", text="x", add_generation_prompt=False, continue_final_message=True)):
        with pytest.raises(ApiError) as err:
            encoder.encode(bad)
        assert err.value.param == "continue_final_message"
    with pytest.raises(ApiError) as err:
        encoder.encode(GenerateRequest(rid="r", messages=turns, add_generation_prompt="no"))  # type: ignore[arg-type]
    assert err.value.param == "add_generation_prompt"


def test_model_defaults_fill_what_the_request_leaves_out() -> None:
    """generation_config.json's defaults (`--generation-config auto`): the request wins; a default length is cut
    to what the context leaves instead of refused."""
    defaults = {"temperature": 0.6, "top_k": 20, "max_new_tokens": 50}
    params = validate_sampling({}, 10, CTX, VOCAB, EOS, defaults=defaults)
    assert (params.temperature, params.top_k, params.top_p, params.max_new_tokens) == (0.6, 20, 1.0, 50)
    assert validate_sampling({}, 80, CTX, VOCAB, EOS, defaults=defaults).max_new_tokens == CTX - 80
    params = validate_sampling({"temperature": 1.0, "top_k": 0, "max_new_tokens": 90}, 10, CTX, VOCAB, EOS,
                               defaults=defaults)
    assert (params.temperature, params.top_k, params.max_new_tokens) == (1.0, -1, 90)
