"""No two modules of ringserve import each other, directly or through others (issue 55).

Read from the source, not from a running import: every `import` and `from ... import` of every module (inside
functions and under `if TYPE_CHECKING:` too), relative imports resolved, and `from package import name` read as
an import of the submodule `package.name` when there is one, else of the package. So an import cycle cannot hide
behind a function-level import or a type-only one.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOP_FOLDERS = ("actors", "bus", "kernels", "observability")  # installed as ringserve.<folder> (setup.py)


def module_files() -> dict[str, Path]:
    """Every module of the package by its import name: ringserve/*.py and the top-level folders' files."""
    paths = [*(ROOT / "ringserve").glob("*.py"), *(p for top in TOP_FOLDERS for p in (ROOT / top).rglob("*.py"))]
    modules = {}
    for path in paths:
        parts = path.relative_to(ROOT).with_suffix("").parts
        parts = parts[1:] if parts[0] == "ringserve" else parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(("ringserve", *parts))] = path
    return modules


def imported_modules(module: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """The package's modules `module` imports, each with the line of its first import."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for name in names:
            if name in modules and name != module:
                found.setdefault(name, node.lineno)
    return found


def import_cycles() -> list[list[str]]:
    """Each set of modules that import each other (a strongly connected component of the import graph), as
    lines `importer -> imported (file:line)`."""
    modules = module_files()
    edges = {module: imported_modules(module, path, modules) for module, path in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's algorithm
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in edges[module]:
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return [[f"{a} -> {b} ({modules[a].relative_to(ROOT)}:{line})" for a in component
             for b, line in sorted(edges[a].items()) if b in component] for component in components]


def test_the_source_finds_the_package_modules() -> None:
    modules = module_files()
    assert {"ringserve", "ringserve.client", "ringserve.actors.engine.config", "ringserve.kernels.grammar",
            "ringserve.bus.messages"} <= modules.keys()
    assert "ringserve.kernels.grammar.spec" in imported_modules(
        "ringserve.kernels.grammar", modules["ringserve.kernels.grammar"], modules)


def test_no_import_cycle() -> None:
    cycles = import_cycles()
    assert not cycles, "modules that import each other:\n" + "\n\n".join("\n".join(cycle) for cycle in cycles)


def test_what_the_actors_share_imports_no_actor() -> None:
    """`actors/common/` is what the actors share (the model catalog, its sources, flags, the runtime): it imports
    none of them, so the launcher and the tokenizer can read a model without the engine."""
    modules = module_files()
    upward = {f"{module} -> {imported} ({modules[module].relative_to(ROOT)}:{line})"
              for module, path in modules.items() if module.startswith("ringserve.actors.common")
              for imported, line in imported_modules(module, path, modules).items()
              if imported.startswith("ringserve.actors.") and not imported.startswith("ringserve.actors.common")}
    assert not upward, "actors/common imports an actor:\n" + "\n".join(sorted(upward))
