"""The OpenAPI schemas of the operator routes' bodies (weights, abort, pause) and of their replies."""

from __future__ import annotations

from typing import Any

from ringserve.actors.entry.field_checks import Refused
from ringserve.actors.entry.openapi.parts import BOOL, RID
from ringserve.actors.entry.ops.control import PAUSE_REFUSED, UPDATE_WEIGHTS_REFUSED


def _neutral_only(refused: dict[str, Refused]) -> dict[str, Any]:
    """Schemas of SGLang's fields taken only with the value that changes nothing here."""
    return {name: {"enum": list(r.neutral), "description": f"SGLang's, only with this value ({r.reason})"}
            for name, r in refused.items()}


UPDATE_WEIGHTS_REQUEST = {"type": "object", "required": ["model_path"], "properties": {
    "model_path": {"type": "string", "minLength": 1, "description": "a .gguf file or safetensors directory of "
                                                                     "the same architecture"},
    "mode": {"enum": ["wait", "pause", "abort"], "description": "what happens to the requests the scheduler "
                                                                 "holds (default wait)"},
    "abort_all_requests": {"type": "boolean", "description": "SGLang's name for mode abort"},
    "weight_version": {"type": "string", "description": "names the new weights (default: the next number)"},
    **_neutral_only(UPDATE_WEIGHTS_REFUSED)},
    "additionalProperties": False}
ABORT_REQUEST = {"type": "object", "properties": {"rid": RID, "abort_all": BOOL},
                 "description": "give rid, or abort_all: true", "additionalProperties": False}
PAUSE_REQUEST = {"type": "object", "properties": _neutral_only(PAUSE_REFUSED), "additionalProperties": False}
CONTROL_REPLY = {"type": "object", "required": ["success", "message"],
                 "properties": {"success": BOOL, "message": {"type": "string"}}}
