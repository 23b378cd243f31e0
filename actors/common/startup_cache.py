"""What this process found in ringserve's cache (`$RINGSERVE_CACHE`, default `~/.cache/ringserve`) at start-up,
and what it had to make there for the next start: converted GGUF weights, packed GGUF blocks, a kernel plan,
a tokenizer export. Each step that reads or makes a cache entry `note`s it; the actor's "ready" log line
(actors/common/runtime.py) reports them as `cache_read` and `cache_made`, so a slow first start says what it
made and a warm one shows that it read all of it. The decode graphs, compiled after ready, say the same on
their own lines (`source=stored` or `traced`)."""

from __future__ import annotations

_noted: dict[str, bool] = {}  # entry -> found in the cache (False: made now, and cached for the next start)


def note(entry: str, found: bool) -> None:
    """Record that start-up step `entry` read its result from the cache (`found`) or made it and cached it."""
    _noted[entry] = found


def report() -> dict[str, str]:
    """`cache_read` and `cache_made`: the entries noted so far, comma-separated (only the non-empty ones)."""
    read = [entry for entry, found in _noted.items() if found]
    made = [entry for entry, found in _noted.items() if not found]
    return {name: ", ".join(entries) for name, entries in (("cache_read", read), ("cache_made", made)) if entries}
