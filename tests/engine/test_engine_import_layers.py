"""The engine's sub-packages import each other one way (issue 55): `core/` (the step's data) imports none of
them, no two of them import each other, and `scheduling/`, the batcher on top, is imported by none below it.

Read from the source (every `import` and `from ... import`, inside functions too), not from a running import.
"""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "actors" / "engine"
PREFIX = "ringserve.actors.engine."
BOTTOM, TOP = "core", "scheduling"


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


def test_core_imports_no_other_engine_subpackage() -> None:
    assert {pair: files for pair, files in subpackage_edges().items() if pair[0] == BOTTOM} == {}


def test_no_import_cycle_between_the_engines_subpackages() -> None:
    edges = subpackage_edges()
    assert {pair: files for pair, files in edges.items() if pair[::-1] in edges} == {}


def test_nothing_below_scheduling_imports_it() -> None:
    assert {pair: files for pair, files in subpackage_edges().items() if pair[1] == TOP} == {}
