"""`Spec`: how one declared request parameter is checked, named, documented and described as JSON schema.

The declarations themselves live in `ringserve.bus.params` (sampling parameters) and, for the few fields only the HTTP
entry acts on (`n`, `stream`, OpenAI's logprobs switches), in `actors/entry/openai/protocol.py`. Every check
of a single value is `Spec.check`; rules that relate parameters to each other or to the model stay with the
actor that knows them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from ringserve.bus.errors import ApiError, quote

MAX_STOP_CHARS = 256
LOGIT_BIAS_LIMIT = 100.0
MAX_STRING_CHARS = 1000  # a string parameter without its own `max_items`

# Shapes of values beyond plain numbers and booleans; `check` and `json_schema` know each one.
STOP_STRINGS, TOKEN_IDS, LOGIT_BIAS = "stop_strings", "token_ids", "logit_bias"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def plain_number(value: float) -> int | float:
    """`value` as an int when it is a whole number (how ranges and defaults print)."""
    return int(value) if float(value).is_integer() and abs(value) < 2**63 else value


@dataclass(frozen=True)
class Spec:
    """One parameter: `kind` ("integer", "number", "boolean", "string": `max_items` characters at most, or one of
    `choices`) or a composite `shape`, bounds (`low_open`: `low`
    itself is excluded), a one-line `doc`, and `openai`, the names an OpenAI body uses for it (None: the same
    name; empty: not taken from OpenAI bodies directly). `name` and `kind` are filled from the declaring field."""

    doc: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    openai: tuple[str, ...] | None = None
    shape: str | None = None
    max_items: int | None = None
    kind: str = ""
    name: str = ""
    default_doc: str | None = None  # how the default reads in the docs, when it is not a constant
    choices: tuple[str, ...] | None = None  # a string parameter that takes only these values

    @property
    def error_name(self) -> str:
        """The name an OpenAI client knows this parameter by (its first OpenAI name where there is one)."""
        return self.openai[0] if self.openai else self.name

    def label(self, openai: bool) -> str:
        """The name errors report in `param` and messages: the OpenAI one for OpenAI bodies, else the native."""
        return self.error_name if openai else self.name

    def range_text(self) -> str:
        """The accepted range, as the docs and error messages print it."""
        if self.choices:
            return " or ".join(self.choices)
        if self.kind == "string":
            return f"≤ {self.max_items} characters"
        if self.shape == STOP_STRINGS:
            return f"≤ {self.max_items} non-empty strings of ≤ {MAX_STOP_CHARS} characters"
        if self.shape == TOKEN_IDS:
            return f"≤ {self.max_items} token ids in [0, vocab)"
        if self.shape == LOGIT_BIAS:
            return f"≤ {self.max_items} token ids → [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]"
        if self.low is None and self.high is None:
            return ""
        low = "-inf" if self.low is None else str(plain_number(self.low))
        high = "inf)" if self.high is None else f"{plain_number(self.high)}]"
        return f"{'(' if self.low_open or self.low is None else '['}{low}, {high}"

    def check(self, value: Any, vocab_size: int = 2**63, openai: bool = True) -> Any:
        """`value` (not None) as this parameter's type, or ApiError 400 naming the parameter (`openai`: by its
        OpenAI name, see `label`)."""
        name = self.label(openai)
        return self._composite(value, vocab_size, name) if self.shape else self._scalar(value, name)

    def read(self, body: dict[str, Any], default: Any) -> Any:
        """`body[name]` checked, or `default` when it is missing or null."""
        value = body.get(self.name)
        return default if value is None else self.check(value)

    @staticmethod
    def _bad(name: str, what: str, value: Any) -> ApiError:
        return ApiError(f"{name} must be {what}, got {quote(value)}", param=name)

    def _scalar(self, value: Any, name: str) -> Any:
        if self.choices:
            if value not in self.choices:
                raise self._bad(name, f"one of {', '.join(map(repr, self.choices))}", value)
            return value
        if self.kind == "string":
            if not isinstance(value, str) or not 0 < len(value) <= (self.max_items or MAX_STRING_CHARS):
                raise self._bad(name, f"a non-empty string of {self.range_text()}", value)
            return value
        if self.kind == "boolean":
            if not isinstance(value, bool):
                raise self._bad(name, "a boolean", value)
            return value
        if self.kind == "integer" and not _is_int(value):
            raise self._bad(name, "an integer" + (f" in {self.range_text()}" if self.range_text() else ""), value)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self._bad(name, "a finite number", value)
        low, high = self.low, self.high
        if (low is not None and (value < low or (self.low_open and value == low))) or (high is not None and value > high):
            raise self._bad(name, f"in {self.range_text()}", value)
        return value if self.kind == "integer" else float(value)

    def _composite(self, value: Any, vocab_size: int, name: str) -> Any:
        limit = self.max_items or 0
        if self.shape == STOP_STRINGS:
            stops = [value] if isinstance(value, str) else value
            if (not isinstance(stops, list) or len(stops) > limit
                    or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)):
                raise self._bad(name, f"a string or a list of {self.range_text()}", value)
            return list(dict.fromkeys(stops))
        if self.shape == TOKEN_IDS:
            if not isinstance(value, list) or len(value) > limit:
                raise self._bad(name, f"a list of at most {limit} token ids in [0, {vocab_size})", value)
            bad = [t for t in value if not (_is_int(t) and 0 <= t < vocab_size)]
            if bad:
                raise ApiError(f"{name}: {_listed(bad)} not token ids in [0, {vocab_size})", param=name)
            return list(value)
        assert self.shape == LOGIT_BIAS, self.shape
        if not isinstance(value, dict) or len(value) > limit:
            raise self._bad(name, f"an object of at most {limit} token ids", value)
        bad_keys = [key for key in value if (token := _token_key(key)) is None or not 0 <= token < vocab_size]
        if bad_keys:
            raise ApiError(f"{name}: the keys {_listed(bad_keys)} are not token ids in [0, {vocab_size})",
                           param=name)
        bias: dict[int, float] = {}
        for key, amount in value.items():
            token = _token_key(key)
            assert token is not None
            if (isinstance(amount, bool) or not isinstance(amount, (int, float)) or not math.isfinite(amount)
                    or abs(amount) > LOGIT_BIAS_LIMIT):
                raise self._bad(name, f"biases in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]", amount)
            bias[token] = float(amount)
        return bias

    def json_schema(self) -> dict[str, Any]:
        """The JSON schema of this parameter's value."""
        if self.shape == STOP_STRINGS:
            item = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
            schema: dict[str, Any] = {"oneOf": [item, {"type": "array", "maxItems": self.max_items, "items": item}]}
        elif self.shape == TOKEN_IDS:
            schema = {"type": "array", "maxItems": self.max_items, "items": {"type": "integer", "minimum": 0}}
        elif self.shape == LOGIT_BIAS:
            schema = {"type": "object", "maxProperties": self.max_items, "propertyNames": {"pattern": "^[0-9]{1,19}$"},
                      "additionalProperties": {"type": "number", "minimum": -LOGIT_BIAS_LIMIT,
                                               "maximum": LOGIT_BIAS_LIMIT}}
        elif self.choices:
            schema = {"type": "string", "enum": list(self.choices)}
        elif self.kind == "string":
            schema = {"type": "string", "minLength": 1, "maxLength": self.max_items or MAX_STRING_CHARS}
        else:
            schema = {"type": self.kind}
            if self.low is not None:
                schema["exclusiveMinimum" if self.low_open else "minimum"] = plain_number(self.low)
            if self.high is not None:
                schema["maximum"] = plain_number(self.high)
        schema["description"] = self.doc
        return schema


def _listed(values: list[Any], most: int = 10) -> str:
    """Up to `most` values for an error message (each cut short), and how many more there were."""
    shown = ", ".join(quote(v, 40) for v in values[:most])
    return shown + (f" and {len(values) - most} more" if len(values) > most else "")


def _token_key(key: Any) -> int | None:
    """A logit_bias key as a token id: JSON object keys arrive as decimal strings (ASCII digits only)."""
    if _is_int(key):
        return key
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 20:
        return int(key)
    return None


def param(default: Any = dataclasses.MISSING, doc: str = "", **spec: Any) -> Any:
    """A dataclass field declaring a parameter with its `Spec` (list and dict defaults are copied per instance)."""
    meta = {"spec": Spec(doc, **spec)}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


_KINDS = {"int": "integer", "float": "number", "bool": "boolean", "int | None": "integer", "str | None": "string",
          "str": "string", "bool | None": "boolean", "float | None": "number"}


def specs_of(cls: type) -> dict[str, Spec]:
    """The `Spec` of every field of the dataclass `cls`, in declaration order, with `name` and `kind` filled."""
    specs = {}
    for f in dataclasses.fields(cls):
        spec: Spec = f.metadata["spec"]
        object.__setattr__(spec, "name", f.name)
        if not spec.shape:
            object.__setattr__(spec, "kind", _KINDS[str(f.type)])
        specs[f.name] = spec
    return specs
