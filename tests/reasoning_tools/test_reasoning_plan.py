"""The tokenizer's side of reasoning models, through the tokenizer actor's own request path (`tokenize_request`)
on a tiny Qwen3-style model (tests/reasoning_model.py): each chat request's ReasoningPlan follows the rendered
prompt (Qwen3's `enable_thinking` switch, DeepSeek-R1's open thinking, gpt-oss's special-token markers);
`chat_template_kwargs` over `--default-chat-template-kwargs` reach the template and bad ones are 400s naming
them; the thinking budget; generation_config.json defaults filled and overridden; `--reasoning-parser auto` from
templates; the new flags' start-up errors; and one ring serving the model with `--chat-template`,
`--default-chat-template-kwargs` and its generation_config.json."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from ringserve.actors.common.model_source import resolve_model
from ringserve.actors.common.reasoning import parser_for_template
from ringserve.actors.launcher.ring import Ring, RingError, actor_specs
from ringserve.actors.launcher.serve_flags import serve_args
from ringserve.actors.tokenizer.__main__ import main as tokenizer_worker
from ringserve.actors.tokenizer.actor import TokenizerActor
from ringserve.actors.tokenizer.chat_options import ChatOptions
from ringserve.actors.tokenizer.generation_defaults import generation_defaults
from ringserve.bus.errors import ApiError
from ringserve.bus.messages import ChatMessage, GenerateRequest, TokenizedRequest
from ringserve.bus.tokenize_messages import TokenizeQuery
from tests.reasoning_model import QWEN3_TEMPLATE, save_reasoning_model
from tests.server_helpers import ServerHandle, start_server

TEMPLATES = Path(__file__).parent.parent / "chat_templates"
GENERATION_CONFIG = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "max_new_tokens": 7,
                     "repetition_penalty": 1.0, "do_sample": True, "bos_token_id": 1, "eos_token_id": 2}
IN_FORCE = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "max_new_tokens": 7}
# DeepSeek-R1's template, shortened: the thinking of earlier turns dropped, the generation prompt opening it
R1_TEMPLATE = (
    "{% set ns = namespace(system_prompt='') %}{% for message in messages %}{% if message['role'] == 'system' %}"
    "{% set ns.system_prompt = message['content'] %}{% endif %}{% endfor %}{{ bos_token }}{{ ns.system_prompt }}"
    "{% for message in messages %}{% if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{% set content = message['content'] %}{% if '</think>' in content %}"
    "{% set content = content.split('</think>')[-1] %}{% endif %}{{ '<｜Assistant｜>' + content + "
    "'<｜end▁of▁sentence｜>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<｜Assistant｜><think>\\n' }}{% endif %}")
# gpt-oss's harmony format, shortened: the answer on the final channel, the thinking on the analysis channel
HARMONY_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "<|start|>assistant<|channel|>final<|message|>{{ message['content'] }}<|end|>"
    "{% else %}<|start|>{{ message['role'] }}<|message|>{{ message['content'] }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
HARMONY_TOKENS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>"]
KWARGS_TEMPLATE = ("{% for message in messages %}{{ message['content'] }}|{% endfor %}"
                   "{{ greeting | default('none') }}|{{ style | default('none') }}")


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Qwen3-style model's tokenizer and config (no weights: the tokenizer actor needs none)."""
    return save_reasoning_model(tmp_path_factory.mktemp("qwen3-tok"), weights=False,
                                generation_config=GENERATION_CONFIG)


def actor(model: Path, **flags: Any) -> TokenizerActor:
    """A tokenizer actor over `model` with the chat flags `flags` (Python names) as `ringserve serve` parses them;
    no bus: only its request path is used."""
    options = ChatOptions.from_args(serve_args({"model": str(model), **flags}))
    return TokenizerActor(None, str(model), 1, options)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def qwen3(qwen3_dir: Path) -> TokenizerActor:
    return actor(qwen3_dir)


def chat(*texts: str, rid: str = "r", **fields: Any) -> GenerateRequest:
    """A chat request of alternating user and assistant turns."""
    turns = [ChatMessage(role="user" if i % 2 == 0 else "assistant", content=t) for i, t in enumerate(texts)]
    return GenerateRequest(rid=rid, messages=turns, **fields)


def tokenized(tokenizer: TokenizerActor, req: GenerateRequest) -> TokenizedRequest:
    """`req` through the tokenizer actor's request path, as `{ns}.req.submit` takes it."""
    return asyncio.run(tokenizer.tokenize_request(req))


def budget_of(tokenizer: TokenizerActor, req: GenerateRequest) -> int | None:
    plan = tokenized(tokenizer, req).reasoning
    assert plan is not None
    return plan.budget


def rejected(tokenizer: TokenizerActor, req: GenerateRequest) -> ApiError:
    with pytest.raises(ApiError) as error:
        tokenized(tokenizer, req)
    assert error.value.code == 400
    return error.value


def prompt_text(tokenizer: TokenizerActor, req: GenerateRequest) -> str:
    return tokenizer._tokenizer.decode(tokenized(tokenizer, req).input_ids)


# --- the plan ----------------------------------------------------------------------------------------------


def test_a_thinking_prompt_gets_a_plan_and_enable_thinking_false_gets_none(qwen3: TokenizerActor) -> None:
    on = tokenized(qwen3, chat("Hi"))
    think, end = qwen3._tokenizer.convert_tokens_to_ids("<think>"), qwen3._tokenizer.convert_tokens_to_ids("</think>")
    assert on.reasoning is not None
    assert (on.reasoning.parser, on.reasoning.start, on.reasoning.end) == ("qwen3", "<think>", "</think>")
    assert (on.reasoning.start_ids, on.reasoning.end_ids) == ([think], [end])
    assert not on.reasoning.open and on.reasoning.budget is None  # Qwen3 writes <think> itself
    assert on.sampling.skip_special_tokens  # <think> is a plain added token, as in Qwen3's tokenizer
    off_request = chat("Hi", chat_template_kwargs={"enable_thinking": False})
    off = tokenized(qwen3, off_request)
    assert off.reasoning is None
    assert prompt_text(qwen3, off_request).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert off.input_ids[:len(on.input_ids)] == on.input_ids
    assert tokenized(qwen3, chat("Hi", chat_template_kwargs={"enable_thinking": True})).reasoning == on.reasoning


def test_thinking_closed_in_the_history_still_leaves_the_model_free_to_think(qwen3: TokenizerActor) -> None:
    """A tool loop: the assistant's thinking after the last user turn stays in the prompt, closed, and the next
    turn may think again; the history's closed thinking is not the template turning it off."""
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    turns = [ChatMessage("user", "Weather in Paris?"),
             ChatMessage("assistant", "<think>\nI should call the tool.\n</think>\n\n", tool_calls=[call]),
             ChatMessage("tool", "sunny", tool_call_id="c1")]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    req = GenerateRequest(rid="r", messages=turns, tools=tools)
    text = prompt_text(qwen3, req)
    assert "<think>\nI should call the tool.\n</think>\n\n<tool_call>" in text and "<tools>" in text
    plan = tokenized(qwen3, req).reasoning
    assert plan is not None and not plan.open


def test_a_template_that_opens_the_thinking_gives_an_open_plan(qwen3_dir: Path, tmp_path: Path) -> None:
    template = tmp_path / "r1.jinja"
    template.write_text(R1_TEMPLATE)
    r1 = actor(qwen3_dir, chat_template=str(template), reasoning_parser="deepseek_r1")
    plan = tokenized(r1, chat("2+2?", "<think>\nadd\n</think>\n\n4", "and 3+3?")).reasoning
    assert plan is not None and plan.open and plan.parser == "deepseek_r1"
    assert prompt_text(r1, chat("Hi")).endswith("<｜User｜>Hi<｜Assistant｜><think>\n")
    assert actor(qwen3_dir, chat_template=str(template))._reasoning.name == "deepseek_r1"  # auto


def test_special_token_markers_keep_special_tokens_unless_the_request_says(tmp_path: Path) -> None:
    model = save_reasoning_model(tmp_path / "harmony", weights=False, template=HARMONY_TEMPLATE,
                                 special_tokens=HARMONY_TOKENS)
    harmony = actor(model)  # auto: the template writes <|channel|>
    plan = tokenized(harmony, chat("Hi")).reasoning
    assert plan is not None and plan.parser == "gpt_oss" and not plan.open
    ids = harmony._tokenizer.encode("<|channel|>analysis<|message|>", add_special_tokens=False)
    assert plan.start_ids == ids and plan.end_ids == [harmony._tokenizer.convert_tokens_to_ids("<|end|>")]
    assert not tokenized(harmony, chat("Hi")).sampling.skip_special_tokens
    assert tokenized(harmony, chat("Hi", sampling={"skip_special_tokens": True})).sampling.skip_special_tokens
    assert tokenized(harmony, GenerateRequest(rid="r", text="Hi")).sampling.skip_special_tokens  # no plan


def test_prompts_that_are_not_chat_get_no_plan(qwen3: TokenizerActor) -> None:
    assert tokenized(qwen3, GenerateRequest(rid="r", text="<think>")).reasoning is None
    assert tokenized(qwen3, GenerateRequest(rid="r", input_ids=[1, 2, 3])).reasoning is None


def test_without_a_reasoning_parser_no_plan(qwen3_dir: Path) -> None:
    off = actor(qwen3_dir, reasoning_parser="none")
    assert off._reasoning.name == "none" and tokenized(off, chat("Hi")).reasoning is None


# --- the budget --------------------------------------------------------------------------------------------


def test_the_budget_is_the_requests_else_the_servers(qwen3_dir: Path, qwen3: TokenizerActor) -> None:
    budgeted = actor(qwen3_dir, reasoning_budget=64)
    assert budget_of(budgeted, chat("Hi")) == 64
    assert budget_of(budgeted, chat("Hi", sampling={"thinking_token_budget": 5})) == 5
    assert budget_of(qwen3, chat("Hi", sampling={"thinking_token_budget": 0})) == 0
    assert budget_of(qwen3, chat("Hi")) is None
    assert budget_of(actor(qwen3_dir, reasoning_budget=0), chat("Hi")) == 0


def test_a_budget_that_cannot_be_honoured_is_a_400_naming_it(qwen3_dir: Path, qwen3: TokenizerActor) -> None:
    budget = {"thinking_token_budget": 10}
    assert rejected(actor(qwen3_dir, reasoning_parser="none"), chat("Hi", sampling=budget)).param == \
        "thinking_token_budget"
    assert rejected(qwen3, GenerateRequest(rid="r", text="Hi", sampling=budget)).param == "thinking_token_budget"
    assert rejected(qwen3, chat("Hi", sampling={"thinking_token_budget": -1})).param == "thinking_token_budget"


# --- template switches -------------------------------------------------------------------------------------


def test_default_template_kwargs_apply_and_the_request_overrides_them(qwen3_dir: Path) -> None:
    no_thinking = actor(qwen3_dir, default_chat_template_kwargs='{"enable_thinking": false}')
    assert tokenized(no_thinking, chat("Hi")).reasoning is None
    assert prompt_text(no_thinking, chat("Hi")).endswith("<think>\n\n</think>\n\n")
    assert tokenized(no_thinking, chat("Hi", chat_template_kwargs={"enable_thinking": True})).reasoning is not None


def test_unknown_template_kwargs_reach_the_template(qwen3_dir: Path, tmp_path: Path) -> None:
    template = tmp_path / "kwargs.jinja"
    template.write_text(KWARGS_TEMPLATE)
    server = actor(qwen3_dir, chat_template=str(template), default_chat_template_kwargs='{"greeting": "hello"}')
    assert prompt_text(server, chat("a")) == "a|hello|none"
    assert prompt_text(server, chat("a", chat_template_kwargs={"style": "terse"})) == "a|hello|terse"
    assert prompt_text(server, chat("a", chat_template_kwargs={"greeting": "hi", "style": 3})) == "a|hi|3"


@pytest.mark.parametrize("kwargs", ["enable_thinking", ["enable_thinking"], 1, {"messages": []},
                                    {"add_generation_prompt": False}, {"tools": []}, {"bos_token": "x"}])
def test_bad_template_kwargs_are_400s_naming_them(qwen3: TokenizerActor, kwargs: Any) -> None:
    assert rejected(qwen3, chat("Hi", chat_template_kwargs=kwargs)).param == "chat_template_kwargs"


def test_template_kwargs_need_a_chat_prompt(qwen3: TokenizerActor) -> None:
    req = GenerateRequest(rid="r", text="Hi", chat_template_kwargs={"enable_thinking": False})
    assert rejected(qwen3, req).param == "chat_template_kwargs"


def test_the_tokenize_query_takes_template_kwargs_and_answers_the_model_info(qwen3: TokenizerActor) -> None:
    turns = [ChatMessage("user", "Hi")]
    on = asyncio.run(qwen3._tokenize(TokenizeQuery(messages=turns))).tokens
    off = asyncio.run(qwen3._tokenize(TokenizeQuery(messages=turns, chat_template_kwargs={"enable_thinking": False})))
    assert off.tokens == tokenized(qwen3, chat("Hi", chat_template_kwargs={"enable_thinking": False})).input_ids
    assert len(off.tokens) > len(on)
    info = asyncio.run(qwen3._tokenize(TokenizeQuery(model_info=True)))
    assert info.error is None and info.default_sampling_params == IN_FORCE and info.reasoning_parser == "qwen3"


# --- generation_config.json --------------------------------------------------------------------------------


def test_generation_config_fills_what_the_request_leaves_out(qwen3: TokenizerActor) -> None:
    sampling = tokenized(qwen3, chat("Hi")).sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p, sampling.repetition_penalty,
            sampling.max_new_tokens) == (0.6, 0.95, 20, 0.0, 1.0, 7)
    mine = tokenized(qwen3, chat("Hi", sampling={"temperature": 0, "top_k": -1, "max_new_tokens": 100})).sampling
    assert (mine.temperature, mine.top_p, mine.top_k, mine.max_new_tokens) == (0, 0.95, -1, 100)


def test_generation_config_none_and_a_gguf_have_no_defaults(qwen3_dir: Path) -> None:
    sampling = tokenized(actor(qwen3_dir, generation_config="none"), chat("Hi")).sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (1.0, 1.0, -1)
    assert sampling.max_new_tokens == 4096 - len(tokenized(actor(qwen3_dir), chat("Hi")).input_ids)
    assert generation_defaults(resolve_model("SmolLM2-135M-Instruct")) == {}


def test_the_default_length_is_cut_to_the_context(tmp_path: Path) -> None:
    model = save_reasoning_model(tmp_path / "short", context_length=64, weights=False,
                                 generation_config={"max_new_tokens": 1000, "top_k": 50})
    # top_k 50 is transformers' own default: no recommendation (as vLLM reads the file)
    assert generation_defaults(resolve_model(str(model))) == {"max_new_tokens": 1000}
    sampling = tokenized(actor(model), chat("Hi")).sampling
    assert sampling.max_new_tokens == 64 - len(tokenized(actor(model), chat("Hi")).input_ids)


def test_a_generation_config_no_request_could_take_is_a_startup_error(tmp_path: Path) -> None:
    model = save_reasoning_model(tmp_path / "bad", weights=False, generation_config={"top_p": 5})
    with pytest.raises(ValueError, match="top_p.*--generation-config none"):
        generation_defaults(resolve_model(str(model)))
    assert generation_defaults(resolve_model(str(model)), "none") == {}


# --- auto detection and flags ------------------------------------------------------------------------------


def test_the_reasoning_parser_follows_the_template() -> None:
    assert parser_for_template(QWEN3_TEMPLATE.read_text()) == "qwen3"
    assert parser_for_template(R1_TEMPLATE) == "deepseek_r1"
    assert parser_for_template(HARMONY_TEMPLATE) == "gpt_oss"
    assert parser_for_template({"default": "x", "tool_use": QWEN3_TEMPLATE.read_text()}) == "qwen3"
    for family in ("gemma2", "gemma3", "llama3", "mistral_v3", "phi3", "qwen2_5"):
        assert parser_for_template((TEMPLATES / f"{family}.jinja").read_text()) == "none", family
    assert parser_for_template(None) == "none"


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with weights (what the launcher checks for) and Mistral's chat template."""
    template = (TEMPLATES / "mistral_v3.jinja").read_text()
    return save_reasoning_model(tmp_path_factory.mktemp("mistral"), template=template)


def test_the_launcher_detects_both_parsers_from_the_chat_template_flag(mistral_dir: Path) -> None:
    args = serve_args({"model": str(mistral_dir)})
    ring = Ring(args)
    ring.close()
    assert (args.reasoning_parser, args.tool_call_parser) == ("none", "mistral")
    args = serve_args({"model": str(mistral_dir), "chat_template": str(QWEN3_TEMPLATE), "reasoning_budget": 8,
                       "default_chat_template_kwargs": {"enable_thinking": False}})  # as ringserve.Engine takes it
    ring = Ring(args)
    ring.close()
    assert (args.reasoning_parser, args.tool_call_parser) == ("qwen3", "hermes")
    tokenizer = next(spec for spec in actor_specs(args, "m") if spec.role == "tokenizer")
    argv = tokenizer.args
    assert argv[argv.index("--reasoning-parser") + 1] == "qwen3"
    assert argv[argv.index("--chat-template") + 1] == str(QWEN3_TEMPLATE.resolve())
    assert json.loads(argv[argv.index("--default-chat-template-kwargs") + 1]) == {"enable_thinking": False}
    assert argv[argv.index("--reasoning-budget") + 1] == "8"


@pytest.mark.parametrize("flags, says", [
    ({"default_chat_template_kwargs": "{not json"}, "--default-chat-template-kwargs is not valid JSON"),
    ({"default_chat_template_kwargs": "[1]"}, "--default-chat-template-kwargs must be a JSON object"),
    ({"default_chat_template_kwargs": '{"messages": 1}'}, "cannot set 'messages'"),
    ({"chat_template": "/no/such/template.jinja"}, "--chat-template '/no/such/template.jinja' cannot be read"),
    ({"reasoning_budget": -2}, "--reasoning-budget must be -1"),
])
def test_bad_flags_are_startup_errors(mistral_dir: Path, flags: dict[str, Any], says: str) -> None:
    with pytest.raises(RingError, match=says.replace("[", r"\[")):
        Ring(serve_args({"model": str(mistral_dir), **flags}))
    argv = [f"--{name.replace('_', '-')}={value}" for name, value in flags.items()]
    with pytest.raises(SystemExit) as exit_:  # the tokenizer worker refuses them too, before it loads anything
        tokenizer_worker(["--model", str(mistral_dir), *argv])
    assert exit_.value.code == 2


def test_unknown_parser_names_are_refused() -> None:
    with pytest.raises(ValueError, match="reasoning.parser"):
        serve_args({"reasoning_parser": "qwen4"})
    with pytest.raises(ValueError, match="generation.config"):
        serve_args({"generation_config": "vllm"})
    assert isinstance(serve_args({"reasoning_parser": "glm45"}), argparse.Namespace)


# --- one ring ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reasoning_ring(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    """The tiny model served with its own template replaced (--chat-template) and thinking off by default."""
    model = save_reasoning_model(tmp_path_factory.mktemp("qwen3-ring"), generation_config=GENERATION_CONFIG,
                                 template=(TEMPLATES / "llama3.jinja").read_text())
    handle = start_server(str(model), extra=["--chat-template", str(QWEN3_TEMPLATE),
                                             "--default-chat-template-kwargs", '{"enable_thinking": false}'])
    yield handle
    assert handle.stop() == 0, handle.log()[-3000:]


def test_a_ring_serves_the_template_flags_and_the_generation_defaults(reasoning_ring: ServerHandle) -> None:
    url = reasoning_ring.base_url
    info = httpx.get(url + "/get_model_info", timeout=30).json()
    assert info["default_sampling_params"] == IN_FORCE and info["reasoning_parser"] == "qwen3"
    assert "reasoning parser chosen from the chat template parser=qwen3" in reasoning_ring.log()
    messages = [{"role": "user", "content": "Hi"}]
    tokens = httpx.post(url + "/v1/tokenize", json={"messages": messages}, timeout=30).json()["tokens"]
    closed = httpx.post(url + "/v1/tokenize", json={"prompt": "<think>\n\n</think>\n\n", "add_special_tokens": False},
                        timeout=30).json()["tokens"]
    assert tokens[-len(closed):] == closed  # Qwen3's template (not the model's Llama 3 one), thinking off
    thinking = {"enable_thinking": True}  # the request's kwargs over the server's
    on = httpx.post(url + "/v1/tokenize", json={"messages": messages, "chat_template_kwargs": thinking},
                    timeout=30).json()["tokens"]
    assert on == tokens[:-len(closed)]
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "messages": messages, "ignore_eos": True}
    reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()
    assert reply["usage"]["completion_tokens"] == 7  # generation_config.json's max_new_tokens
    assert reply["usage"]["prompt_tokens"] == len(tokens)
    reply = httpx.post(url + "/v1/chat/completions", json={**body, "max_tokens": 3}, timeout=60).json()
    assert reply["usage"]["completion_tokens"] == 3
    reply = httpx.post(url + "/v1/chat/completions", json={**body, "chat_template_kwargs": thinking},
                       timeout=60).json()
    assert reply["usage"]["prompt_tokens"] == len(on)


def test_earlier_thinking_sent_back_reaches_the_template(qwen3: TokenizerActor) -> None:
    """A tool loop whose assistant turn comes back with its thinking apart (chat's `reasoning_content`, a
    Responses reasoning item, an Anthropic thinking block): each route gives it to the template, which renders
    it inside that turn as Qwen3's does."""
    from ringserve.actors.entry.anthropic.turns import parse_turns
    from ringserve.actors.entry.responses.protocol import chat_turns, check_items
    from ringserve.actors.entry.tools.request import parse_messages

    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    chat_turns_ = parse_messages([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "I should call it."},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
    responses_turns = chat_turns(None, check_items([
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "I should call it."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]))
    anthropic_turns, _ = parse_turns(None, [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "I should call it.", "signature": ""},
                                          {"type": "tool_use", "id": "c1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "sunny"}]}])
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    for turns in (chat_turns_, responses_turns, anthropic_turns):
        assert [t.reasoning_content for t in turns if t.role == "assistant"] == ["I should call it."]
        text = prompt_text(qwen3, GenerateRequest(rid="r", messages=turns, tools=tools))
        assert "<|im_start|>assistant\n<think>\nI should call it.\n</think>\n\n<tool_call>" in text
    with pytest.raises(ApiError, match="reasoning_content must be a string, on an assistant message"):
        parse_messages([{"role": "user", "content": "hi", "reasoning_content": "no"}])
