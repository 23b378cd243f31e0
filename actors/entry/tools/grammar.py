"""The lazy grammar of `tool_choice: "auto"`: text stays free, and a call the model starts is always valid.

As llama.cpp's lazy grammars do: the output is unconstrained until the model writes its format's trigger (Hermes's
`<tool_call>`); from there the call must name one of the request's tools, give arguments valid under that
tool's `parameters` schema, and close its tag; after it the text is free again (with `parallel_tool_calls: false`
the output must end after the first call). It is xgrammar's structural tag (a `triggered_tags` format), sent as
the `structural_tag` sampling parameter and compiled like any other constraint (kernels/grammar).

One shape per tool-call parser, the text the parser reads back (`FORMATS`; ARGS a JSON object, the XML
formats' values text):

- `hermes`, trigger `<tool_call>`: `<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>` (what Qwen's
  templates write and the default tool prompt of actors/tokenizer/prompt.py asks for);
- `llama3_json`, trigger `{"name": `: `{"name": "NAME", "parameters": ARGS}`;
- `qwen3_coder`, trigger `<tool_call>`: `<tool_call>\\n<function=NAME>\\n`, each argument as
  `<parameter=KEY>\\nVALUE\\n</parameter>\\n`, then `</function>\\n</tool_call>`;
- `glm45`, trigger `<tool_call>`: `<tool_call>NAME`, each argument as `\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE
  </arg_value>`, then `</tool_call>`.

The other formats stay unconstrained: `mistral`, `deepseek_v3`, `kimi_k2` and `openai` (harmony) begin with
special tokens, which no grammar can produce (the grammar backend's vocabulary blanks them), and `pythonic` has
no trigger (a call is a bare Python list). A tag that holds a special token of the served model (GLM's tags on a
tokenizer that marks them special) is dropped by the tokenizer before admission (grammar_check). The schemas go
without their descriptions and titles; tools whose tag would still be longer than a constraint may be
(`MAX_GRAMMAR_CHARS`) get none. A tool's `parameters` schema is enforced
as `required` enforces it (properties it does not list are not generated; no parameters: `{}`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ringserve.bus.params import MAX_GRAMMAR_CHARS

# JSON arguments may be spaced as the model likes (`{"a": 1}`, pretty-printed), up to this many whitespace
# characters in a row: a small model cannot loop on blanks inside a call
MAX_WHITESPACE = 16


@dataclass(frozen=True)
class CallFormat:
    """How one parser's calls are written: `begin` (with `{name}`), the arguments' style, `end`; `trigger` starts
    every `begin` and is what the lazy grammar waits for."""

    trigger: str
    begin: str
    end: str
    style: str = "json"  # xgrammar's JSONSchemaFormat style: "json", or "qwen_xml" / "glm_xml" (text values)


FORMATS: dict[str, CallFormat] = {
    "hermes": CallFormat("<tool_call>", '<tool_call>\n{{"name": "{name}", "arguments": ', "}\n</tool_call>"),
    "llama3_json": CallFormat('{"name": ', '{{"name": "{name}", "parameters": ', "}"),
    "qwen3_coder": CallFormat("<tool_call>", "<tool_call>\n<function={name}>\n", "</function>\n</tool_call>",
                              "qwen_xml"),
    "glm45": CallFormat("<tool_call>", "<tool_call>{name}", "</tool_call>", "glm_xml"),
}


# JSON-schema keywords that only annotate (no grammar reads them), dropped so that an agent's long descriptions
# do not push the tag past the size a constraint may have
ANNOTATIONS = frozenset({"description", "title", "examples", "$comment"})
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_SCHEMA_LISTS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems"})
_VERBATIM = frozenset({"enum", "const", "default", "required", "dependentRequired", "dependencies"})  # not schemas


def bare_schema(schema: Any) -> Any:
    """`schema` without its annotations (`ANNOTATIONS`), at every level; property names and values kept."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in ANNOTATIONS:
            continue
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: bare_schema(sub) for name, sub in value.items()}
        elif (key in _SCHEMA_LISTS or key == "items") and isinstance(value, list):
            out[key] = [bare_schema(sub) for sub in value]
        elif key in _VERBATIM or not isinstance(value, dict):
            out[key] = value
        else:  # items, additionalProperties, not, if/then/else, contains, propertyNames, ...
            out[key] = bare_schema(value)
    return out


def _tag(fmt: CallFormat, name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    content: dict[str, Any] = {"type": "json_schema", "json_schema": bare_schema(parameters), "style": fmt.style}
    if fmt.style == "json":
        content["max_whitespace_cnt"] = MAX_WHITESPACE
    return {"type": "tag", "begin": fmt.begin.format(name=name), "content": content, "end": fmt.end}


def tool_call_tag(parser: str, tools: list[tuple[str, dict[str, Any]]], parallel: bool = True) -> str | None:
    """The structural tag (its JSON text) for `tools` (name, parameters schema) called in `parser`'s format;
    None when the format has no usable trigger, or the tag would be longer than a constraint may be."""
    fmt = FORMATS.get(parser)
    if fmt is None or not tools:
        return None
    tag = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": [fmt.trigger], "tags": [_tag(fmt, name, p) for name, p in tools],
        "at_least_one": False, "stop_after_first": not parallel}}
    text = json.dumps(tag, ensure_ascii=False, separators=(",", ":"))
    return text if len(text) <= MAX_GRAMMAR_CHARS else None
