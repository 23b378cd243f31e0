"""The lazy tool-call grammar of `tool_choice: "auto"` (actors/entry/tools/grammar.py): a structural tag compiled by
the real grammar backend over SmolLM2's tokenizer, walked token by token with a real matcher (free text, valid
calls, the first bad token of an invalid call refused, calls in a row, parallel_tool_calls false, a trigger that
is one added token as Qwen's is), read back by the real parsers; the tokenizer's check of it (bad schemas name
`tools`, a trigger the model cannot write is dropped); an engine run: a bigram model that writes `<tool_call>` and
nothing sensible after it, whose constrained output parses as a valid call while its unconstrained output does
not; and the routes of the real ring putting it on chat, Responses and Messages requests."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from ringserve.actors.entry.tools.grammar import FORMATS, tool_call_tag
from ringserve.actors.entry.tool_parsers import HermesParser, ParsedCall
from ringserve.actors.entry.tools.request import output_constraint, parse_tools
from ringserve.actors.tokenizer.grammar_check import GrammarChecker
from ringserve.bus.errors import ApiError
from ringserve.bus.messages import TokenizedRequest
from ringserve.bus.params import SamplingParams
from ringserve.kernels.grammar import (CompiledGrammar, GrammarCompiler, GrammarError, GrammarMatcher, GrammarSpec,
                                       UnreachableTag, allocate_bitmask, make_compiler, unpack_bitmask)
from ringserve.kernels.grammar.xgrammar_backend import special_token_ids
from tests.engine_helpers import engine_for, run_to_completion, tiny_hf_llama, tokens_of

MODEL = "SmolLM2-135M-Instruct"
VOCAB = 49152  # SmolLM2's
EOS = 2
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: `{}`
TOOLS = [WEATHER, TIME]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
TIME_CALL = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from ringserve.actors.common.model_source import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(MODEL))


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> Iterator[GrammarCompiler]:
    compiler = make_compiler(tokenizer, VOCAB)
    yield compiler
    compiler.close()


def lazy_spec(parser: str = "hermes", parallel: bool = True) -> GrammarSpec:
    plan = parse_tools({"tools": TOOLS, "parallel_tool_calls": parallel}, parser)
    assert plan is not None and plan.choice == "auto"
    tag = plan.lazy_constraint()
    assert tag is not None
    return GrammarSpec("structural_tag", tag)


@pytest.fixture(scope="module")
def hermes(compiler: GrammarCompiler) -> CompiledGrammar:
    return compiler.compile(lazy_spec())


def feed(tokenizer: Any, matcher: GrammarMatcher, text: str) -> int | None:
    """Accept `text`'s tokens one by one: the index of the first one refused, None when all are accepted."""
    for i, token in enumerate(tokenizer.encode(text, add_special_tokens=False)):
        if not matcher.accept_token(token):
            return i
    return None


def allowed(matcher: GrammarMatcher, vocab: int = VOCAB) -> torch.Tensor:
    bitmask = allocate_bitmask(1, vocab)
    matcher.fill_bitmask(bitmask, 0)
    return unpack_bitmask(bitmask, vocab)[0]


def test_free_text_is_accepted_and_may_end(tokenizer: Any, hermes: CompiledGrammar) -> None:
    # outside a call every token is allowed but the special ones (which no grammar allows), and the EOS is
    free = torch.ones(VOCAB, dtype=torch.bool)
    free[sorted(special_token_ids(tokenizer) - {EOS})] = False
    matcher = hermes.matcher()
    assert matcher.is_completed() and not matcher.is_terminated()  # an empty answer is fine
    assert torch.equal(allowed(matcher), free)
    text = "I can answer that myself: it is sunny {\"json\": [1, 2]} and <b>warm</b> <tool> today."
    assert feed(tokenizer, matcher, text) is None
    assert matcher.jump_forward() == "" and matcher.is_completed() and not matcher.is_terminated()
    assert torch.equal(allowed(matcher), free)
    assert feed(tokenizer, matcher, TIME_CALL + " Now") is None and torch.equal(allowed(matcher), free)
    assert matcher.accept_token(EOS) and matcher.is_terminated()


def test_valid_calls_are_accepted_and_parse(tokenizer: Any, hermes: CompiledGrammar) -> None:
    matcher = hermes.matcher()
    text = f"Let me look.\n{CALL}\nAnd the time:\n{TIME_CALL}\nDone."
    assert feed(tokenizer, matcher, text) is None
    assert matcher.is_completed() and matcher.accept_token(EOS)
    assert HermesParser().parse(text) == [
        "Let me look.\n", ParsedCall("get_weather", '{"city": "Paris", "unit": "celsius"}'), "\nAnd the time:\n",
        ParsedCall("get_time", "{}"), "\nDone."]
    several = hermes.matcher()  # back to back, and arguments spaced as a model may space them
    spaced = CALL.replace('{"city": "Paris", ', '{\n  "city": "Rome",\n  ')
    assert feed(tokenizer, several, CALL + spaced + TIME_CALL + CALL) is None and several.is_completed()


def test_the_trigger_forces_the_call_s_opening(tokenizer: Any, hermes: CompiledGrammar) -> None:
    matcher = hermes.matcher()
    assert feed(tokenizer, matcher, "Checking. <tool_call>") is None
    assert matcher.jump_forward() == '\n{"name": "get_'  # the text both tools' calls begin with
    assert not matcher.is_completed()
    mask = allowed(matcher)
    assert not mask[EOS]  # a started call cannot end the output
    forced = matcher.jump_forward_tokens()
    assert forced and '\n{"name": "get_'.startswith(tokenizer.decode(forced))


@pytest.mark.parametrize(("bad", "at"), [
    (CALL.replace("get_weather", "get_wether"), 'get_we'),  # no such tool
    (CALL.replace('"Paris"', "42"), '"city": '),  # a number where a string must be
    (CALL.replace("celsius", "kelvin"), '"unit": "'),  # not in the enum
    (CALL.replace(', "unit": "celsius"', ""), '"Paris"'),  # a required property left out
    (CALL.replace('"unit"', '"units"'), '"unit'),  # a property the schema does not list
    (TIME_CALL.replace("{}", '{"tz": "UTC"}'), '"arguments": {'),  # arguments for a tool that takes none
    (CALL.replace("}\n</tool_call>", "\n</tool_call>"), '"celsius"}'),  # the call left unclosed
])
def test_an_invalid_call_is_refused_at_its_first_bad_token(tokenizer: Any, hermes: CompiledGrammar, bad: str,
                                                           at: str) -> None:
    text = "Sure. " + bad
    error = text.index(at) + len(at)  # the first character no valid call has here
    ids = tokenizer.encode(text, add_special_tokens=False)
    refused = feed(tokenizer, hermes.matcher(), text)
    assert refused is not None, bad
    assert len(tokenizer.decode(ids[:refused])) <= error < len(tokenizer.decode(ids[:refused + 1])), (
        bad, tokenizer.decode(ids[:refused + 1]))


@pytest.mark.parametrize("special", [False, True])
def test_tags_that_are_tokens_of_their_own(special: bool) -> None:
    """Qwen's `<tool_call>` and `</tool_call>` are added tokens, not special ones: the model writes its trigger as
    one token, and the grammar takes it. Tags a tokenizer marks special could never be written: refused."""
    from ringserve.actors.common.model_source import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(MODEL))
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"], special_tokens=special)
    compiler = make_compiler(tokenizer, VOCAB + 64)
    try:
        if special:
            with pytest.raises(UnreachableTag):
                compiler.check(lazy_spec())
            return
        matcher = compiler.compile(lazy_spec()).matcher()
        ids = tokenizer.encode("Sure. " + CALL, add_special_tokens=False)
        trigger = tokenizer.convert_tokens_to_ids("<tool_call>")
        assert trigger >= VOCAB and ids.count(trigger) == 1 and tokenizer.convert_tokens_to_ids("</tool_call>") in ids
        assert feed(tokenizer, matcher, "Sure. ") is None and allowed(matcher, VOCAB + 64)[trigger]
        assert matcher.accept_token(trigger) and matcher.jump_forward() == '\n{"name": "get_'
        assert feed(tokenizer, matcher, CALL.removeprefix("<tool_call>")) is None and matcher.is_completed()
    finally:
        compiler.close()


def test_parallel_false_ends_the_output_after_one_call(tokenizer: Any, compiler: GrammarCompiler) -> None:
    matcher = compiler.compile(lazy_spec(parallel=False)).matcher()
    assert feed(tokenizer, matcher, "Sure. " + CALL) is None
    assert matcher.is_completed()
    assert allowed(matcher).nonzero().flatten().tolist() == [EOS]


@pytest.mark.parametrize(("parser", "call", "expected"), [
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
     '{"city": "Paris", "unit": "celsius"}'),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=unit>\n"
                    "celsius\n</parameter>\n</function>\n</tool_call>", '{"city": "Paris", "unit": "celsius"}'),
    ("qwen3_coder", "<tool_call>\n<function=get_time>\n</function>\n</tool_call>", "{}"),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>unit</arg_key>"
              "\n<arg_value>celsius</arg_value>\n</tool_call>", '{"city": "Paris", "unit": "celsius"}'),
])
def test_other_formats_accept_what_their_parser_reads(tokenizer: Any, compiler: GrammarCompiler, parser: str,
                                                      call: str, expected: str) -> None:
    compiled = compiler.compile(lazy_spec(parser))
    assert feed(tokenizer, compiled.matcher(), call) is None
    plan = parse_tools({"tools": TOOLS}, parser)
    assert plan is not None
    [parsed] = [item for item in plan.parser.parse(call) if isinstance(item, ParsedCall)]
    assert json.loads(parsed.arguments) == json.loads(expected)
    matcher = compiled.matcher()
    trigger = FORMATS[parser].trigger
    assert feed(tokenizer, matcher, "Hmm. " + trigger) is None and not matcher.is_completed()
    bad = call.replace("get_", "got_") if "get_weather" in call else call.replace("get_time", "get_tim3")
    assert feed(tokenizer, compiled.matcher(), bad) is not None


def test_which_requests_get_the_lazy_grammar() -> None:
    assert output_constraint({}, parse_tools({"tools": TOOLS}))[0::2] == ("structural_tag", "tools")
    for body in ({"response_format": {"type": "json_object"}}, {"guided_regex": "a+"}):  # dropped beside these
        assert output_constraint(body, parse_tools({"tools": TOOLS}))[0] != "structural_tag"
    assert output_constraint({}, parse_tools({"tools": TOOLS, "tool_choice": "required"}))[0] == "json_schema"
    for parser in ("mistral", "pythonic", "deepseek_v3", "kimi_k2", "openai"):  # no trigger a grammar can write
        assert output_constraint({}, parse_tools({"tools": TOOLS}, parser)) is None
    # an agent's long descriptions are left out (no grammar reads them); a tag still too long is not sent
    described = {"type": "object", "description": "y" * 500, "properties": {
        f"p{i}": {"type": "string", "description": "x" * 100, "title": f"P{i}"} for i in range(1000)}}
    tag = tool_call_tag("hermes", [("big", described)])
    assert tag is not None and "x" * 100 not in tag and "y" * 500 not in tag and "P999" not in tag
    assert '"p999":{"type":"string"}' in tag
    assert tool_call_tag("hermes", [("big", {"enum": ["x" * 100 + str(i) for i in range(1000)]})]) is None


def test_the_tokenizer_checks_it(tokenizer: Any) -> None:
    checker = GrammarChecker(tokenizer, VOCAB)

    def check(tag: str, openai_names: bool = True) -> SamplingParams:
        params = SamplingParams(max_new_tokens=8, structural_tag=tag)
        asyncio.run(checker.check(params, openai_names))
        return params

    good = lazy_spec().source
    assert check(good).structural_tag == good
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "nonsense"}}}}}
    bad = parse_tools({"tools": [bad_schema]}).lazy_constraint()
    with pytest.raises(ApiError) as err:
        check(bad)
    assert err.value.param == "tools" and 'parameters schema cannot be enforced' in err.value.message
    assert 'Unsupported type "nonsense"' in err.value.message
    with pytest.raises(ApiError) as err:
        check(bad, openai_names=False)
    assert err.value.param == "structural_tag"
    # a trigger that is a special token of the model (as Mistral's [TOOL_CALLS] is of Mistral's): the model could
    # never write it under the grammar, so the tool plan's tag is dropped, and a native one refused
    special = good.replace("<tool_call>", "<|im_start|>")
    assert check(special).structural_tag is None
    with pytest.raises(ApiError) as err:
        check(special, openai_names=False)
    assert err.value.param == "structural_tag" and "special token" in err.value.message


def test_the_backend_refuses_what_it_cannot_run(compiler: GrammarCompiler) -> None:
    special = GrammarSpec("structural_tag", lazy_spec().source.replace("<tool_call>", "<|im_end|>"))
    with pytest.raises(UnreachableTag):
        compiler.compile(special)
    recursive = {"type": "object", "properties": {"c": {"$ref": "#"}}, "required": ["c"]}
    spec = GrammarSpec("structural_tag", tool_call_tag("hermes", [("f", recursive)]) or "")
    with pytest.raises(GrammarError, match="infinitely nested"):
        compiler.check(spec)
    with pytest.raises(GrammarError, match="invalid structural tag"):
        compiler.check(GrammarSpec("structural_tag", "{not json"))
    with pytest.raises(GrammarError, match="invalid structural tag"):
        compiler.check(GrammarSpec("structural_tag", '{"type": "structural_tag", "format": {"type": "nope"}}'))


# --- the engine --------------------------------------------------------------------------------------------------

TRIGGER = [44, 19324, 79, 4350, 46]  # "<", "tool", "_", "call", ">": SmolLM2's tokens of "<tool_call>"


def bigram_model() -> Any:
    """A Llama whose layers add nothing (output projections zero), so each next token follows from the current
    one alone: any token -> "<", and on through `<tool_call>`; ">" -> EOS. Unconstrained it writes `<tool_call>`
    and stops; everything after the trigger is up to the grammar."""
    model = tiny_hf_llama(vocab_size=VOCAB, max_position_embeddings=512)
    chain = [*TRIGGER, EOS]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        embed.zero_()
        head.zero_()
        embed[:, len(chain)] = 1.0  # every other token: direction len(chain), which leads to "<"
        head[TRIGGER[0], len(chain)] = 10.0
        for k, (token, successor) in enumerate(zip(chain, chain[1:])):
            embed[token] = 0.0
            embed[token, k] = 1.0
            head[successor, k] = 10.0
    return model


def check_call(text: str) -> ParsedCall:
    """The one call `text` holds, valid under its tool's schema."""
    items = HermesParser().parse(text)
    assert len(items) == 1 and isinstance(items[0], ParsedCall), text
    call, arguments = items[0], json.loads(items[0].arguments)
    if call.name == "get_time":
        assert arguments == {}, text
    else:
        assert call.name == "get_weather" and set(arguments) == {"city", "unit"}, text
        assert len(arguments["city"]) <= 12 and arguments["unit"] in ("celsius", "fahrenheit"), text
    return call


def test_an_engine_s_constrained_auto_output_parses(tokenizer: Any) -> None:
    engine = engine_for(bigram_model(), tokenizer, max_total_tokens=2048)
    prompt = tokenizer.encode("What is the weather in Paris?", add_special_tokens=False)
    assert not set(prompt) & {*TRIGGER, EOS}
    weather = tokenizer.encode("get_weather", add_special_tokens=False)[-1]  # "weather"

    def params(**extra: Any) -> SamplingParams:
        return SamplingParams(max_new_tokens=64, temperature=0.0, stop_token_ids=[EOS], **extra)

    tag = lazy_spec().source
    reqs = [TokenizedRequest("free", prompt, params()), TokenizedRequest("lazy", prompt, params(structural_tag=tag)),
            # a nudge towards get_weather (only the name can take it), so the arguments are generated too
            TokenizedRequest("weather", prompt, params(structural_tag=tag, logit_bias={weather: 5.0}))]
    out = run_to_completion(engine, reqs)
    unconstrained = tokenizer.decode(tokens_of(out["free"]), skip_special_tokens=True)
    assert unconstrained == "<tool_call>"  # the model alone writes the tag and nothing after it
    assert HermesParser().parse(unconstrained) == ["<tool_call>"]  # not a call
    for rid in ("lazy", "weather"):
        text = tokenizer.decode(tokens_of(out[rid]), skip_special_tokens=True)
        assert out[rid][-1].finish.type == "stop", (out[rid][-1].finish, text)
        call = check_call(text)
    assert call.name == "get_weather"
    engine.check_integrity()


# --- the ring ----------------------------------------------------------------------------------------------------


def test_the_routes_send_it_to_the_ring(smollm_server: Any) -> None:
    """Through the real ring with the official clients: chat's, Responses' and Messages' `auto` carry the lazy
    grammar (a tool schema no grammar can take is a 400 naming `tools`, as for a forced call), and beside
    `response_format` it gives way (the same tools, no error)."""
    import anthropic
    import openai

    bad = {"type": "object", "properties": {"a": {"type": "nonsense"}}}
    client = openai.OpenAI(base_url=f"{smollm_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": bad}}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=ask, tools=tools, max_tokens=4)
    assert err.value.body["param"] == "tools" and "parameters schema" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="Weather in Paris?", max_output_tokens=16,
                                tools=[{"type": "function", "name": "f", "parameters": bad}])
    assert err.value.body["param"] == "tools"
    messages = anthropic.Anthropic(base_url=smollm_server.base_url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as caught:
        messages.messages.create(model=MODEL, max_tokens=4, messages=ask,
                                 tools=[{"name": "f", "input_schema": bad}])
    assert "parameters schema" in str(caught.value)
    reply = client.chat.completions.create(model=MODEL, messages=ask, tools=tools, max_tokens=8, temperature=0,
                                           response_format={"type": "json_object"})
    [choice] = reply.choices  # the response_format's grammar applied: a JSON object (maybe cut by max_tokens)
    assert (choice.message.content or "").startswith("{"), choice
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content or ""), dict)
    good = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER, TIME], max_tokens=8, temperature=0)
    assert good.choices[0].message.role == "assistant"
