"""W3C Trace Context `traceparent` values (https://www.w3.org/TR/trace-context/).

Every bus message carries one in its NATS headers; the tracing layer hangs OpenTelemetry spans on it.
"""

from __future__ import annotations

import re
import secrets

TRACEPARENT_HEADER = "traceparent"
_PATTERN = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


def new_traceparent() -> str:
    """A fresh sampled traceparent with random trace and span ids."""
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"


def child_traceparent(parent: str | None) -> str:
    """A traceparent in the same trace as `parent` with a new span id (a new trace if `parent` is invalid)."""
    match = _PATTERN.match(parent or "")
    if match is None or match.group(1) == "0" * 32:
        return new_traceparent()
    return f"00-{match.group(1)}-{secrets.token_hex(8)}-{match.group(3)}"


def is_valid_traceparent(value: str | None) -> bool:
    """True when `value` is a well-formed version-00 traceparent with a non-zero trace id."""
    match = _PATTERN.match(value or "")
    return match is not None and match.group(1) != "0" * 32 and match.group(2) != "0" * 16
