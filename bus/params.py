"""Every request and sampling parameter, declared once: `SamplingParams` and the metadata of its fields.

`SamplingParams` is the validated struct that travels from the tokenizer to the scheduler and into the engine
(`TokenizedRequest.sampling`). Each field carries a `Spec` in its metadata: its range, one-line doc, the name an
OpenAI body uses for it, and the shape of composite values. Everything else derives from these declarations:
the tokenizer's validation (`actors/tokenizer/validation.py`), the entry's OpenAI name map
(`openai_names()`), the OpenAPI schema (`Spec.json_schema`) and the docs table (`param_rows()`, written into
docs/api.md by scripts/gen_docs.py). Adding a parameter is one field here plus its implementation.

Torch-free: the engine and every actor import these types.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_SEED = 2**63 - 1
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS_ENTRIES = 1024
LOGIT_BIAS_LIMIT = 100.0

# Shapes of values beyond plain numbers and booleans; validation and the JSON schema know each one.
STOP_STRINGS, TOKEN_IDS, LOGIT_BIAS = "stop_strings", "token_ids", "logit_bias"


@dataclass(frozen=True)
class Spec:
    """How one parameter is checked, named and documented.

    `low`/`high` bound numbers (`low_open`: `low` itself is excluded); `openai` lists the names an OpenAI body
    uses (None: the same name; empty: not taken from OpenAI bodies, the entry maps it itself); `shape` is set for
    composite values; `kind` ("integer", "number", "boolean") is filled from the field's type.
    """

    doc: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    openai: tuple[str, ...] | None = None
    shape: str | None = None
    max_items: int | None = None
    kind: str = ""
    name: str = ""  # filled from the field
    default_doc: str | None = None  # how the default reads in the docs, when it is not a constant

    @property
    def error_name(self) -> str:
        """The name an error reports in `param`: the OpenAI name where there is one."""
        return self.openai[0] if self.openai else self.name

    def range_text(self) -> str:
        """The accepted range, as the docs and error messages print it."""
        if self.shape == STOP_STRINGS:
            return f"≤ {self.max_items} non-empty strings of ≤ {MAX_STOP_CHARS} characters"
        if self.shape == TOKEN_IDS:
            return f"≤ {self.max_items} token ids in [0, vocab)"
        if self.shape == LOGIT_BIAS:
            return f"≤ {self.max_items} token ids → [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]"
        if self.low is None and self.high is None:
            return ""
        low = "-inf" if self.low is None else _num(self.low)
        high = "inf" if self.high is None else _num(self.high)
        return f"{'(' if self.low_open or self.low is None else '['}{low}, {high}{']' if self.high is not None else ')'}"

    def json_schema(self) -> dict[str, Any]:
        """The JSON schema of this parameter's value (null means the default)."""
        if self.shape == STOP_STRINGS:
            item = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
            schema: dict[str, Any] = {"oneOf": [item, {"type": "array", "maxItems": self.max_items, "items": item}]}
        elif self.shape == TOKEN_IDS:
            schema = {"type": "array", "maxItems": self.max_items, "items": {"type": "integer", "minimum": 0}}
        elif self.shape == LOGIT_BIAS:
            schema = {"type": "object", "maxProperties": self.max_items, "propertyNames": {"pattern": "^[0-9]+$"},
                      "additionalProperties": {"type": "number", "minimum": -LOGIT_BIAS_LIMIT,
                                               "maximum": LOGIT_BIAS_LIMIT}}
        else:
            schema = {"type": self.kind}
            if self.low is not None:
                schema["exclusiveMinimum" if self.low_open else "minimum"] = _num(self.low)
            if self.high is not None:
                schema["maximum"] = _num(self.high)
        schema["description"] = self.doc
        return schema


def _num(value: float) -> int | float:
    return int(value) if float(value).is_integer() and abs(value) < 2**63 else value


def param(default: Any = dataclasses.MISSING, doc: str = "", **spec: Any) -> Any:
    """A `SamplingParams` field with its `Spec` (list and dict defaults are copied per instance)."""
    meta = {"spec": Spec(doc, **spec)}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class SamplingParams:
    """Validated sampling parameters; everything that affects the model is fixed here."""

    max_new_tokens: int = param(doc="tokens to generate at most", low=1, openai=("max_tokens", "max_completion_tokens"),
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
    return_logprob: bool = param(False, "return the logprob of every generated token", openai=(),
                                 default_doc="false (true when top_logprobs_num > 0)")
    top_logprobs_num: int = param(0, "return this many most likely alternatives with every token", low=0,
                                  high=MAX_TOP_LOGPROBS, openai=())

    @property
    def uses_penalties(self) -> bool:
        """Whether any penalty needs the counts of the tokens seen so far."""
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1

    def decode_params(self) -> DecodeParams:
        """What the detokenizer needs of these parameters."""
        return DecodeParams(stop=self.stop, skip_special_tokens=self.skip_special_tokens,
                            no_stop_trim=self.no_stop_trim)


@dataclass
class DecodeParams:
    """The detokenizer's view of a request's `SamplingParams`: hold back possible stop strings, trim the
    matched one, and how to render special tokens."""

    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    no_stop_trim: bool = False


_KINDS = {"int": "integer", "float": "number", "bool": "boolean", "int | None": "integer"}


def _collect_specs() -> dict[str, Spec]:
    specs = {}
    for f in dataclasses.fields(SamplingParams):
        spec: Spec = f.metadata["spec"]
        object.__setattr__(spec, "name", f.name)
        if not spec.shape:
            object.__setattr__(spec, "kind", _KINDS[str(f.type)])
        specs[f.name] = spec
    return specs


SPECS = _collect_specs()  # native name -> Spec, in declaration order


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
    return str(_num(value)) if isinstance(value, float) and math.isfinite(value) else str(value)
