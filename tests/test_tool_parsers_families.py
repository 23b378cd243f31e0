"""The families' tool-call formats (actors/entry/tool_parsers.py): Mistral's `[TOOL_CALLS]` (v3 list and v11
`name[ARGS]`) and the pythonic list, whole and streamed in pieces, malformed calls staying content; and the parser
chosen from a chat template's own format."""

from __future__ import annotations

import json

import pytest

from ringserve.actors.entry.tool_parsers import ParsedCall, get_parser, parser_for_template

CASES = {
    "mistral": [
        ('Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "f", "arguments": {}}]',
         ["Sure. ", ParsedCall("get_weather", '{"city": "Paris"}'), ParsedCall("f", "{}")]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]f[ARGS]{"x": [1, 2]}',
         [ParsedCall("get_weather", '{"city": "Paris"}'), ParsedCall("f", '{"x": [1, 2]}')]),
        ("No tools needed [TOOL", ["No tools needed [TOOL"]),
        ("[TOOL_CALLS][{broken", ["[TOOL_CALLS][{broken"]),
    ],
    "pythonic": [
        ('[get_weather(city="Paris", days=3), f(x=[1, 2], flag=True)]',
         [ParsedCall("get_weather", '{"city": "Paris", "days": 3}'), ParsedCall("f", '{"x": [1, 2], "flag": true}')]),
        ("[os.system(cmd='ls')]", [ParsedCall("os.system", '{"cmd": "ls"}')]),
        ("[f(__import__('os'))]", ["[f(__import__('os'))]"]),  # positional, not a literal: content
        ("[f(x=open('a'))]", ["[f(x=open('a'))]"]),  # a call as an argument is never evaluated
        ("The answer is [1, 2].", ["The answer is [1, 2]."]),
    ],
}


def streamed(name: str, text: str, piece: int = 3) -> list[object]:
    """The items a stream of `piece`-character deltas gives, as the entry reads it."""
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


@pytest.mark.parametrize(("name", "text", "expected"), [(n, t, e) for n, cases in CASES.items() for t, e in cases])
def test_whole_and_streamed_outputs_give_the_same_items(name: str, text: str, expected: list[object]) -> None:
    assert get_parser(name).parse(text) == expected
    assert streamed(name, text) == expected
    for item in expected:
        if isinstance(item, ParsedCall):
            json.loads(item.arguments)


@pytest.mark.parametrize(("template", "parser"), [
    ("{%- for tool in tools %}<tools>{{ tool | tojson }}</tools>{% endfor %}... <tool_call>\n{\"name\": <function-name>, "
     "\"arguments\": <args-json-object>}\n</tool_call>", "hermes"),  # Qwen2.5's
    ("{%- if message.tool_calls %}{{- \"[TOOL_CALLS][\" }}{%- for tool_call in message.tool_calls %}", "mistral"),
    ("{{- \"<|python_tag|>\" + tool_call.name + \".call(\" }} ... Respond in the format {\"name\": function name, "
     "\"parameters\": dictionary of argument name and its value}", "llama3_json"),
    ("You should call them in the format [func_name1(params_name1=params_value1, params_name2=params_value2...), "
     "func_name2(params)]", "pythonic"),
    ("{{ bos_token }}{% for message in messages %}<start_of_turn>{{ message['role'] }}", "hermes"),
    (None, "hermes"),
])
def test_the_parser_follows_the_templates_format(template: str | None, parser: str) -> None:
    assert parser_for_template(template) == parser


def test_the_models_template_is_read_without_a_tokenizer(tmp_path: object) -> None:
    """A directory's tokenizer_config.json template; a GGUF with none gets its family's (Gemma's, no tools)."""
    from pathlib import Path

    from ringserve.actors.common.model_source import model_chat_template, resolve_model
    from tests.model_families import tiny_hf_model
    from tests.real_models import gemma3_gguf

    directory = Path(str(tmp_path))
    tiny_hf_model("mistral").save_pretrained(directory)
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": "[TOOL_CALLS]{{ tools }}"}))
    assert parser_for_template(model_chat_template(resolve_model(str(directory)))) == "mistral"
    gemma = model_chat_template(resolve_model(str(gemma3_gguf())))
    assert gemma is not None and "<start_of_turn>" in gemma and parser_for_template(gemma) == "hermes"
