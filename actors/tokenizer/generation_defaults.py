"""`--generation-config auto`: the sampling defaults a model's `generation_config.json` recommends.

As vLLM reads it: of a model directory's `generation_config.json` (a GGUF has none), `temperature`, `top_p`,
`top_k`, `min_p`, `repetition_penalty` and `max_new_tokens` fill what a request leaves out; a value equal to
transformers' own default is no recommendation (vLLM reads the file's difference from those defaults).
Each value is checked as a request's would be, at start-up.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ringserve.actors.common.model_source import ModelSource
from ringserve.bus.errors import ApiError
from ringserve.bus.params import SPECS

FILE = "generation_config.json"
KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")  # our names and HF's
_TRANSFORMERS_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


def generation_defaults(source: ModelSource, mode: str = "auto") -> dict[str, Any]:
    """The sampling defaults in force for `source` under `--generation-config mode` (native names), checked;
    ValueError naming the file and the value a request could not take."""
    if mode == "none" or source.gguf_file is not None:
        return {}
    path = Path(source.directory) / FILE
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not readable JSON ({exc}); serve with --generation-config none to ignore it") \
            from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object; serve with --generation-config none to ignore it")
    defaults = {}
    for name in KEYS:
        value = config.get(name)
        if value is None or (name in _TRANSFORMERS_DEFAULTS and value == _TRANSFORMERS_DEFAULTS[name]):
            continue
        try:
            defaults[name] = SPECS[name].check(value, openai=False)
        except ApiError as exc:
            raise ValueError(f"{path}: {exc.message}; serve with --generation-config none to ignore it") from None
    return defaults
