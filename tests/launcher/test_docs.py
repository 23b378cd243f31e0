"""The docs stay true to the code: generated tables current, README short, relative links resolving."""

from __future__ import annotations

import importlib.util
import re
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_docs"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, re.M):
        slug = _slug(heading)
        count = seen.get(slug, 0)
        anchors.add(slug if count == 0 else f"{slug}-{count}")
        seen[slug] = count + 1
    return anchors


def test_generated_tables_are_current() -> None:
    gen = _gen_docs()
    result = gen.generate(check=True)
    for line in result.skipped:
        warnings.warn(f"gen_docs skipped {line}")
    assert not result.stale, (
        "stale generated docs tables:\n  " + "\n  ".join(result.stale)
        + f"\nrun `{gen.REGEN_COMMAND}` to regenerate them")


def test_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines < 200, f"README.md has {lines} lines; keep it under 200 and move detail into docs/"


def test_relative_links_resolve() -> None:
    broken = []
    for path in [ROOT / "README.md", *DOCS]:
        text = FENCE.sub("", path.read_text(encoding="utf-8"))
        for target in LINK.findall(text):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(ROOT)}: ({target})"
            if not dest.exists():
                broken.append(f"{where} -> {file_part} does not exist")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{where} -> no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, "broken links:\n  " + "\n  ".join(broken)


def test_every_docs_file_is_linked_from_the_readme() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    missing = [p.name for p in DOCS if f"(docs/{p.name}" not in readme]
    assert not missing, f"README.md's 'Where to read on' does not link {missing}"


# A repo path as the docs cite one: a top-level folder of this repository, then a file or folder name.
TOP = ("actors", "bus", "kernels", "observability", "bench", "tests", "scripts", "deploy", "docs", "ringserve",
       ".ci", "examples")
REPO_PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*[\w/])" % "|".join(re.escape(t) for t in TOP))
CODE_SPAN = re.compile(r"`([^`\n]+)`")
# Files made at run time, not in the repository: cited where the docs say where they appear.
GENERATED = {
    "kernels/cpu/_ringserve_cpu.so",  # the CPU extension, built on first import
    "bench/out",  # where the benchmarks write their results
}


def _cited_paths(text: str) -> set[str]:
    """Repo paths in code spans, fenced blocks and link targets (a glob or `{placeholder}` ends the path before it)."""
    pieces = CODE_SPAN.findall(FENCE.sub("", text)) + LINK.findall(text)
    pieces += [m.group(0) for m in FENCE.finditer(text)]
    found = set()
    for piece in pieces:
        for path in REPO_PATH.findall(piece):
            found.add(path.rstrip("/."))
    return found


def test_cited_files_exist() -> None:
    stale = []
    for path in [ROOT / "README.md", *DOCS]:
        for cited in sorted(_cited_paths(path.read_text(encoding="utf-8"))):
            if cited in GENERATED or any(cited.startswith(g + "/") for g in GENERATED):
                continue
            if not (ROOT / cited).exists():
                stale.append(f"{path.relative_to(ROOT)}: {cited}")
    assert not stale, f"{len(stale)} cited paths do not exist:\n  " + "\n  ".join(stale)


def _engine_interface_methods() -> set[str]:
    """The public methods of `EngineInterface`, read with `ast` (wherever the class lives under actors/)."""
    import ast

    for source in sorted((ROOT / "actors").rglob("*.py")):
        text = source.read_text(encoding="utf-8")
        if "class EngineInterface" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.name == "EngineInterface":
                return {f.name for f in node.body
                        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and not f.name.startswith("_")}
    raise AssertionError("no class EngineInterface under actors/")


def test_engine_interface_table_is_complete() -> None:
    text = (ROOT / "docs" / "engine.md").read_text(encoding="utf-8")
    rows = re.search(r"^\| method \| what \|\n\|[-|]+\|\n((?:\|.*\n)+)", text, re.M)
    assert rows, "docs/engine.md has no `| method | what |` table"
    named = set()
    for row in rows.group(1).splitlines():
        named |= set(re.findall(r"`(\w+)\(", row.split("|")[1]))
    methods = _engine_interface_methods()
    assert named == methods, (f"docs/engine.md's interface table: missing {sorted(methods - named)}, "
                              f"not on EngineInterface {sorted(named - methods)}")


def _serve_command_lines(text: str) -> list[str]:
    """Each `ringserve serve ...` command line: in code spans, and in fenced blocks with `\\` continuations."""
    lines = [span for span in CODE_SPAN.findall(FENCE.sub("", text)) if "ringserve serve" in span]
    for block in FENCE.finditer(text):
        joined = re.sub(r"\\\n", " ", block.group(0))
        lines += [line for line in joined.splitlines() if "ringserve serve" in line]
    return lines


def test_serve_flags_in_docs_exist() -> None:
    parser = _gen_docs()._serve_parser()
    known = {opt for action in parser._actions for opt in action.option_strings}
    unknown = []
    for path in [ROOT / "README.md", *DOCS]:
        for line in _serve_command_lines(path.read_text(encoding="utf-8")):
            line = line.split("ringserve serve", 1)[1].split("`")[0]  # up to the span's end
            for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", line.split("|")[0].split("&&")[0]):
                if flag not in known:
                    unknown.append(f"{path.relative_to(ROOT)}: {flag} in `ringserve serve{line}`")
    assert not unknown, "flags `ringserve serve` does not have:\n  " + "\n  ".join(unknown)
