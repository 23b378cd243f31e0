"""Turns a request's prompt (text, chat messages or token ids) into the token ids the model sees.

Tools (`GenerateRequest.tools`) go to the chat template as `tools=` when the template uses them; its messages
then keep their `tool_calls` (arguments decoded to objects, as Hugging Face templates expect), `tool_call_id`
and `name`. A template that does not know tools (SmolLM2's) gets the default tool prompt instead, Hermes-style:
a `# Tools` section at the end of the system message (a new system message if there is none) lists the tools
as JSON inside `<tools></tools>` and asks for each call as `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`; an assistant turn's calls are written that way after its text, and a tool result's text is put
inside `<tool_response></tool_response>`.

A chat request's `chat_template_kwargs` (over the server's `--default-chat-template-kwargs`, key by key) reach the
template as extra variables (Qwen3's `enable_thinking`); unknown keys too, as vLLM passes them; the names the
renderer sets itself (`messages`, `tools`, `add_generation_prompt`, the special tokens, ...) are refused.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ringserve.actors.tokenizer.chat_options import RESERVED_TEMPLATE_NAMES
from ringserve.bus.errors import ApiError, quote
from ringserve.bus.messages import ChatMessage, GenerateRequest

TEMPLATE_KWARGS = "chat_template_kwargs"
CHAT_ROLES = {"system", "user", "assistant", "tool", "developer"}
# Other roles go to the chat template as given, for templates that know them (e.g. `ipython`, `observation`,
# `function`); a template that does not accepts or refuses them itself (its error is a 400). Only names that
# cannot spell a template's control tokens are taken.
CUSTOM_ROLE = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,31}")
DEFAULT_TOOL_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> \
XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def template_uses_tools(template: Any) -> bool:
    """Whether a chat template (its Jinja source, or a dict of named ones) reads the `tools` variable."""
    if isinstance(template, dict):
        return any(template_uses_tools(t) for t in template.values())
    if not isinstance(template, str):
        return False
    import jinja2
    from jinja2 import meta

    try:
        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateError:
        return "tools" in template


def _check_tools(tools: Any) -> list[dict[str, Any]]:
    """`GenerateRequest.tools` as sent over NATS: a list of function tools, each with a name."""
    ok = isinstance(tools, list) and all(
        isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
        for t in tools)
    if not ok:
        raise ApiError("tools must be a list of {\"type\": \"function\", \"function\": {\"name\", ...}}",
                       param="tools")
    return tools


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def template_content(message: ChatMessage) -> str | list[dict[str, str]]:
    """A message's content for the chat template: its text, or with images its parts in order, each image as
    `{"type": "image"}` (which a vision model's template renders as its image placeholder)."""
    if not message.parts:
        return message.content
    return [{"type": "image"} if part.get("type") == "image" else {"type": "text", "text": part.get("text", "")}
            for part in message.parts]


def native_turn(message: ChatMessage) -> dict[str, Any]:
    """A message for a template that knows tools: `tool_calls` with their arguments as objects."""
    turn: dict[str, Any] = {"role": message.role, "content": template_content(message)}
    if message.tool_calls:
        turn["tool_calls"] = [{**call, "function": {**call.get("function", {}), "arguments": _arguments(
            call.get("function", {}).get("arguments", "{}"))}} for call in message.tool_calls]
    if message.tool_call_id is not None:
        turn["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        turn["name"] = message.name
    if message.reasoning_content is not None:
        turn["reasoning_content"] = message.reasoning_content
    return turn


def default_turn(message: ChatMessage) -> dict[str, Any]:
    """A message for a template that does not know tools: calls and results written as text, Hermes-style."""
    if message.parts:  # with images: the parts as they are
        return {"role": message.role, "content": template_content(message)}
    content = message.content
    if message.role == "tool":
        content = f"<tool_response>\n{content}\n</tool_response>"
    for call in message.tool_calls:
        function = call.get("function", {})
        body = json.dumps({"name": function.get("name"), "arguments": _arguments(function.get("arguments", "{}"))},
                          ensure_ascii=False)
        content += ("\n" if content else "") + f"<tool_call>\n{body}\n</tool_call>"
    return {"role": message.role, "content": content}


def with_default_tool_prompt(turns: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`turns` with the default tool prompt ending the system message (prepended as one if there is none)."""
    section = DEFAULT_TOOL_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    if turns and turns[0]["role"] == "system":
        system = turns[0]["content"]
        return [{**turns[0], "content": f"{system}\n\n{section}" if system else section}, *turns[1:]]
    return [{"role": "system", "content": section}, *turns]


def tool_prompt_in_first_turn(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`with_default_tool_prompt`'s turns with its system message (the tool prompt) opening the first user turn."""
    section, first, rest = turns[0]["content"], turns[1], turns[2:]
    return [{**first, "content": f"{section}\n\n{first['content']}"}, *rest]


class PromptEncoder:
    """Applies the model's chat template and tokenizes, with errors a client can act on."""

    def __init__(self, tokenizer: Any, template_kwargs: dict[str, Any] | None = None) -> None:
        """`template_kwargs`: the server's default chat template variables (checked by chat_options.py)."""
        self._tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.template_tools = template_uses_tools(getattr(tokenizer, "chat_template", None))
        self.template_kwargs = dict(template_kwargs or {})

    def encode(self, req: GenerateRequest) -> list[int]:
        """Token ids for the one prompt form that `req` sets; raises ApiError otherwise."""
        return self.encode_prompt(req)[0]

    def encode_prompt(self, req: GenerateRequest) -> tuple[list[int], str | None]:
        """`encode`'s token ids, and for a chat request the rendered prompt text (None for text and ids)."""
        given = [name for name in ("text", "messages", "input_ids") if getattr(req, name) is not None]
        if len(given) != 1:
            raise ApiError("give exactly one of text, messages or input_ids", param=given[-1] if given else "text")
        if req.messages is not None:
            text = self.chat_text(req)
            return self._tokenizer.encode(text, add_special_tokens=False), text
        return self._encode_plain(req), None

    def _encode_plain(self, req: GenerateRequest) -> list[int]:
        if req.chat_template_kwargs:
            raise ApiError(f"{TEMPLATE_KWARGS} needs a chat prompt (messages)", param=TEMPLATE_KWARGS)
        if req.continue_final_message:
            raise ApiError("continue_final_message needs a chat prompt (messages)", param="continue_final_message")
        if req.tools:
            raise ApiError("tools need a chat prompt (messages)", param="tools")
        if req.input_ids is not None:
            ids = req.input_ids
            if not ids or not all(0 <= t < self.vocab_size for t in ids):
                raise ApiError(f"input_ids must be a non-empty list of ids in [0, {self.vocab_size})", param="input_ids")
            return list(ids)
        if not req.text:
            raise ApiError("the prompt is empty", param="prompt")
        return self._tokenizer.encode(req.text)

    def template_variables(self, req: GenerateRequest) -> dict[str, Any]:
        """The extra chat template variables of `req`: its `chat_template_kwargs` over the server's defaults;
        ApiError 400 naming `chat_template_kwargs` for a value that is not an object or a reserved name."""
        given = req.chat_template_kwargs
        if given is None:
            return dict(self.template_kwargs)
        if not isinstance(given, dict) or not all(isinstance(name, str) for name in given):
            raise ApiError(f"{TEMPLATE_KWARGS} must be an object of chat template variables, got {quote(given)}",
                           param=TEMPLATE_KWARGS)
        clash = sorted(str(name) for name in RESERVED_TEMPLATE_NAMES & set(given))
        if clash:
            raise ApiError(f"{TEMPLATE_KWARGS} cannot set {quote(clash[0])}: the server passes it to the chat template "
                           "itself", param=TEMPLATE_KWARGS)
        return {**self.template_kwargs, **given}

    def chat_text(self, req: GenerateRequest) -> str:
        """The text of `req`'s messages through the chat template (with an image placeholder per image part);
        ApiError 400 for messages it refuses."""
        assert req.messages is not None
        if not req.messages:
            raise ApiError("messages must be a non-empty list", param="messages")
        for i, message in enumerate(req.messages):
            if message.role not in CHAT_ROLES and not CUSTOM_ROLE.fullmatch(message.role):
                raise ApiError(f"messages[{i}].role {quote(message.role)} must be one of {sorted(CHAT_ROLES)} or a "
                               "custom role the chat template knows (a letter, then up to 31 letters, digits, _ "
                               "or -)", param="messages")
            if not all(isinstance(call.get("function"), dict) for call in message.tool_calls):
                raise ApiError(f"messages[{i}].tool_calls: each needs a function object", param="messages")
        for name in ("add_generation_prompt", "continue_final_message"):
            if not isinstance(getattr(req, name), bool):
                raise ApiError(f"{name} must be a boolean", param=name)
        if req.continue_final_message:
            if req.add_generation_prompt:
                raise ApiError("continue_final_message and add_generation_prompt cannot both be true: set "
                               "add_generation_prompt to false to continue the final message",
                               param="continue_final_message")
            if req.messages[-1].role != "assistant":
                raise ApiError(f"continue_final_message needs the last message to be the assistant's, not "
                               f"{req.messages[-1].role!r}", param="continue_final_message")
        tools = _check_tools(req.tools) if req.tools else None
        extra = self.template_variables(req)
        if self.template_tools:
            turns = [native_turn(m) for m in req.messages]
            if tools:
                extra["tools"] = tools
        else:
            turns = [default_turn(m) for m in req.messages]
            if tools:
                turns = with_default_tool_prompt(turns, tools)
        try:
            text = self._render(turns, req, extra)
        except ApiError:
            if not (tools and not self.template_tools and req.messages[0].role != "system"):
                raise
            # the system message was ours (the tool prompt) and the template has no system role (Gemma 2's):
            # the tool prompt opens the first user turn instead, as Gemma 3's template does with a system message
            text = self._render(tool_prompt_in_first_turn(turns), req, extra)
        return text

    def _render(self, turns: list[dict[str, Any]], req: GenerateRequest, extra: dict[str, Any]) -> str:
        try:
            return self._tokenizer.apply_chat_template(
                turns, add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message, tokenize=False, **extra)
        except Exception as exc:  # jinja templates raise arbitrary errors for unsupported conversations
            raise ApiError(f"the chat template rejected these messages: {exc}", param="messages") from exc
