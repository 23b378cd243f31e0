"""The tool-call formats of the model families (actors/entry/tool_parsers/): Hermes's `<tool_call>`, Llama 3's
bare JSON, Mistral's `[TOOL_CALLS]` (v3 list and v11 `name[ARGS]`) and the pythonic list, each read whole and
streamed in small pieces (the same items), malformed calls staying content; and the parser chosen from short
excerpts of real chat templates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ringserve.actors.entry.tool_parsers import ParsedCall, get_parser, parser_for_template

WEATHER = ParsedCall("get_weather", '{"city": "Paris"}')
CASES: dict[str, list[tuple[str, list[object]]]] = {
    "hermes": [
        ('Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call> Done.',
         ["Let me look. ", WEATHER, " Done."]),
        ('<tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call>',  # malformed JSON
         ['<tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call>']),
        ("a < b <tool_ca", ["a < b <tool_ca"]),
    ],
    "llama3_json": [
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "f", "parameters": {}}',
         [WEATHER, ParsedCall("f", "{}")]),
        ('{"name": "get_weather", "parameters": {"city": "Paris"}} and more', [
            '{"name": "get_weather", "parameters": {"city": "Paris"}} and more']),
        ("The weather is fine.", ["The weather is fine."]),
    ],
    "mistral": [
        ('Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "f", "arguments": {}}]',
         ["Sure. ", WEATHER, ParsedCall("f", "{}")]),
        ('[TOOL_CALLS] [{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}]', [WEATHER]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]f[ARGS]{"x": [1, 2]}',
         [WEATHER, ParsedCall("f", '{"x": [1, 2]}')]),
        ('[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}', [WEATHER]),
        ('[{"name": "get_weather", "arguments": {"city": "Paris"}}]', [WEATHER]),  # the special tag was skipped
        ("No tools needed [TOOL", ["No tools needed [TOOL"]),
        ("[TOOL_CALLS][{broken", ["[TOOL_CALLS][{broken"]),
        ("[TOOL_CALLS][]", ["[TOOL_CALLS][]"]),
        ('[TOOL_CALLS]get_weather{"city": "Paris"}', ['[TOOL_CALLS]get_weather{"city": "Paris"}']),  # no [ARGS]
        ('[{"x": 1}] is a list.', ['[{"x": 1}] is a list.']),
    ],
    "pythonic": [
        ('[get_weather(city="Paris", days=3), f(x=[1, 2], flag=True, y=None)]',
         [ParsedCall("get_weather", '{"city": "Paris", "days": 3}'),
          ParsedCall("f", '{"x": [1, 2], "flag": true, "y": null}')]),
        ('<|python_start|>[get_weather(city="Paris")]<|python_end|>', [WEATHER]),  # Llama 4's wrapper
        ("[os.system(cmd='ls')]", [ParsedCall("os.system", '{"cmd": "ls"}')]),  # a name, never run
        ("[f(__import__('os'))]", ["[f(__import__('os'))]"]),  # positional, not a literal: content
        ("[f(x=open('a'))]", ["[f(x=open('a'))]"]),  # a call as an argument is never evaluated
        ("[f(**options)]", ["[f(**options)]"]),
        ("[f(x=1, x=2)]", ["[f(x=1, x=2)]"]),
        ("[f(x={1, 2})]", ["[f(x={1, 2})]"]),  # a set: no JSON for it
        ("[f(x={[]: 1})]", ["[f(x={[]: 1})]"]),  # unhashable key: refused, not raised
        ("[f(x=1e999)]", ["[f(x=1e999)]"]),  # infinity is not JSON
        ("[f(x=b'a', y=1j)]", ["[f(x=b'a', y=1j)]"]),
        ('[get_weather(city="Paris"', ['[get_weather(city="Paris"']),  # cut short
        ("The answer is [1, 2].", ["The answer is [1, 2]."]),
        ("[1, 2]", ["[1, 2]"]),
    ],
}
ALL_CASES = [(name, text, expected) for name, cases in CASES.items() for text, expected in cases]


def streamed(name: str, text: str, piece: int) -> list[object]:
    """The items a stream of `piece`-character deltas gives, read as the entry reads them (merged content)."""
    parser, buffer, items = get_parser(name), "", []
    for i in range(0, len(text), piece):
        buffer += text[i:i + piece]
        got, used = parser.consume(buffer, final=False)
        items += got
        buffer = buffer[used:]
    items += parser.consume(buffer, final=True)[0]
    merged: list[object] = []
    for item in items:  # content may come in several pieces
        if isinstance(item, str) and merged and isinstance(merged[-1], str):
            merged[-1] += item
        elif item != "":
            merged.append(item)
    return merged


@pytest.mark.parametrize(("name", "text", "expected"), ALL_CASES)
def test_whole_and_streamed_outputs_give_the_same_items(name: str, text: str, expected: list[object]) -> None:
    assert get_parser(name).parse(text) == expected
    for piece in (1, 3, 7):
        assert streamed(name, text, piece) == expected, piece
    for item in expected:
        if isinstance(item, ParsedCall):
            assert isinstance(json.loads(item.arguments), dict)


def test_mistral_streams_text_before_the_tag_and_holds_what_may_begin_it() -> None:
    parser = get_parser("mistral")
    assert parser.consume("Let me check [TOOL", final=False) == (["Let me check "], len("Let me check "))
    assert parser.consume('Ok [TOOL_CALLS][{"name": "f"', final=False) == (["Ok "], 3)
    assert parser.consume("Plain text, no calls", final=False) == (["Plain text, no calls"], 20)


def test_pythonic_and_llama3_stream_ordinary_text_at_once() -> None:
    assert get_parser("pythonic").consume("Paris is sunny", final=False) == (["Paris is sunny"], 14)
    assert get_parser("pythonic").consume(" [get_weather(", final=False) == ([], 0)
    assert get_parser("llama3_json").consume("Paris is sunny", final=False) == (["Paris is sunny"], 14)


# Short excerpts of the models' own templates, as tokenizer_config.json holds them once decoded
QWEN25 = ("{%- if tools %}{{- '<|im_start|>system\\n' }}{{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to "
          "assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML "
          "tags:\\n<tools>\" }}{%- for tool in tools %}{{- \"\\n\" }}{{- tool | tojson }}{%- endfor %}{{- \"\\n</tools>"
          "\\n\\nFor each function call, return a json object with function name and arguments within <tool_call>"
          "</tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
          "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}")
MISTRAL_V3 = ("{%- if message.role == \"user\" %}{%- if tools is not none and (message == user_messages[-1]) %}"
              "{{- \"[AVAILABLE_TOOLS] [\" }}{%- for tool in tools %}...{%- endfor %}{{- \"[/AVAILABLE_TOOLS]\" }}"
              "{%- elif message.tool_calls is defined and message.tool_calls is not none %}{{- \"[TOOL_CALLS] [\" }}"
              "{%- for tool_call in message.tool_calls %}")
LLAMA31 = ("{%- if builtin_tools is defined or tools is not none %}{{- \"Environment: ipython\\n\" }}{%- endif %}"
           "{{- 'Given the following functions, please respond with a JSON for a function call with its proper "
           "arguments that best answers the given prompt.\\n\\n' }}{{- 'Respond in the format {\"name\": function "
           "name, \"parameters\": dictionary of argument name and its value}.' }}"
           "{{- \"<|python_tag|>\" + tool_call.name + \".call(\" }}")
LLAMA32 = ("{{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its "
           "value}.' }}{{- 'Do not use variables.\\n\\n' }}")
PYTHONIC = ("{{- \"If you decide to invoke any of the function(s), you MUST put it in the format of "
            "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]\\n\" }}"
            "{{- \"You SHOULD NOT include any other text in the response.\" }}")
GEMMA = "{{ bos_token }}{% for message in messages %}<start_of_turn>{{ message['role'] }}"


@pytest.mark.parametrize(("template", "parser"), [
    (QWEN25, "hermes"), (MISTRAL_V3, "mistral"), (LLAMA31, "llama3_json"), (LLAMA32, "llama3_json"),
    (PYTHONIC, "pythonic"), ("{{ '<|python_start|>' }}", "pythonic"), (GEMMA, "hermes"), (None, "hermes"),
])
def test_the_parser_follows_the_templates_format(template: str | None, parser: str) -> None:
    assert parser_for_template(template) == parser


def test_the_models_template_is_read_without_a_tokenizer(tmp_path: Path) -> None:
    """A directory's tokenizer_config.json template; a GGUF with none gets its family's (Gemma's, no tools)."""
    from ringserve.actors.common.model_source import model_chat_template, resolve_model
    from tests.model_families import tiny_hf_model
    from tests.real_models import gemma3_gguf

    tiny_hf_model("mistral").save_pretrained(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": MISTRAL_V3}))
    assert parser_for_template(model_chat_template(resolve_model(str(tmp_path)))) == "mistral"
    gemma = model_chat_template(resolve_model(str(gemma3_gguf())))
    assert gemma is not None and "<start_of_turn>" in gemma and parser_for_template(gemma) == "hermes"


def test_a_chat_with_tools_keeps_the_mistral_tags() -> None:
    """Mistral's tags are special tokens: with tools and tool_choice auto the request decodes with them kept,
    unless it says otherwise; other parsers leave the default."""
    from ringserve.actors.entry.openai_protocol import parse_chat

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
    assert parse_chat(body, "r", "m", "mistral")[0].sampling["skip_special_tokens"] is False
    assert parse_chat({**body, "skip_special_tokens": True}, "r", "m", "mistral")[0].sampling["skip_special_tokens"]
    assert "skip_special_tokens" not in parse_chat(body, "r", "m", "hermes")[0].sampling
    assert "skip_special_tokens" not in parse_chat({**body, "tool_choice": "none"}, "r", "m", "mistral")[0].sampling
