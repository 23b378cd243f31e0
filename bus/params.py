"""Every request and sampling parameter, declared once: `SamplingParams` and the metadata of its fields.

`SamplingParams` is the validated struct that travels from the tokenizer to the scheduler and into the engine
(`TokenizedRequest.sampling`). Each field carries a `Spec` in its metadata: its range, one-line doc, the name an
OpenAI body uses for it, and the shape of composite values (`ringserve.bus.param_spec.Spec`). Everything else derives
from these declarations: the tokenizer's validation (`actors/tokenizer/validation.py`), the entry's OpenAI name map
(`openai_names()`), the OpenAPI schema (`Spec.json_schema`) and the docs table (`param_rows()`, written into
docs/api.md by scripts/gen_docs.py). Adding a parameter is one field here plus its implementation.

Torch-free: the engine and every actor import these types.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ringserve.bus.errors import ApiError
from ringserve.bus.reasoning import ReasoningPlan
from ringserve.bus.param_spec import LOGIT_BIAS, STOP_STRINGS, TOKEN_IDS, Spec, param, plain_number, specs_of

MAX_STOP_STRINGS = 32
MAX_STOP_TOKEN_IDS = 256
MAX_SEED = 2**63 - 1
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_GRAMMAR_CHARS = 65536
GRAMMAR_PARAMS = ("json_schema", "regex", "ebnf", "structural_tag")  # the output constraints; at most one a request


@dataclass
class SamplingParams:
    """Validated sampling parameters; everything that affects the model is fixed here."""

    max_new_tokens: int = param(doc="tokens to generate at most; 0 scores the prompt only (with logprob_start_len)",
                                low=0, openai=("max_tokens", "max_completion_tokens"),
                                default_doc="the rest of the context window (128 in /generate)")
    min_new_tokens: int = param(0, "no stop token or stop string ends the request before this many tokens", low=0,
                                openai=("min_tokens",), default_doc="0 (at most max_tokens)")
    temperature: float = param(1.0, "divides the logits; 0 samples greedily", low=0)
    top_p: float = param(1.0, "sample from the smallest set of tokens whose probability reaches top_p", low=0,
                         high=1, low_open=True)
    top_k: int = param(-1, "sample from the k most likely tokens; -1 or 0 = off", low=-1)
    min_p: float = param(0.0, "drop tokens less likely than min_p × the most likely one's probability", low=0, high=1)
    frequency_penalty: float = param(0.0, "subtract penalty × (times the token was generated) from its logit",
                                     low=-2, high=2)
    presence_penalty: float = param(0.0, "subtract the penalty from the logit of every token generated so far",
                                    low=-2, high=2)
    repetition_penalty: float = param(1.0, "divide positive (multiply negative) logits of tokens seen in the prompt "
                                      "or output", low=0, high=2, low_open=True)
    logit_bias: dict[int, float] = param({}, "token id → bias added to its logit", shape=LOGIT_BIAS,
                                         max_items=MAX_LOGIT_BIAS_ENTRIES)
    seed: int | None = param(None, "makes sampling reproducible: the same seed, prompt and parameters give the same "
                             "tokens", low=0, high=MAX_SEED, default_doc="random")
    stop: list[str] = param([], "stop strings: the text ends before the first match (kept with no_stop_trim)",
                            shape=STOP_STRINGS, max_items=MAX_STOP_STRINGS)
    stop_token_ids: list[int] = param([], "token ids that end the request besides EOS", shape=TOKEN_IDS,
                                      max_items=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = param(False, "do not stop at the model's EOS tokens (stop_token_ids still stop)")
    skip_special_tokens: bool = param(True, "leave special tokens out of the text")
    no_stop_trim: bool = param(False, "keep the matched stop string at the end of the text")
    truncate_prompt_tokens: int | None = param(None, "keep only this many prompt tokens (vLLM's option): the last "
                                               "ones, or the first with truncation_side right", low=1,
                                               default_doc="none (the whole prompt)")
    truncation_side: str = param("left", "with truncate_prompt_tokens: left drops the prompt's first tokens, right "
                                 "its last", choices=("left", "right"))
    cache_salt: str | None = param(None, "a prefix-cache namespace (vLLM's): a request reuses cached prompt tokens "
                                   "only of requests with the same salt, so tenants cannot probe each other's "
                                   "prompts by timing", max_items=256, default_doc="none (one shared cache)")
    lora_name: str | None = param(None, "the LoRA adapter to run the request with (a name the server loaded); "
                                  "OpenAI routes choose it with the model field", max_items=256, openai=(),
                                  default_doc="none (the base model)")
    return_logprob: bool = param(False, "return the logprob of every generated token", openai=(),
                                 default_doc="false (true when top_logprobs_num > 0)")
    top_logprobs_num: int = param(0, "return this many most likely alternatives with every token", low=0,
                                  high=MAX_TOP_LOGPROBS, openai=())
    logprob_start_len: int = param(-1, "with return_logprob: also return the logprobs of the prompt's tokens from "
                                   "this position on (the first token's is null); -1 = none", low=-1, openai=())

    json_schema: str | None = param(None, "constrain the output to JSON valid under this JSON schema (given as a "
                                    "string); {\"type\": \"object\"} asks for any JSON object",
                                    max_items=MAX_GRAMMAR_CHARS, openai=(), default_doc="none")
    regex: str | None = param(None, "constrain the output to a full match of this regular expression",
                              max_items=MAX_GRAMMAR_CHARS, openai=(), default_doc="none")
    ebnf: str | None = param(None, "constrain the output to this EBNF grammar (xgrammar's GBNF dialect, start rule "
                             "root)", max_items=MAX_GRAMMAR_CHARS, openai=(), default_doc="none")
    structural_tag: str | None = param(None, "constrain the output to this xgrammar structural tag (its JSON text), "
                                       "e.g. free text until a trigger, then a tag with constrained content; "
                                       "chat's tool_choice auto sets it", max_items=MAX_GRAMMAR_CHARS, openai=(),
                                       default_doc="none")
    return_prompt_ids: bool = param(False, "return the prompt's token ids with the first output",
                                    openai=("return_token_ids",))
    thinking_token_budget: int | None = param(None, "the most tokens a reasoning model may think before its "
                                              "thinking is closed and it answers (needs a reasoning parser)", low=0,
                                              default_doc="the server's --reasoning-budget (no limit)")
    speculative: bool = param(True, "false: never decode this request speculatively (with "
                              "--speculative-algorithm; greedy output is the same either way)")

    @property
    def grammar(self) -> tuple[str, str] | None:
        """The output constraint as `(kind, source)` (kind one of GRAMMAR_PARAMS), or None."""
        return next(((name, getattr(self, name)) for name in GRAMMAR_PARAMS if getattr(self, name) is not None),
                    None)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether the engine computes logprobs of prompt tokens (`logprob_start_len` on)."""
        return self.return_logprob and self.logprob_start_len >= 0

    @property
    def uses_penalties(self) -> bool:
        """Whether any penalty needs the counts of the tokens seen so far."""
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1

    def decode_params(self, reasoning: ReasoningPlan | None = None) -> DecodeParams:
        """What the detokenizer needs of these parameters, and of the request's reasoning plan."""
        return DecodeParams(stop=self.stop, skip_special_tokens=self.skip_special_tokens,
                            no_stop_trim=self.no_stop_trim, reasoning=reasoning)


@dataclass
class DecodeParams:
    """The detokenizer's view of a request's `SamplingParams`: hold back possible stop strings, trim the
    matched one, and how to render special tokens."""

    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    reasoning: ReasoningPlan | None = None  # split the thinking into RequestOutput.reasoning_text


SPECS: dict[str, Spec] = specs_of(SamplingParams)  # native name -> Spec, in declaration order

POOLINGS = ("last", "mean")


@dataclass
class EmbedParams:
    """What makes a request an embedding request (`GenerateRequest.embed`): prefilled, nothing generated, and
    answered with the pooled final-norm hidden state of its prompt (`RequestOutput.embedding`)."""

    pooling: str | None = param(None, "last: the final hidden state (after the model's final norm) of the last "
                                "prompt token; mean: the mean over every prompt token (no prefix-cache reuse)",
                                choices=POOLINGS, default_doc="the server's --embedding-pooling (last)")
    normalize: bool = param(True, "scale the vector to unit length (as OpenAI's are); false: the raw pooled state")


EMBED_SPECS: dict[str, Spec] = specs_of(EmbedParams)

PROCESSOR_KWARGS = "mm_processor_kwargs"  # vLLM's name of the field holding them


@dataclass
class ImageProcessing:
    """Options for a vision-language model's image processor, per request (vLLM's `mm_processor_kwargs`); None
    keeps the model's own setting (its preprocessor config). A model whose image processor does not take one is
    refused, naming it. Gemma 3's pan-and-scan crops a large image whose sides differ by `min_ratio_to_activate`
    or more into 2 to `max_num_crops` crops of at least `min_crop_size` pixels, each an image of its own after the
    whole image."""

    do_pan_and_scan: bool | None = param(None, "Gemma 3: add crops of a large non-square image as images of their "
                                         "own (pan and scan)", default_doc="the model's (off)")
    pan_and_scan_min_crop_size: int | None = param(None, "Gemma 3 pan and scan: the smallest crop side, in pixels",
                                                   low=1, high=8192, default_doc="the model's (256)")
    pan_and_scan_max_num_crops: int | None = param(None, "Gemma 3 pan and scan: most crops per image", low=1,
                                                   high=16, default_doc="the model's (4)")
    pan_and_scan_min_ratio_to_activate: float | None = param(None, "Gemma 3 pan and scan: crop only an image whose "
                                                             "longer side is at least this many times the shorter",
                                                             low=1, high=100, default_doc="the model's (1.2)")


PROCESSOR_SPECS: dict[str, Spec] = specs_of(ImageProcessing)


def processor_kwargs(value: Any) -> dict[str, Any]:
    """A request's `mm_processor_kwargs` checked against `ImageProcessing` (ApiError 400 naming the bad key):
    the options it sets, without those left null."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ApiError(f"{PROCESSOR_KWARGS} must be an object", param=PROCESSOR_KWARGS)
    out = {}
    for key, item in value.items():
        name = f"{PROCESSOR_KWARGS}.{key}"
        spec = PROCESSOR_SPECS.get(key)
        if spec is None:
            raise ApiError(f"{name} is not an image processor option this server takes (it takes "
                           f"{', '.join(PROCESSOR_SPECS)})", param=PROCESSOR_KWARGS)
        if item is not None:
            try:
                out[key] = spec.check(item)
            except ApiError as exc:
                raise ApiError(f"{PROCESSOR_KWARGS}.{exc.message}", param=PROCESSOR_KWARGS) from None
    return out


def default_of(name: str) -> Any:
    """A parameter's default value (None for max_new_tokens: the rest of the context)."""
    f = SamplingParams.__dataclass_fields__[name]
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def openai_names() -> dict[str, str]:
    """OpenAI body name -> native name, for every parameter an OpenAI body may set directly."""
    return {alias: name for name, spec in SPECS.items() for alias in (spec.openai if spec.openai is not None
                                                                     else (name,))}


def param_rows() -> list[dict[str, str]]:
    """One row per parameter for the docs table: name, openai, type, range, default, doc."""
    rows = []
    for name, spec in SPECS.items():
        default = spec.default_doc or _default_text(default_of(name))
        rows.append({"name": name, "openai": ", ".join(spec.openai if spec.openai is not None else (name,)),
                     "type": spec.kind or spec.shape or "", "range": spec.range_text(), "default": default,
                     "doc": spec.doc})
    return rows


def _default_text(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if value in ([], {}, None):
        return "none"
    return str(plain_number(value)) if isinstance(value, float) else str(value)
