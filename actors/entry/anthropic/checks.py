"""Anthropic's 400 about a field, named by its dotted path as Anthropic names fields (`messages.0.content`), and
the shape checks every part of a Messages body shares: an object with only the fields it may have, a string."""

from __future__ import annotations

from typing import Any

from ringserve.bus.errors import ApiError, clip

CACHE_HINT = "cache_control"  # on the body, blocks and tools: no effect, the prefix cache is automatic


def invalid(where: str, what: str) -> ApiError:
    """A 400 about the field at `where`, a dotted path as Anthropic names fields (`messages.0.content`)."""
    return ApiError(f"{where}{what}", param=where.split(".")[0])


def extra_field(where: str) -> ApiError:
    """Anthropic's 400 for a field it does not know."""
    return invalid(where, ": Extra inputs are not permitted")


def checked_object(value: Any, where: str, allowed: set[str]) -> dict[str, Any]:
    """`value` at `where` as an object holding only `allowed` fields (and a `cache_control` object, if any)."""
    if not isinstance(value, dict):
        raise invalid(where, " must be an object")
    unknown = next((k for k in value if k not in allowed), None)
    if unknown is not None:
        raise extra_field(f"{where}.{clip(str(unknown))}")
    cache = value.get(CACHE_HINT)
    if cache is not None and not isinstance(cache, dict):
        raise invalid(f"{where}.{CACHE_HINT}", " must be an object")
    return value


def checked_string(value: Any, where: str) -> str:
    """`value` at `where`, which must be a string."""
    if not isinstance(value, str):
        raise invalid(where, " must be a string")
    return value
