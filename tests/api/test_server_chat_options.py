"""Chat conformance against the real ring: vLLM's `continue_final_message` / `add_generation_prompt`, and
logprob `bytes` that are each token's raw bytes (a character split over tokens reassembles from them)."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.server_helpers import ServerHandle

MODEL = "SmolLM2-135M-Instruct"
PARTIAL = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "The best fruit is"}]


@pytest.fixture(scope="module")
def client(smollm_server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{smollm_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from ringserve.actors.common.model_source import load_tokenizer, resolve_model
    return load_tokenizer(resolve_model(MODEL))


def _template_ids(tokenizer: Any, messages: list[dict], **switches: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, **switches)
    return tokenizer.encode(text, add_special_tokens=False)


def _generate(server: ServerHandle, input_ids: list[int], max_new_tokens: int) -> dict:
    reply = httpx.post(f"{server.base_url}/generate", timeout=120, json={
        "input_ids": input_ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}})
    assert reply.status_code == 200, reply.text
    return reply.json()


@pytest.mark.parametrize("switches", [{"continue_final_message": True, "add_generation_prompt": False},
                                      {"add_generation_prompt": False}])
def test_template_switches_match_the_template_text(client: openai.OpenAI, smollm_server: ServerHandle,
                                                   tokenizer: Any, switches: dict) -> None:
    ids = _template_ids(tokenizer, PARTIAL, **switches)
    text = tokenizer.decode(ids)
    if switches.get("continue_final_message"):  # no end of turn, no new assistant header: the text goes on
        assert text.endswith("<|im_start|>assistant\nThe best fruit is")
    else:
        assert text.endswith("The best fruit is<|im_end|>\n")
    reply = client.chat.completions.create(model=MODEL, messages=PARTIAL, temperature=0, max_tokens=12,
                                           extra_body=switches)
    assert reply.usage.prompt_tokens == len(ids)
    native = _generate(smollm_server, ids, 12)
    assert reply.choices[0].message.content == native["text"]
    assert reply.usage.completion_tokens == native["meta_info"]["completion_tokens"]


def test_continuing_differs_from_a_new_turn(client: openai.OpenAI, tokenizer: Any) -> None:
    new_turn = client.chat.completions.create(model=MODEL, messages=PARTIAL, temperature=0, max_tokens=4)
    assert new_turn.usage.prompt_tokens == len(_template_ids(tokenizer, PARTIAL, add_generation_prompt=True))
    continued = client.chat.completions.create(model=MODEL, messages=PARTIAL, temperature=0, max_tokens=4,
                                               extra_body={"continue_final_message": True,
                                                           "add_generation_prompt": False})
    assert continued.usage.prompt_tokens < new_turn.usage.prompt_tokens


@pytest.mark.parametrize("messages, switches", [
    (PARTIAL, {"continue_final_message": True}),  # add_generation_prompt defaults to true
    (PARTIAL, {"continue_final_message": True, "add_generation_prompt": True}),
    (PARTIAL[:1], {"continue_final_message": True, "add_generation_prompt": False}),  # last message: the user's
    (PARTIAL, {"continue_final_message": "yes"}),
])
def test_invalid_switches_are_a_400_naming_continue_final_message(client: openai.OpenAI, messages: list,
                                                                  switches: dict) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, extra_body=switches)
    assert err.value.body["param"] == "continue_final_message"


def test_add_generation_prompt_must_be_a_boolean(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=PARTIAL, max_tokens=1,
                                       extra_body={"add_generation_prompt": 1})
    assert err.value.body["param"] == "add_generation_prompt"


def _joined_bytes(choice: Any) -> bytes:
    entries = list(choice.logprobs.content)
    if choice.finish_reason == "stop":
        entries = entries[:-1]  # the stop token (EOS) has an entry, but no text
    return bytes(b for e in entries for b in e.bytes)


@pytest.mark.parametrize("stream", [False, True])
def test_logprob_bytes_reassemble_an_emoji(client: openai.OpenAI, tokenizer: Any, stream: bool) -> None:
    # continuing a run of emoji, the greedy reply repeats them: each a 4-byte character spelled by three
    # byte-level tokens, whose text alone is U+FFFD
    messages = [{"role": "user", "content": "Reply with just the emoji 😀"},
                {"role": "assistant", "content": "Sure: 😀😀"}]
    request = dict(model=MODEL, messages=messages, temperature=0, max_tokens=15, logprobs=True, top_logprobs=2,
                   extra_body={"continue_final_message": True, "add_generation_prompt": False})
    if stream:
        chunks = list(client.chat.completions.create(**request, stream=True))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][-1]
        if finish == "stop":
            entries = entries[:-1]
        joined = bytes(b for e in entries for b in e.bytes)
    else:
        choice = client.chat.completions.create(**request).choices[0]
        content, entries, joined = choice.message.content, choice.logprobs.content, _joined_bytes(choice)
    # every sent character's bytes, in order; a length finish may cut a character's last bytes off the text
    assert joined.startswith(content.encode())
    tail = joined[len(content.encode()):]
    assert len(tail) < 4 and tail.decode("utf-8", errors="ignore") == ""
    assert "😀" in content, content
    split = [e for e in entries if e.token == "\ufffd"]
    assert split, "the emoji should come as byte tokens"
    assert all(e.bytes != list("\ufffd".encode()) for e in split)
    for e in entries:
        for alt in e.top_logprobs:  # alternatives carry their raw bytes too
            assert alt.token == "\ufffd" or alt.bytes == list(alt.token.encode())
