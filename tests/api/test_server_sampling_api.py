"""Sampling breadth through the OpenAI routes against the real ring: logprobs, n > 1, min_tokens, logit_bias,
penalties, and prompt tokens served from the prefix cache."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest

from tests.server_helpers import ServerHandle, server_info, sse_events, wait_until_idle

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def client(smollm_server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{smollm_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _check_chat_entries(content: list, top: int) -> None:
    for entry in content:
        assert entry.logprob <= 0
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert len(entry.top_logprobs) == top
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)


def test_chat_logprobs_non_stream_and_stream(client: openai.OpenAI) -> None:
    request = dict(model=MODEL, messages=[{"role": "user", "content": "Count from one to ten."}], max_tokens=6,
                   temperature=0, logprobs=True, top_logprobs=3)
    reply = client.chat.completions.create(**request)
    choice = reply.choices[0]
    content = choice.logprobs.content
    assert len(content) == reply.usage.completion_tokens == 6 and choice.finish_reason == "length"
    assert "".join(e.token for e in content) == choice.message.content
    _check_chat_entries(content, 3)

    chunks = list(client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(streamed) == chunks[-1].usage.completion_tokens == 6
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)
    _check_chat_entries(streamed, 3)

    plain = client.chat.completions.create(**{**request, "logprobs": None, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_chat_top_logprobs_needs_logprobs(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                       top_logprobs=2)
    assert err.value.body["param"] == "top_logprobs"


def test_completions_logprobs_shape(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0,
                                      logprobs=2)
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == reply.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 1 <= len(top) <= 2
        assert top[token] == pytest.approx(logprob, abs=1e-4) and max(top.values()) == pytest.approx(logprob, abs=1e-4)
    bare = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=2, temperature=0,
                                     logprobs=0).choices[0].logprobs
    assert len(bare.tokens) == 2 and bare.top_logprobs is None
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, logprobs=21)
    assert err.value.body["param"] == "logprobs"


def test_n_choices_with_seed_are_reproducible_and_differ(client: openai.OpenAI) -> None:
    def sample(n: int) -> openai.types.chat.ChatCompletion:
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Name an animal."}], n=n, seed=7, temperature=1.0,
            max_tokens=8, extra_body={"ignore_eos": True})

    first = sample(3)
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.message.content for c in first.choices]
    assert [c.message.content for c in sample(3).choices] == texts
    assert len(set(texts)) > 1
    single = sample(1)
    assert first.usage.completion_tokens == 24 and first.usage.prompt_tokens == single.usage.prompt_tokens
    assert single.choices[0].message.content == texts[0]  # choice i samples with seed + i
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=17)
    assert err.value.body["param"] == "n"


def test_n_streaming_merges_choices(smollm_server: ServerHandle, client: openai.OpenAI) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 5, "n": 2, "temperature": 1.0, "seed": 3,
            "ignore_eos": True}
    with httpx.stream("POST", smollm_server.base_url + "/v1/completions", timeout=120,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as response:
        events = list(sse_events(response))
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [e for e in events[:-1] if e["choices"]]
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1}
    finishes = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(finishes) == [0, 1]
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 10
    streamed = ["".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i) for i in (0, 1)]
    whole = client.completions.create(model=MODEL, **{k: v for k, v in body.items() if k != "ignore_eos"},
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in whole.choices] == streamed


def test_min_tokens_holds_off_the_stop_token(client: openai.OpenAI) -> None:
    question = "Reply with one word: yes or no. Is the sky blue?"
    request = dict(model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=24, temperature=0)
    short = client.chat.completions.create(**request)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 8
    longer = client.chat.completions.create(**request, extra_body={"min_tokens": 8})
    assert longer.usage.completion_tokens >= 8


def test_logit_bias_forces_a_token(client: openai.OpenAI) -> None:
    from ringserve.actors.common.model_source import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(MODEL))
    [cat] = tokenizer.encode(" cat", add_special_tokens=False)
    reply = client.completions.create(model=MODEL, prompt="My favourite colour is", max_tokens=4, temperature=0,
                                      logit_bias={str(cat): 100})
    assert reply.choices[0].text == tokenizer.decode([cat] * 4)


def test_penalties_are_accepted_and_range_checked(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                           frequency_penalty=0.5, presence_penalty=0.5,
                                           extra_body={"repetition_penalty": 1.1, "min_p": 0.05})
    assert reply.usage.completion_tokens >= 1
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], frequency_penalty=3)
    assert err.value.body["param"] == "frequency_penalty" and "2" in err.value.body["message"]


def test_cached_prompt_tokens_are_reported(smollm_server: ServerHandle, client: openai.OpenAI) -> None:
    text = f"Session {uuid.uuid4().hex}. " + " ".join(f"item {i} is blue;" for i in range(75))
    request = dict(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=2, temperature=0)
    first = client.chat.completions.create(**request)
    assert first.usage.prompt_tokens > 300
    second = client.chat.completions.create(**request)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > first.usage.prompt_tokens_details.cached_tokens and cached >= 300
    chunks = list(client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 300
    body = {"text": text, "sampling_params": {"max_new_tokens": 1}}
    httpx.post(smollm_server.base_url + "/generate", json=body, timeout=60).raise_for_status()
    again = httpx.post(smollm_server.base_url + "/generate", json=body, timeout=60).json()
    assert again["meta_info"]["cached_tokens"] >= 300


def test_n_stream_disconnect_aborts_every_choice(smollm_server: ServerHandle) -> None:
    base = smollm_server.base_url
    body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 2000, "n": 2,
            "temperature": 0.8, "seed": 1, "ignore_eos": True, "stream": True}
    wait_until_idle(base, timeout=30)  # the session's ring: an earlier test's aborted request may still be ending
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=60) as response:
        events = sse_events(response)
        for _ in range(6):
            next(events)
        assert server_info(base)["num_running_reqs"] == 2
    info = wait_until_idle(base, timeout=10)
    assert info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0, info


def test_truncate_prompt_tokens_keeps_the_prompts_end(client: openai.OpenAI) -> None:
    prompt = "one two three four five six seven eight nine ten"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 3})
    assert full.usage.prompt_tokens > 3 and cut.usage.prompt_tokens == 3
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"truncate_prompt_tokens": 0})
    assert err.value.body["param"] == "truncate_prompt_tokens"
