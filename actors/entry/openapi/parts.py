"""The schema pieces the APIs' OpenAPI bodies share: names, ids, token ids, images, the chat template's switches
and a vision-language model's image processor options."""

from __future__ import annotations

from ringserve.actors.entry.template_switches import CHAT_TEMPLATE_KWARGS
from ringserve.bus.params import PROCESSOR_SPECS

JSON = "application/json"
RID = {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}
BOOL = {"type": "boolean"}
TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
FUNCTION_NAME = {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"}
IMAGE_SOURCE = {"type": "string", "description": "base64 or a data URL (file and http(s) URLs as image_url takes "
                                                  "them)"}
# the chat template's switches (actors/entry/template_switches.py), on every chat-shaped body
TEMPLATE_KWARGS = {CHAT_TEMPLATE_KWARGS.name: CHAT_TEMPLATE_KWARGS.json_schema()}
IMAGE_PROCESSOR_OPTIONS = {"type": "object", "additionalProperties": False,
                           "description": "a vision-language model's image processor options (vLLM's field)",
                           "properties": {spec.name: spec.json_schema() for spec in PROCESSOR_SPECS.values()}}

