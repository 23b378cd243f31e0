"""OpenAI request bodies -> GenerateRequests (the response bodies and stream chunks are bodies.py's).

Only shapes are checked here (what must be an object, a list, a string), plus what the entry itself acts on
(`n`, `echo`, the logprobs switches); the tokenizer actor validates every sampling value. Which OpenAI fields
are sampling parameters, and under which native name, comes from their declarations in `ringserve.bus.params`.

Every top-level field of a body is one of: a field we implement (the sampling parameters of `ringserve.bus.params`, the
entry's Specs below, and each route's own fields), a field that changes nothing (`NO_EFFECT`: accepted), or
a field that would change the output and that we do not implement (`REFUSED`: 400 naming it, unless it has a
value that changes nothing). Anything else is a 400 naming the field, as OpenAI answers (field_checks.py checks
a body against these tables, as every route does against its own). The output
constraints (`response_format`, vLLM's `guided_*`) and the tool fields are read in `tools/request.py`, tool calls
put into responses by `tools/response.py`; chat's template switches (`chat_template_kwargs`, `reasoning_effort`) are
declared in `template_switches`.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

from ringserve.bus.errors import ApiError, clip
from ringserve.actors.entry.errors import model_not_found
from ringserve.actors.entry.field_checks import Refused, check_top_level, unrecognized
from ringserve.actors.entry.http_common import package_version
from ringserve.actors.entry.openai.logprobs import LogprobFormatter
from ringserve.actors.entry.template_switches import (CHAT_TEMPLATE_KWARGS, EFFORT_VARIABLE, REASONING_EFFORT,
                                                      read_effort, template_kwargs, with_defaults)
from ringserve.actors.entry.tool_parsers import DEFAULT_PARSER
from ringserve.actors.entry.tools.request import GUIDED_FIELDS, ToolPlan, output_constraint, parse_messages, parse_tools
from ringserve.bus.messages import GenerateRequest, RequestOutput, TokenLogprob
from ringserve.bus.param_spec import Spec
from ringserve.bus.params import MAX_TOP_LOGPROBS, PROCESSOR_KWARGS, openai_names

# OpenAI name -> native (SGLang) sampling name; SGLang's extensions are accepted under their own names
_SAMPLING_FIELDS = openai_names()
MAX_N = 16
MAX_CHOICES = 256  # prompts × n in one /v1/completions request
# The fields of OpenAI bodies that the entry itself acts on, declared once: checked here, and described in the
# OpenAPI document from the same Spec (the sampling parameters are declared in bus.params).
N = Spec("choices to generate for each prompt; choice i of a prompt samples with seed + i (mod 2^63)", low=1,
         high=MAX_N, kind="integer", name="n")
STREAM = Spec("answer as server-sent events", kind="boolean", name="stream")
CHAT_LOGPROBS = Spec("return the logprob of every generated token", kind="boolean", name="logprobs")
TOP_LOGPROBS = Spec("this many most likely alternatives with every token (needs logprobs)", low=0,
                    high=MAX_TOP_LOGPROBS, kind="integer", name="top_logprobs")
COMPLETION_LOGPROBS = Spec("return logprobs, with this many most likely alternatives per token", low=0,
                           high=MAX_TOP_LOGPROBS, kind="integer", name="logprobs")
ECHO = Spec("put the prompt before each choice's text (a token-id prompt's decoded text); with logprobs, the "
            "prompt's tokens and their logprobs come first (the first token's null)", kind="boolean", name="echo")
TOKENS_AS_IDS = Spec("vLLM's: name every token in logprobs `token_id:<id>` instead of its text", kind="boolean",
                     name="return_tokens_as_token_ids")
CONTINUOUS_USAGE = Spec("vLLM's: with include_usage, every chunk also carries the usage so far",
                        kind="boolean", name="continuous_usage_stats")
PROMPT_LOGPROBS = Spec("vLLM's: each prompt token's logprob with this many alternatives, as prompt_logprobs (the "
                       "first token's null); not with stream", low=0, high=MAX_TOP_LOGPROBS, kind="integer",
                       name="prompt_logprobs")
BEST_OF = Spec("must be 1 or n: choosing the best of more samples than n is not supported", low=1, high=MAX_N,
               kind="integer", name="best_of")


# The one table of OpenAI fields beyond those implemented (listed in docs/api.md). A null value is absent.
NO_EFFECT: dict[str, str] = {
    "user": "an end-user id, for the provider's abuse monitoring",
    "safety_identifier": "an end-user id, for the provider's abuse monitoring",
    "metadata": "tags for the provider's dashboard",
    "store": "whether the provider keeps the completion",
    "service_tier": "the provider's processing tier",
    "prompt_cache_key": "a routing hint for the provider's prompt cache (the prefix cache is automatic)",
}
_TOOLS = "tool calling is supported on /v1/chat/completions only"
_FUNCTIONS = "the deprecated functions API is not supported: use tools and tool_choice"
_TEMPLATE = "only chat requests have a chat template: use /v1/chat/completions"
# Refused where a route does not implement them: the tool and template fields are chat's (ROUTE_FIELDS), so these
# entries answer /v1/completions.
REFUSED: dict[str, Refused] = {
    "tools": Refused(_TOOLS, ([],)),
    "tool_choice": Refused(_TOOLS, ("none",)),
    "parallel_tool_calls": Refused(_TOOLS),
    "functions": Refused(_FUNCTIONS, ([],)),
    "function_call": Refused(_FUNCTIONS, ("none",)),
    "prediction": Refused("predicted outputs are not supported"),
    "audio": Refused("audio output is not supported"),
    "modalities": Refused("only text output is supported ([\"text\"])", (["text"],)),
    "reasoning_effort": Refused(_TEMPLATE),
    "chat_template_kwargs": Refused(_TEMPLATE),
    "thinking_token_budget": Refused("a thinking budget needs a chat request (a reasoning model's thinking opens "
                                     "in its chat template): use /v1/chat/completions"),
    "verbosity": Refused("verbosity is not supported"),
    "web_search_options": Refused("web search is not supported"),
    "suffix": Refused("text after the completion (insertion) is not supported", ("",)),
}
STREAM_OPTIONS_NO_EFFECT = {"include_obfuscation": "random padding against length side channels"}
_COMMON_FIELDS = {"model", "n", "stream", "stream_options", "response_format", "return_tokens_as_token_ids",
                  *GUIDED_FIELDS, *_SAMPLING_FIELDS}
ROUTE_FIELDS: dict[str, set[str]] = {
    "chat": _COMMON_FIELDS | {"messages", "logprobs", "top_logprobs", "add_generation_prompt",
                              "continue_final_message", "prompt_logprobs", "tools", "tool_choice",
                              "parallel_tool_calls", PROCESSOR_KWARGS, CHAT_TEMPLATE_KWARGS.name,
                              REASONING_EFFORT.name},
    "completion": (_COMMON_FIELDS - set(REFUSED)) | {"prompt", "logprobs", "echo", "best_of", "prompt_logprobs"},
}


def check_fields(body: dict[str, Any], kind: str) -> None:
    """ApiError 400 naming the first field of `body` that route `kind` neither implements nor can ignore."""
    check_top_level(body, ROUTE_FIELDS[kind], NO_EFFECT, REFUSED, unrecognized)


@dataclass
class ApiOptions:
    """How the entry shapes the response of one OpenAI request."""

    kind: str  # "chat" or "completion"
    stream: bool
    include_usage: bool
    model: str
    created: int
    n: int = 1  # choices per prompt; choice index = prompt index * n + i
    logprobs: bool = False  # the client asked for logprobs
    top_logprobs: int = 0  # and this many alternatives per token
    # with echo: each prompt, put before its choices' text (token ids until the route decodes them: `echo_ids`)
    echo: list[str | list[int]] = field(default_factory=list)
    echo_logprobs: bool = False  # echo with logprobs: the prompt tokens' logprobs come before the choice's
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs: the prompt tokens' logprobs in their own field
    token_ids: bool = False  # vLLM's return_token_ids: the prompt's and each choice's token ids
    tools: ToolPlan | None = None  # chat with tools the model may call: the calls are read out of the text
    constraint_param: str | None = None  # the body field the output constraint came from, named in its errors
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens `token_id:<id>`
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: usage on every chunk
    fingerprint: str = ""  # system_fingerprint: what served the response (ringserve's version and the model)
    lora_name: str | None = None  # the LoRA adapter `model` names ("name" or "<served>:name"); the route checks it

    @property
    def echo_ids(self) -> list[int]:
        """The indices of the echoed prompts still given as token ids (the route decodes them)."""
        return [i for i, p in enumerate(self.echo) if not isinstance(p, str)]

    @property
    def object_name(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    def echo_text(self, index: int) -> str:
        """The text choice `index` starts with: its prompt with echo, else nothing."""
        if not self.echo:
            return ""
        text = self.echo[index // self.n]
        assert isinstance(text, str), "token-id prompts are decoded before any output is shaped"
        return text

    def entries(self, out: RequestOutput) -> list[TokenLogprob]:
        """The logprob entries of one output of a choice: with echo, the prompt's (first output only) first."""
        return out.prompt_logprobs + out.logprobs if self.echo_logprobs else out.logprobs

    def logprob_formatter(self) -> LogprobFormatter:
        """A fresh formatter for one choice's logprobs."""
        return LogprobFormatter(self.kind, self.logprobs, self.top_logprobs > 0, self.tokens_as_ids)


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    return {ours: body[theirs] for theirs, ours in _SAMPLING_FIELDS.items() if body.get(theirs) is not None}


def _chat_logprobs(body: dict[str, Any], sampling: dict[str, Any]) -> tuple[bool, int]:
    """Chat's `logprobs` (bool) and `top_logprobs` (int, needs logprobs) -> return_logprob, top_logprobs_num."""
    logprobs = CHAT_LOGPROBS.read(body, False)
    if body.get("top_logprobs") is not None and not logprobs:
        raise ApiError("top_logprobs requires logprobs to be true", param="top_logprobs")
    top = TOP_LOGPROBS.read(body, 0)
    if logprobs:
        sampling["return_logprob"] = True
        sampling["top_logprobs_num"] = top
    return logprobs, top


def _completion_logprobs(body: dict[str, Any], sampling: dict[str, Any]) -> tuple[bool, int]:
    """Completions' `logprobs: k` -> return_logprob with k alternatives per token."""
    k = body.get("logprobs")
    if k is None or k is False:
        return False, 0
    k = COMPLETION_LOGPROBS.check(k)
    sampling["return_logprob"] = True
    sampling["top_logprobs_num"] = k
    return True, k


def _prompt_logprobs(body: dict[str, Any], sampling: dict[str, Any], options: ApiOptions) -> None:
    """vLLM's `prompt_logprobs: k`: score the prompt from its first token, with k alternatives (the same k as
    the output's, when logprobs are also asked for: the engine takes one count for both)."""
    k = PROMPT_LOGPROBS.read(body, None)
    if k is None:
        return
    if options.stream:
        raise ApiError("prompt_logprobs is not supported with stream: true", param="prompt_logprobs")
    if options.logprobs and k != options.top_logprobs:
        raise ApiError(f"prompt_logprobs ({k}) must equal the number of output alternatives asked for "
                       f"({options.top_logprobs})", param="prompt_logprobs")
    sampling.update(return_logprob=True, top_logprobs_num=k, logprob_start_len=0)
    options.prompt_logprobs = True


def _options(body: dict[str, Any], kind: str, served_model: str) -> ApiOptions:
    check_fields(body, kind)
    model = body.get("model")
    lora_name = adapter_of(model, served_model)
    stream = STREAM.read(body, False)
    stream_options = body.get("stream_options")
    if stream_options is not None and not stream:
        raise ApiError("stream_options is only allowed with stream: true", param="stream_options")
    stream_options = stream_options or {}
    if not isinstance(stream_options, dict):
        raise ApiError("stream_options must be an object", param="stream_options")
    for name in stream_options:
        if name not in ("include_usage", "continuous_usage_stats") and name not in STREAM_OPTIONS_NO_EFFECT:
            raise ApiError(f"Unrecognized request argument supplied: stream_options.{clip(str(name))}",
                           param="stream_options")
    include_usage = stream_options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise ApiError("stream_options.include_usage must be a boolean", param="stream_options")
    try:
        continuous = CONTINUOUS_USAGE.read(stream_options, False)
    except ApiError as exc:
        raise ApiError(f"stream_options.{exc}", param="stream_options") from None
    if continuous and not include_usage:
        raise ApiError("stream_options.continuous_usage_stats needs include_usage: true", param="stream_options")
    return ApiOptions(kind, stream, bool(include_usage), model if lora_name else served_model, int(time.time()),
                      n=N.read(body, 1), continuous_usage=continuous, tokens_as_ids=TOKENS_AS_IDS.read(body, False),
                      fingerprint=system_fingerprint(served_model), lora_name=lora_name)


def system_fingerprint(served_model: str) -> str:
    """OpenAI's `system_fingerprint`: names what served a response (ringserve's version and the served
    model), so a client sees when either changed."""
    return "fp_" + hashlib.blake2b(f"{package_version()}\0{served_model}".encode(), digest_size=6).hexdigest()


def adapter_of(model: Any, served_model: str) -> str | None:
    """The LoRA adapter a body's `model` names (`"name"` or `"<served>:name"`, as vLLM and SGLang take it); None
    for the served model itself or no model. Whether the adapter is loaded is the route's check
    (`EntryService.require_adapter`)."""
    if model is None or model == served_model:
        return None
    if not isinstance(model, str) or not model.removeprefix(served_model + ":"):
        raise model_not_found(model, served_model)
    return model.removeprefix(served_model + ":")


def _constrain(body: dict[str, Any], sampling: dict[str, Any], options: ApiOptions) -> None:
    """Put the body's output constraint (response_format, guided_*, a forced tool call) into `sampling`."""
    constraint = output_constraint(body, options.tools)
    if constraint is not None:
        native, value, options.constraint_param = constraint
        sampling[native] = value


def parse_chat(body: dict[str, Any], rid: str, served_model: str,
               tool_parser: str = DEFAULT_PARSER) -> tuple[GenerateRequest, ApiOptions]:
    """A /v1/chat/completions body as a GenerateRequest plus response options; `tool_parser` reads the calls
    of `tool_choice: "auto"` out of the text."""
    turns = parse_messages(body.get("messages"))
    options = _options(body, "chat", served_model)
    options.tools = parse_tools(body, tool_parser)
    sampling = _sampling(body)
    if options.lora_name:
        sampling["lora_name"] = options.lora_name
    tools = options.tools
    if tools is not None and tools.choice == "auto" and tools.parser.keeps_special_tokens \
            and "skip_special_tokens" not in body:  # the parser must see its tags (vLLM does the same)
        sampling["skip_special_tokens"] = False
    _constrain(body, sampling, options)
    options.token_ids = sampling.get("return_prompt_ids") is True
    options.logprobs, options.top_logprobs = _chat_logprobs(body, sampling)
    _prompt_logprobs(body, sampling, options)
    # vLLM's chat-template switches; the tokenizer rejects both true and a final message not the assistant's
    template = {name: Spec(doc, kind="boolean", name=name).read(body, default) for name, doc, default in (
        ("add_generation_prompt", "end the prompt with the assistant's turn header", True),
        ("continue_final_message", "continue the final (assistant) message instead of opening a new turn", False))}
    switches = with_defaults(template_kwargs(body.get(CHAT_TEMPLATE_KWARGS.name)),
                             **{EFFORT_VARIABLE: read_effort(body.get(REASONING_EFFORT.name))})
    return GenerateRequest(rid=rid, messages=turns, sampling=sampling, openai_names=True, stream=options.stream,
                           tools=options.tools.tools if options.tools else None,
                           mm_processor_kwargs=body.get(PROCESSOR_KWARGS), chat_template_kwargs=switches,
                           **template), options


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def prompt_forms(prompt: Any, field: str = "prompt") -> list[str | list[int]]:
    """OpenAI's four prompt forms (a string, token ids, a list of strings, a list of token-id lists) as a list
    of prompts; a list may mix strings and token-id lists. `field`: the body field they came in (completions'
    `prompt`, embeddings' `input`), named in the 400."""
    if isinstance(prompt, str) or _is_token_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_token_ids(p) for p in prompt):
        return list(prompt)
    raise ApiError(f"{field} must be a string, a non-empty list of token ids, or a non-empty list of those",
                   param=field)


def parse_completion(body: dict[str, Any], rid: str,
                     served_model: str) -> tuple[list[GenerateRequest], ApiOptions]:
    """A /v1/completions body as one GenerateRequest per prompt (each with `rid`) plus response options."""
    options = _options(body, "completion", served_model)
    prompts = prompt_forms(body.get("prompt"))
    if len(prompts) * options.n > MAX_CHOICES:
        raise ApiError(f"{len(prompts)} prompts × n={options.n} is more than {MAX_CHOICES} choices",
                       param="prompt")
    best_of = BEST_OF.read(body, 1)
    if best_of not in (1, options.n):
        raise ApiError(f"best_of={best_of!r} is not supported: it must be 1 or n", param="best_of")
    sampling = _sampling(body)
    if options.lora_name:
        sampling["lora_name"] = options.lora_name
    _constrain(body, sampling, options)
    options.token_ids = sampling.get("return_prompt_ids") is True
    options.logprobs, options.top_logprobs = _completion_logprobs(body, sampling)
    _prompt_logprobs(body, sampling, options)
    if ECHO.read(body, False):
        options.echo = list(prompts)  # token ids are decoded by the route (`echo_ids`)
        if options.logprobs:
            sampling["logprob_start_len"] = 0
            options.echo_logprobs = True
    text_or_ids = [{"text": p} if isinstance(p, str) else {"input_ids": p} for p in prompts]
    return [GenerateRequest(rid=rid, sampling=sampling, openai_names=True, stream=options.stream, **prompt)
            for prompt in text_or_ids], options
