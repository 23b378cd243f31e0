"""The check every JSON route makes of a body's top-level fields: each one the route implements, may ignore (no
effect), or refuses saying why (`Refused`); any other is the route's "unknown field" 400 (OpenAI's words by default,
`unrecognized`). Each route keeps its own tables; this module only reads them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Collection

from ringserve.bus.errors import ApiError, clip


@dataclass(frozen=True)
class Refused:
    """A field we do not implement: `reason` is said in the 400; `neutral` values change nothing and pass."""

    reason: str
    neutral: tuple[Any, ...] = ()


def unrecognized(name: str) -> ApiError:
    """OpenAI's 400 for a top-level field it does not know (/generate answers it too)."""
    return ApiError(f"Unrecognized request argument supplied: {clip(name)}", param=name)


def check_top_level(body: dict[str, Any], implemented: Collection[str], no_effect: Collection[str],
                    refused: dict[str, Refused], unknown: Callable[[str], ApiError]) -> None:
    """ApiError 400 naming the first field of `body` a route neither implements nor can ignore: its refusal's
    reason (unless its value is null or neutral), or `unknown(name)` for a field in none of the tables."""
    for name, value in body.items():
        if name in implemented or name in no_effect:
            continue
        refusal = refused.get(name)
        if refusal is None:
            raise unknown(name)
        if value is not None and not any(value == neutral for neutral in refusal.neutral):
            raise ApiError(f"{name}: {refusal.reason}", param=name)
