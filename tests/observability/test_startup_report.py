"""What a start reports about itself, read from the session ring's log (no ring of its own): each actor's ready
line says what it read from ringserve's cache or made there for the next start (actors/common/startup_cache.py),
and the entry, started held while the scheduler loads, is released only once the scheduler is ready
(actors/launcher/supervisor.py)."""

from __future__ import annotations

import re

from tests.server_helpers import ServerHandle

CACHE_ENTRIES = re.compile(r"cache_(?:read|made)='?([^'\n]*)'?")


def _ready_line(log: str, actor: str) -> str:
    found = re.search(rf"^.*\[{actor}\] ready role=.*$", log, re.MULTILINE)
    assert found, f"no ready line of {actor}:\n{log[-3000:]}"
    return found.group(0)


def _entries(line: str) -> set[str]:
    return {entry.strip() for found in CACHE_ENTRIES.findall(line) for entry in found.split(",")}


def test_each_ready_line_names_what_came_from_the_cache_or_was_made(smollm_server: ServerHandle) -> None:
    log = smollm_server.log()
    # SmolLM2's GGUF: the scheduler reads (or, on a first start, converts) its weights, and its kernel plan
    # where our kernels measure one (the plan's own line says it was)
    scheduler = _entries(_ready_line(log, "scheduler0"))
    assert "gguf weights" in scheduler
    if "float32 kernels per linear shape and step size" in log:
        assert "float32 kernel plan" in scheduler
    assert "tokenizer export" in _entries(_ready_line(log, "detokenizer"))


def test_the_entry_is_started_held_and_released_once_the_scheduler_is_ready(smollm_server: ServerHandle) -> None:
    lines = smollm_server.log().splitlines()

    def first(pattern: str) -> int:
        index = next((i for i, line in enumerate(lines) if re.search(pattern, line)), None)
        assert index is not None, f"{pattern!r} not in the log:\n" + "\n".join(lines[-60:])
        return index

    held = first(r"\[launcher\] started actor actor=entry0 .*held=")
    scheduler = first(r"\[launcher\] actor ready actor=scheduler0")
    released = first(r"\[launcher\] released actor actor=entry0")
    entry = first(r"\[launcher\] actor ready actor=entry0")
    assert scheduler < released < entry
    assert held < released
