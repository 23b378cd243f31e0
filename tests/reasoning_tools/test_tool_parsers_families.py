"""The tool-call formats of the model families (actors/entry/tool_parsers/): Hermes's `<tool_call>`, Llama 3's
bare JSON, Mistral's `[TOOL_CALLS]` (v3 list and v11 `name[ARGS]`), the pythonic list, Qwen3-Coder's XML,
GLM-4.5's `<arg_key>`/`<arg_value>`, DeepSeek V3's and V3.1's, Kimi-K2's sections and gpt-oss's harmony
messages, each read whole and streamed in small pieces (the same items), malformed calls staying content; text
arguments typed by the request's tool schemas; the parser chosen from short excerpts of real chat templates; and
the real ring read with `--tool-call-parser qwen3_coder` and `openai` through the official OpenAI client."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest

from ringserve.actors.entry.tool_parsers import ParsedCall, ToolCallParser, get_parser, parser_for_template

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
    "qwen3_coder": [  # Qwen3-Coder's and Qwen3.5's XML
        ("I'll check the weather.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
         "</function>\n</tool_call>", ["I'll check the weather.\n", WEATHER]),
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n"
         "<tool_call>\n<function=plan_trip>\n<parameter=stops>\n[{\"city\": \"Lyon\", \"nights\": 2}]\n</parameter>\n"
         "<parameter=budget>\n{\"max\": 900.5, \"currency\": {\"code\": \"EUR\"}}\n</parameter>\n<parameter=note>\n"
         "window seat\n</parameter>\n</function>\n</tool_call>",
         [WEATHER, "\n", ParsedCall("plan_trip", '{"stops": [{"city": "Lyon", "nights": 2}], "budget": {"max": 900.5, '
                                                '"currency": {"code": "EUR"}}, "note": "window seat"}')]),
        ("<tool_call>\n<function=write_file>\n<parameter=path>\na.py\n</parameter>\n<parameter=content>\n"
         "def f():\n    return \"</tool\"\n\n</parameter>\n</function>\n</tool_call>",  # lines kept, one break cut
         [ParsedCall("write_file", json.dumps({"path": "a.py", "content": "def f():\n    return \"</tool\"\n"}))]),
        ("<function=get_weather>\n<parameter=city>\nParis\n</function>", [WEATHER]),  # no <tool_call>, unclosed value
        ("<tool_call>\n<function=get_time>\n</function>\n</tool_call>", [ParsedCall("get_time", "{}")]),
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\nsunny?\n</function>\n</tool_call>",
         ["<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\nsunny?\n</function>\n"
          "</tool_call>"]),  # text between the parameters
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",  # cut short by max_tokens
         ["<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"]),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',  # Hermes's, not this
         ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>']),
        ("x < y and <function is a tag", ["x < y and <function is a tag"]),
    ],
    "glm45": [  # GLM-4.5's, 4.6's and 4.7's
        ("Let me check.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
         ["Let me check.", WEATHER]),
        ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>\n"
         "<tool_call>plan_trip\n<arg_key>stops</arg_key>\n<arg_value>[{\"city\": \"Lyon\", \"tags\": {\"a\": 1}}]"
         "</arg_value>\n<arg_key>note</arg_key>\n<arg_value>window seat</arg_value>\n</tool_call>",
         [WEATHER, "\n", ParsedCall("plan_trip", '{"stops": [{"city": "Lyon", "tags": {"a": 1}}], '
                                                '"note": "window seat"}')]),
        ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>", [WEATHER]),  # 4.7
        ("<tool_call>get_time\n</tool_call>", [ParsedCall("get_time", "{}")]),
        ("<tool_call>get weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
         ["<tool_call>get weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"]),
        ("<tool_call>get_weather\n<arg_key>city</arg_key>\n</tool_call>",  # a key without its value
         ["<tool_call>get_weather\n<arg_key>city</arg_key>\n</tool_call>"]),
        ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>city</arg_key>\n"
         "<arg_value>Rome</arg_value>\n</tool_call>",  # a key given twice
         ["<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>city</arg_key>\n"
          "<arg_value>Rome</arg_value>\n</tool_call>"]),
    ],
    "deepseek_v3": [  # DeepSeek V3, R1 and V3.1
        ("Let me check the weather for you.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
         "```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
         ["Let me check the weather for you.", WEATHER]),
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n"
         "```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>search_hotels\n```json\n"
         "{\"location\": \"Paris\", \"filters\": {\"stars\": [4, 5], \"pool\": true}}\n```<｜tool▁call▁end｜>"
         "<｜tool▁calls▁end｜>",
         [WEATHER, ParsedCall("search_hotels", '{"location": "Paris", "filters": {"stars": [4, 5], "pool": true}}')]),
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\"}<｜tool▁call▁end｜>"
         "<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",  # V3.1
         [WEATHER, ParsedCall("get_time", "{}")]),
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n"
         "```<｜tool▁call▁end｜>", [WEATHER]),  # the end of the calls not written
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Tokyo\"\n"
         "```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",  # JSON cut short
         ["<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Tokyo\"\n"
          "```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"]),
        ("<｜tool▁calls▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Tokyo\"}\n```<｜tool▁calls▁end｜>",
         ["<｜tool▁calls▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Tokyo\"}\n```"
          "<｜tool▁calls▁end｜>"]),  # no call begins
        ("The weather is fine <｜tool▁ca", ["The weather is fine <｜tool▁ca"]),
    ],
    "kimi_k2": [
        ("I'll check. <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
         "<|tool_call_argument_begin|>{\"city\": \"Paris\"}<|tool_call_end|><|tool_call_begin|>functions.plan_trip:1"
         "<|tool_call_argument_begin|>{\"stops\": [{\"city\": \"Lyon\"}], \"opts\": {\"fast\": false}}"
         "<|tool_call_end|><|tool_calls_section_end|>",
         ["I'll check. ", WEATHER,
          ParsedCall("plan_trip", '{"stops": [{"city": "Lyon"}], "opts": {"fast": false}}')]),
        ("<|tool_call_section_begin|>\n<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
         "{\"city\": \"Paris\"}<|tool_call_end|>\n<|tool_call_section_end|>", [WEATHER]),  # the singular spelling
        ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0{\"city\": \"Paris\"}"
         "<|tool_call_end|><|tool_calls_section_end|>",  # no argument tag
         ["<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0{\"city\": \"Paris\"}"
          "<|tool_call_end|><|tool_calls_section_end|>"]),
        ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
         "{\"city\": }<|tool_call_end|><|tool_calls_section_end|>",
         ["<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
          "{\"city\": }<|tool_call_end|><|tool_calls_section_end|>"]),
        ("Plain answer, no tools <|tool", ["Plain answer, no tools <|tool"]),
    ],
    "openai": [  # gpt-oss's harmony: the thinking's message, then calls or the final answer
        ("<|channel|>analysis<|message|>The user wants the weather in Paris.<|end|><|start|>assistant<|channel|>"
         "commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>", [WEATHER]),
        ("<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is sunny in "
         "Paris.<|return|>", ["It is sunny in Paris."]),
        ("<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Paris\"}<|call|>",
         [WEATHER]),  # the recipient in the role, as the chat template writes calls
        ("<|channel|>commentary<|message|>Checking two things.<|end|><|start|>assistant<|channel|>commentary "
         "to=functions.get_weather<|message|>{\"city\": \"Paris\"}<|call|><|start|>assistant<|channel|>commentary "
         "to=functions.plan_trip <|constrain|>json<|message|>{\"stops\": [{\"city\": \"Lyon\", \"nights\": 2}]}<|call|>",
         ["Checking two things.", WEATHER, ParsedCall("plan_trip", '{"stops": [{"city": "Lyon", "nights": 2}]}')]),
        ("<|channel|>final<|message|>Done", ["Done"]),  # <|return|> is a stop token: not in the text
        ("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}",
         [WEATHER]),  # nor is <|call|>
        ("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": }<|call|>",
         ["<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": }<|call|>"]),
        ("<|channel|>commentary to=browser.search <|constrain|>json<|message|>{\"query\": \"x\"}<|call|>",
         ["<|channel|>commentary to=browser.search <|constrain|>json<|message|>{\"query\": \"x\"}<|call|>"]),
        ("Plain text, a < b <|", ["Plain text, a < b <|"]),
    ],
}
ALL_CASES = [(name, text, expected) for name, cases in CASES.items() for text, expected in cases]


def merged(items: list[object]) -> list[object]:
    """`items` with adjacent content joined (content may come in several pieces) and empty content dropped."""
    joined: list[object] = []
    for item in items:
        if isinstance(item, str) and joined and isinstance(joined[-1], str):
            joined[-1] += item
        elif item != "":
            joined.append(item)
    return joined


def streamed(parser: ToolCallParser, text: str, piece: int) -> list[object]:
    """The items a stream of `piece`-character deltas gives, read as the entry reads them (merged content)."""
    buffer, items = "", []
    for i in range(0, len(text), piece):
        buffer += text[i:i + piece]
        got, used = parser.consume(buffer, final=False)
        assert 0 <= used <= len(buffer)
        items += got
        buffer = buffer[used:]
    items += parser.consume(buffer, final=True)[0]
    return merged(items)


@pytest.mark.parametrize(("name", "text", "expected"), ALL_CASES)
def test_whole_and_streamed_outputs_give_the_same_items(name: str, text: str, expected: list[object]) -> None:
    assert get_parser(name).parse(text) == expected
    for piece in (1, 3, 7):
        assert streamed(get_parser(name), text, piece) == expected, piece
    for item in expected:
        if isinstance(item, ParsedCall):
            assert isinstance(json.loads(item.arguments), dict)


# Pieces of each format's tags and bodies, shuffled into outputs well-formed or not
FRAGMENTS = {
    "hermes": ["<tool_call>", "</tool_call>", '{"name": "f", "arguments": {}}', "x", "<"],
    "qwen3_coder": ["<tool_call>", "</tool_call>", "\n", "<function=f>", "</function>", "<parameter=a>",
                    "</parameter>", "1", "x", "<", '{"a": 1}'],
    "glm45": ["<tool_call>", "</tool_call>", "f", "\n", "<arg_key>", "a", "</arg_key>", "<arg_value>", "1",
              "</arg_value>", "<", "x"],
    "deepseek_v3": ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                    "<｜tool▁sep｜>", "function", "f", "\n", "```json\n", "```", "{}", "<｜", "x"],
    "kimi_k2": ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                "<|tool_call_end|>", "<|tool_call_argument_begin|>", "functions.f:0", "{}", "<|", "x"],
    "openai": ["<|start|>", "assistant", "<|channel|>", "analysis", "final", "commentary", " to=functions.f",
               "<|constrain|>json", "<|message|>", "{}", "<|end|>", "<|call|>", "<|return|>", "hi", "<|", " "],
}


@pytest.mark.parametrize("name", sorted(FRAGMENTS))
def test_random_outputs_read_the_same_whole_and_streamed(name: str) -> None:
    """Whatever the model writes, a stream in any pieces settles to the whole reply's items, and a reply without
    calls loses no text (harmony's headers aside)."""
    import random

    rng, parser = random.Random(52), get_parser(name)
    for _ in range(300):
        text = "".join(rng.choice(FRAGMENTS[name]) for _ in range(rng.randint(0, 14)))
        whole = merged(list(parser.parse(text)))
        for piece in (1, 2, 5):
            assert streamed(parser, text, piece) == whole, (text, piece)
        if name != "openai" and not any(isinstance(item, ParsedCall) for item in whole):
            assert "".join(str(item) for item in whole) == text


def test_mistral_streams_text_before_the_tag_and_holds_what_may_begin_it() -> None:
    parser = get_parser("mistral")
    assert parser.consume("Let me check [TOOL", final=False) == (["Let me check "], len("Let me check "))
    assert parser.consume('Ok [TOOL_CALLS][{"name": "f"', final=False) == (["Ok "], 3)
    assert parser.consume("Plain text, no calls", final=False) == (["Plain text, no calls"], 20)


def test_pythonic_and_llama3_stream_ordinary_text_at_once() -> None:
    assert get_parser("pythonic").consume("Paris is sunny", final=False) == (["Paris is sunny"], 14)
    assert get_parser("pythonic").consume(" [get_weather(", final=False) == ([], 0)
    assert get_parser("llama3_json").consume("Paris is sunny", final=False) == (["Paris is sunny"], 14)


def test_the_new_formats_stream_text_at_once_and_hold_what_may_begin_a_call() -> None:
    """Text before a call goes out as it comes; an end that may begin a tag, or a call in progress, is held."""
    assert get_parser("qwen3_coder").consume("Sure.\n<tool_call>\n<function=get", final=False) == (["Sure.\n"], 6)
    assert get_parser("qwen3_coder").consume("Sure. <func", final=False) == (["Sure. "], 6)
    assert get_parser("glm45").consume("Sure.<tool_c", final=False) == (["Sure."], 5)
    assert get_parser("deepseek_v3").consume("Sure.<｜tool▁calls▁begin｜><｜tool", final=False) == (["Sure."], 5)
    assert get_parser("kimi_k2").consume("Sure. <|tool_calls_sec", final=False) == (["Sure. "], 6)
    harmony = get_parser("openai")  # the final answer streams while it is written; the thinking never shows
    assert harmony.consume("<|channel|>analysis<|message|>Think", final=False) == ([], 0)
    answer = "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>final<|message|>It is sun"
    assert harmony.consume(answer, final=False) == (["It is sun"], len(answer))
    assert harmony.consume("ny.<|ret", final=False) == (["ny."], 3)
    assert harmony.consume("<|return|>", final=True) == ([], 10)


# A request's tools: the schemas qwen3_coder and glm45 type their text arguments by
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "zip": {"type": "string"}, "days": {"type": "integer"},
    "scale": {"type": "number"}, "metric": {"type": "boolean"}, "options": {"type": "object"},
    "dates": {"type": ["array", "null"]}, "unit": {"enum": ["C", "F"]}, "level": {"anyOf": [{"type": "integer"},
                                                                                             {"type": "string"}]}}}}}]
TEXT_ARGUMENTS = [  # (parameter, the text the model wrote, typed by TOOLS, without a schema)
    ("city", "Paris", "Paris", "Paris"),
    ("zip", "75001", "75001", 75001),  # a string parameter keeps its digits as text
    ("zip", "007", "007", "007"),  # not JSON: text either way
    ("days", "3", 3, 3),
    ("days", "3.0", 3, 3.0),
    ("scale", "2", 2, 2),
    ("metric", "true", True, True),
    ("metric", "False", False, "False"),  # Python's spelling, taken for a boolean parameter only
    ("options", '{"units": {"wind": "km/h"}, "hours": [6, 12]}', {"units": {"wind": "km/h"}, "hours": [6, 12]},
     {"units": {"wind": "km/h"}, "hours": [6, 12]}),
    ("options", "{'units': 'metric', 'alerts': True}", {"units": "metric", "alerts": True},
     "{'units': 'metric', 'alerts': True}"),  # a Python literal, read, never run
    ("dates", "null", None, None),
    ("dates", '["2026-12-07"]', ["2026-12-07"], ["2026-12-07"]),
    ("unit", "C", "C", "C"),
    ("level", "4", 4, 4),
    ("level", "high", "high", "high"),
    ("note", "[1, 2]", [1, 2], [1, 2]),  # not in the schema: JSON if it decodes
    ("note", "bring an umbrella", "bring an umbrella", "bring an umbrella"),
    ("days", "1e999", "1e999", "1e999"),  # infinity is not JSON: kept as text
]


def _qwen3_coder_call(key: str, text: str) -> str:
    return f"<tool_call>\n<function=get_weather>\n<parameter={key}>\n{text}\n</parameter>\n</function>\n</tool_call>"


def _glm45_call(key: str, text: str) -> str:
    return f"<tool_call>get_weather\n<arg_key>{key}</arg_key>\n<arg_value>{text}</arg_value>\n</tool_call>"


@pytest.mark.parametrize("name", ["qwen3_coder", "glm45"])
@pytest.mark.parametrize(("key", "text", "typed", "untyped"), TEXT_ARGUMENTS)
def test_text_arguments_are_typed_by_the_tools_schema(name: str, key: str, text: str, typed: object,
                                                      untyped: object) -> None:
    output = "Checking. " + (_qwen3_coder_call if name == "qwen3_coder" else _glm45_call)(key, text)
    parser = get_parser(name).for_tools(TOOLS)
    for got in (parser.parse(output), *(streamed(parser, output, piece) for piece in (1, 5))):
        assert got[0] == "Checking. " and isinstance(got[1], ParsedCall) and len(got) == 2, got
        assert json.loads(got[1].arguments) == {key: typed}
        assert type(json.loads(got[1].arguments)[key]) is type(typed)
    untyped_call = get_parser(name).parse(output)[1]  # the registered parser knows no tools
    assert isinstance(untyped_call, ParsedCall) and json.loads(untyped_call.arguments) == {key: untyped}


def test_other_formats_are_the_same_parser_for_any_tools() -> None:
    for name in ("hermes", "llama3_json", "mistral", "pythonic", "deepseek_v3", "kimi_k2", "openai"):
        assert get_parser(name).for_tools(TOOLS) is get_parser(name)
    assert get_parser("qwen3_coder").for_tools(TOOLS) is not get_parser("qwen3_coder")
    assert get_parser("qwen3_coder").parameters == {}  # binding a request's tools leaves the shared one alone


@pytest.mark.parametrize("name", ["qwen3_coder", "glm45"])
def test_a_chat_request_reads_its_calls_with_its_own_tools(name: str) -> None:
    """The request's ToolPlan binds the parser to its tools: the whole message and the stream give the same
    typed arguments, the stream's argument deltas joining to valid JSON."""
    from ringserve.actors.entry.tools.request import parse_tools
    from ringserve.actors.entry.tools.response import ToolCallStream, tool_message

    call = (_qwen3_coder_call if name == "qwen3_coder" else _glm45_call)("days", "3")
    output = f"Let me look.\n{call}"
    plan = parse_tools({"tools": TOOLS}, name)
    assert plan is not None
    message, finish = tool_message(plan, output, "stop")
    assert finish == "tool_calls" and message["content"] == "Let me look."
    assert [c["function"] for c in message["tool_calls"]] == [{"name": "get_weather", "arguments": '{"days": 3}'}]
    stream, deltas = ToolCallStream(plan), []
    for i in range(0, len(output), 4):
        deltas += stream.feed(output[i:i + 4])
    last, finish = stream.finish("stop")
    deltas += last
    assert finish == "tool_calls"
    assert "".join(d.get("content", "") for d in deltas) == "Let me look."
    arguments = "".join(c["function"].get("arguments", "") for d in deltas for c in d.get("tool_calls", []))
    assert json.loads(arguments) == {"days": 3}


def test_harmony_replies_carry_only_the_final_text_whole_and_streamed() -> None:
    """gpt-oss's answer without a call: `content` is the final channel's text, never a harmony header."""
    from ringserve.actors.entry.tools.request import parse_tools
    from ringserve.actors.entry.tools.response import ToolCallStream, tool_message

    output = "<|channel|>analysis<|message|>No tool needed.<|end|><|start|>assistant<|channel|>final<|message|>Hi!"
    plan = parse_tools({"tools": TOOLS}, "openai")
    assert plan is not None
    assert tool_message(plan, output, "stop") == ({"role": "assistant", "content": "Hi!"}, "stop")
    stream, deltas = ToolCallStream(plan), []
    for i in range(0, len(output), 3):
        deltas += stream.feed(output[i:i + 3])
    last, finish = stream.finish("stop")
    assert finish == "stop" and "".join(d["content"] for d in deltas + last) == "Hi!"


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
QWEN3_CODER = ("{{- '\\n\\nIf you choose to call a function ONLY reply in the following format with NO suffix:\\n\\n"
               "<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n"
               "</parameter>\\n</function>\\n</tool_call>' }}{%- for tool_call in message.tool_calls %}"
               "{{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}{%- for args_name, args_value in "
               "tool_call.arguments|items %}{{- '<parameter=' + args_name + '>\\n' }}")
GLM45 = ("For each function call, output the function name and arguments within the following XML format:\n"
         "<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n...\n"
         "</tool_call>{%- endif -%}{% for tc in m.tool_calls %}{{ '\\n<tool_call>' + tc.name }}"
         "{% for k, v in _args.items() %}\n<arg_key>{{ k }}</arg_key>\n<arg_value>{{ v }}</arg_value>")
DEEPSEEK_V3 = ("{%- if message['content'] is none %}{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + "
               "tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + "
               "tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}")
DEEPSEEK_V31 = ("{{'<｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] "
                "+ '<｜tool▁call▁end｜>'}}")
KIMI_K2 = ("{%- if message['role'] == 'assistant' and message.get('tool_calls') -%}<|tool_calls_section_begin|>"
           "{%- for tool_call in message['tool_calls'] -%}{%- set formatted_id = tool_call['id'] -%}"
           "<|tool_call_begin|>{{ formatted_id }}<|tool_call_argument_begin|>")
GPT_OSS = ("{{- \"<|start|>assistant to=\" }}{{- \"functions.\" + tool_call.name + \"<|channel|>commentary \" }}"
           "{{- (tool_call.content_type if tool_call.content_type is defined else \"json\") + \"<|message|>\" }}"
           "{{- tool_call.arguments|tojson }}{{- \"<|call|>\" }}")


@pytest.mark.parametrize(("template", "parser"), [
    (QWEN25, "hermes"), (MISTRAL_V3, "mistral"), (LLAMA31, "llama3_json"), (LLAMA32, "llama3_json"),
    (PYTHONIC, "pythonic"), ("{{ '<|python_start|>' }}", "pythonic"), (GEMMA, "hermes"), (None, "hermes"),
    (QWEN3_CODER, "qwen3_coder"), (GLM45, "glm45"), (DEEPSEEK_V3, "deepseek_v3"), (DEEPSEEK_V31, "deepseek_v3"),
    (KIMI_K2, "kimi_k2"), (GPT_OSS, "openai"), ("{{- '<|start|>assistant<|channel|>final<|message|>' }}", "openai"),
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


@pytest.mark.parametrize(("name", "keeps"), [
    ("mistral", True), ("deepseek_v3", True), ("kimi_k2", True), ("openai", True),
    ("hermes", False), ("qwen3_coder", False), ("glm45", False),
])
def test_a_chat_with_tools_keeps_the_special_tags(name: str, keeps: bool) -> None:
    """Mistral's, DeepSeek's, Kimi-K2's and harmony's tags are special tokens: with tools and tool_choice auto the
    request decodes with them kept, unless it says otherwise; Qwen3-Coder's and GLM-4.5's are ordinary added
    tokens, and the others leave the default."""
    from ringserve.actors.entry.openai.protocol import parse_chat

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
    assert get_parser(name).keeps_special_tokens is keeps
    if keeps:
        assert parse_chat(body, "r", "m", name)[0].sampling["skip_special_tokens"] is False
        assert parse_chat({**body, "skip_special_tokens": True}, "r", "m", name)[0].sampling["skip_special_tokens"]
    else:
        assert "skip_special_tokens" not in parse_chat(body, "r", "m", name)[0].sampling
    assert "skip_special_tokens" not in parse_chat({**body, "tool_choice": "none"}, "r", "m", name)[0].sampling


# --- the real ring: the parsers behind the OpenAI routes ------------------------------------------------------


SERVED = "tiny"


@pytest.fixture(scope="module")
def parser_servers(tiny_model_dir: Path) -> Iterator[dict[str, Any]]:
    """The tiny model (SmolLM2's tokenizer) served twice, reading tool calls as Qwen3-Coder's XML and as gpt-oss's
    harmony (its outputs are pinned by a regex, so its random weights do not matter)."""
    from tests.server_helpers import servers_side_by_side

    import httpx

    with servers_side_by_side({name: (str(tiny_model_dir), ["--tool-call-parser", name,
                                                            "--served-model-name", SERVED])
                               for name in ("qwen3_coder", "openai")}) as handles:
        for handle in handles.values():  # a first constrained request starts the grammar workers: on a busy
            for _ in range(3):  # host its admission may time out (503), so the tests start after one went through
                warm = httpx.post(f"{handle.base_url}/v1/chat/completions", timeout=120, json={
                    "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "guided_regex": "ok"})
                if warm.status_code == 200:
                    break
            assert warm.status_code == 200, warm.text
        yield handles


def _ask(server: Any, pinned: str, stream: bool) -> tuple[str | None, list[dict[str, Any]], str | None]:
    """One reply of the official client, its output pinned with a regex (a 135M model writes no such format on
    its own): content, calls (streamed fragments joined), finish reason."""
    import openai

    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    request: dict[str, Any] = {"model": SERVED, "messages": [{"role": "user", "content": "Weather?"}],
                               "tools": TOOLS, "max_tokens": 120, "temperature": 0,
                               "extra_body": {"guided_regex": pinned}}
    if not stream:
        [choice] = client.chat.completions.create(**request).choices
        calls = [call.model_dump() for call in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, parts, finish = None, {}, None
    for chunk in client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            if choice.delta.content:
                content = (content or "") + choice.delta.content
            for part in choice.delta.tool_calls or []:
                call = parts.setdefault(part.index, {"id": part.id, "type": "function",
                                                     "function": {"name": part.function.name, "arguments": ""}})
                call["function"]["arguments"] += part.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [parts[i] for i in sorted(parts)], finish


@pytest.mark.parametrize("stream", [False, True])
def test_qwen3_coder_calls_come_back_typed_through_the_openai_client(parser_servers: dict[str, Any],
                                                                     stream: bool) -> None:
    pinned = (r"I will check\.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
              r"<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
    content, calls, finish = _ask(parser_servers["qwen3_coder"], pinned, stream)
    assert (content, finish) == ("I will check.", "tool_calls")
    [call] = calls
    assert call["id"].startswith("call_") and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}


@pytest.mark.parametrize("stream", [False, True])
def test_harmony_answers_and_calls_through_the_openai_client(parser_servers: dict[str, Any], stream: bool) -> None:
    server = parser_servers["openai"]
    answer = (r"<\|channel\|>analysis<\|message\|>Easy\.<\|end\|><\|start\|>assistant<\|channel\|>final"
              r"<\|message\|>It is sunny\.")
    assert _ask(server, answer, stream) == ("It is sunny.", [], "stop")
    call = (r"<\|channel\|>analysis<\|message\|>Look it up\.<\|end\|><\|start\|>assistant<\|channel\|>commentary "
            r"to=functions\.get_weather <\|constrain\|>json<\|message\|>\{\"city\": \"Paris\", \"days\": 3\}")
    content, calls, finish = _ask(server, call, stream)
    assert (content, finish, len(calls)) == (None, "tool_calls", 1)
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 3}
