"""The engine's sub-packages import each other one way (issue 55): no import cycle between two of them, and
`scheduling/`, the batcher on top, imported by none below it.

Read from the source (every `import` and `from ... import`, inside functions too), not from a running import.
Two cycles and one upward import remain until the step's data moves to a bottom `core` (issue 55): they are
listed here, and a listed one that is gone fails the test too, so the list only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parent.parent / "actors" / "engine"
PREFIX = "ringserve.actors.engine."
TOP = "scheduling"
# allowed only while issue 55's core is not there
KNOWN_CYCLES = {frozenset({"runner", "scheduling"}), frozenset({"speculative", "scheduling"})}
KNOWN_UPWARD = {"runner", "speculative", "parallel"}  # sub-packages that still import scheduling/


def subpackage_edges() -> dict[tuple[str, str], list[str]]:
    """(importer, imported) sub-package pairs, each with the files that make it."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in ENGINE.rglob("*.py"):
        parts = path.relative_to(ENGINE).parts
        if len(parts) < 2:
            continue  # config.py, interface.py: the engine's own top level
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                if name.startswith(PREFIX):
                    imported = name[len(PREFIX):].split(".")[0]
                    if (ENGINE / imported).is_dir() and imported != parts[0]:
                        edges.setdefault((parts[0], imported), []).append(str(path.relative_to(ENGINE)))
    return edges


def test_no_import_cycle_between_the_engines_subpackages() -> None:
    edges = subpackage_edges()
    cycles = {frozenset(pair) for pair in edges if pair[::-1] in edges}
    new = {cycle: [(pair, edges[pair]) for pair in edges if frozenset(pair) == cycle]
           for cycle in cycles - KNOWN_CYCLES}
    assert not new, f"sub-packages that import each other: {new}"
    assert KNOWN_CYCLES <= cycles, f"gone, drop them from KNOWN_CYCLES: {KNOWN_CYCLES - cycles}"


def test_nothing_below_scheduling_imports_it() -> None:
    upward = {importer for importer, imported in subpackage_edges() if imported == TOP}
    assert upward <= KNOWN_UPWARD, {pair: files for pair, files in subpackage_edges().items()
                                    if pair[1] == TOP and pair[0] not in KNOWN_UPWARD}
    assert upward == KNOWN_UPWARD, f"gone, drop them from KNOWN_UPWARD: {KNOWN_UPWARD - upward}"
