"""Regenerate the tables in docs/ that are read from the code.

    .venv/bin/python scripts/gen_docs.py           # rewrite every generated table
    .venv/bin/python scripts/gen_docs.py --check   # exit 1 and name the tables that are stale

A generated table sits in a markdown file between two marker lines:

    <!-- generated:NAME -->
    ...
    <!-- /generated:NAME -->

Everything between the markers belongs to this script; edit the code it reads, not the table.

| table | file | read from |
|---|---|---|
| `serve-flags` | docs/engine.md | the `ringserve serve` parser (`ringserve.actors.launcher.cli.build_parser`) |
| `sampling-params` | docs/api.md | `ringserve.bus.params.param_rows()` |
| `processor-options` | docs/api.md | `ringserve.bus.params.PROCESSOR_SPECS` |
| `messages` | docs/protocol.md | the dataclasses of `bus/messages.py` |
| `metrics` | docs/metrics.md | the entry's metric registry and the scheduler gauges (`actors/entry/ops/metric*.py`) |
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

REGEN_COMMAND = ".venv/bin/python scripts/gen_docs.py"


class Skip(Exception):
    """A table that cannot be generated here (the code it reads is missing); it is left as it is."""


# --- helpers -----------------------------------------------------------------------------------------------


def cell(value: Any) -> str:
    """`value` as one markdown table cell: one line, `|` escaped."""
    text = " ".join(str(value).split())
    return text.replace("|", "\\|")


def code(value: Any) -> str:
    """`value` as inline code in a table cell (empty stays empty)."""
    text = cell(value)
    if not text:
        return ""
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# --- serve-flags ---------------------------------------------------------------------------------------------


def _serve_parser() -> argparse.ArgumentParser:
    from ringserve.actors.launcher.cli import build_parser

    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices["serve"]
    raise RuntimeError("ringserve has no `serve` subcommand")


def _installable_backends() -> list[str]:
    """Every attention backend ringserve knows (installed or not), so the table does not depend on this machine."""
    from ringserve.kernels.attention import known_backend_names

    return list(known_backend_names())


def _flag_default(action: argparse.Action) -> str:
    if isinstance(action, argparse.BooleanOptionalAction):
        return "on" if action.default else "off"
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "off" if isinstance(action, argparse._StoreTrueAction) else "on"
    default = action.default
    if default is None or default == "" or default == [] or default is argparse.SUPPRESS:
        return "(none)"
    return code(default)


def _flag_help(action: argparse.Action) -> str:
    text = action.help or ""
    if "%(" in text:
        text = text % {"default": action.default, "prog": "ringserve serve", "dest": action.dest,
                       "choices": action.choices}
    choices = list(action.choices) if action.choices else None
    if action.dest == "attention_backend":
        choices = ["auto", *_installable_backends()]
        if choices:
            text += " (" + ", ".join(choices) + "; a backend other than torch only when its package is installed)"
            choices = None
    if choices and not all(str(c) in text for c in choices):
        text += " (choices: " + ", ".join(str(c) for c in choices) + ")"
    if isinstance(action, argparse._AppendAction):
        text += " (repeatable)" if "repeatable" not in text else ""
    return cell(text)


def serve_flags() -> str:
    """Every flag of `ringserve serve`, grouped as `--help` groups them."""
    serve = _serve_parser()
    parts = []
    for group in serve._action_groups:
        rows = []
        for action in group._group_actions:
            if isinstance(action, argparse._HelpAction) or action.help is argparse.SUPPRESS:
                continue
            flags = ", ".join(f"`{o}`" for o in action.option_strings) or f"`{action.dest}`"
            if action.metavar and action.nargs != 0:
                flags += f" {cell(action.metavar)}"
            rows.append([flags, _flag_default(action), _flag_help(action)])
        if rows:
            title = "general" if group.title in ("options", "optional arguments") else group.title
            parts.append(f"**{title}**\n\n" + table(["flag", "default", "what"], rows))
    return "\n\n".join(parts)


# --- sampling-params ------------------------------------------------------------------------------------------


def _default_cell(text: str) -> str:
    """A default as code when it is a value (`1`, `false`), as words when it is prose (`the rest of ...`)."""
    return cell(text) if " " in text.strip() else code(text)


def sampling_params() -> str:
    """The request parameters, declared once in `bus/params.py`."""
    try:
        params = importlib.import_module("ringserve.bus.params")
    except ModuleNotFoundError as exc:
        if exc.name in ("ringserve.bus.params",):
            raise Skip("bus/params.py does not exist yet") from exc
        raise
    param_rows = getattr(params, "param_rows", None)
    if param_rows is None:
        raise Skip("bus/params.py has no param_rows() yet")
    rows = []
    for row in param_rows():
        openai = ", ".join(code(name.strip()) for name in str(row.get("openai", "")).split(",") if name.strip())
        rows.append([code(row["name"]), openai or "—", cell(row.get("type", "")), cell(row.get("range", "")),
                     _default_cell(str(row.get("default", ""))), cell(row.get("doc", ""))])
    return table(["`sampling_params` name", "OpenAI name", "type", "range", "default", "what"], rows)


def processor_options() -> str:
    """A vision-language model's image processor options (`mm_processor_kwargs`), declared once in
    `bus/params.py` (`ImageProcessing`)."""
    params = importlib.import_module("ringserve.bus.params")
    specs = getattr(params, "PROCESSOR_SPECS", None)
    if specs is None:
        raise Skip("bus/params.py has no PROCESSOR_SPECS yet")
    rows = [[code(s.name), cell(s.kind), cell(s.range_text()), _default_cell(s.default_doc or "none"), cell(s.doc)]
            for s in specs.values()]
    return table(["`mm_processor_kwargs` key", "type", "range", "default", "what"], rows)


# --- messages -----------------------------------------------------------------------------------------------


def _first_paragraph(cls: type) -> str:
    doc = cls.__dict__.get("__doc__") or ""
    if doc.startswith(cls.__name__ + "("):  # dataclass' generated signature, not a docstring
        return ""
    return cell(inspect.cleandoc(doc).split("\n\n")[0])


def _annotation(f: dataclasses.Field) -> str:
    kind = f.type
    if isinstance(kind, str):
        return kind
    return getattr(kind, "__name__", None) if isinstance(kind, type) else str(kind).replace("typing.", "")


def _field_default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return code(repr(f.default))
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        try:
            return code(repr(f.default_factory()))  # type: ignore[misc]
        except Exception:
            return code(f"{getattr(f.default_factory, '__name__', 'factory')}()")
    return "required"


def messages() -> str:
    """Every dataclass defined in `bus/messages.py` (then `bus/kv_messages.py`, `bus/tokenize_messages.py`), in
    file order: its doc's first paragraph and its fields."""
    seen: set[type] = set()
    modules = ("ringserve.bus.messages", "ringserve.bus.kv_messages", "ringserve.bus.tokenize_messages")
    return "\n\n".join(_module_messages(name, seen) for name in modules)


def _module_messages(module_name: str, seen: set[type]) -> str:
    module = importlib.import_module(module_name)
    dataclasses_here = [obj for obj in vars(module).values() if inspect.isclass(obj) and dataclasses.is_dataclass(obj)]
    own = [c for c in dataclasses_here if c.__module__ == module.__name__]
    source_order = {name: i for i, name in enumerate(re.findall(r"^class (\w+)", inspect.getsource(module), re.M))}
    own.sort(key=lambda c: source_order.get(c.__name__, len(source_order)))
    # wire types the messages are built from but that live in another bus module (bus/params.py, bus/errors.py)
    imported = [c for c in dataclasses_here if c.__module__ != module.__name__ and c.__module__.startswith("ringserve.bus.")]
    fresh = [cls for cls in own + imported if cls not in seen]  # each type once, where it first appears
    seen.update(fresh)
    return "\n\n".join(_message_section(cls) for cls in fresh)


def _message_section(cls: type) -> str:
    rows = [[code(f.name), code(_annotation(f)), _field_default(f)] for f in dataclasses.fields(cls)]
    doc = _first_paragraph(cls)
    if cls.__module__ != "ringserve.bus.messages":
        doc = (doc + " " if doc else "") + f"Defined in `{cls.__module__.removeprefix('ringserve.').replace('.', '/')}.py`."
    return f"### {cls.__name__}\n\n" + (f"{doc}\n\n" if doc else "") + table(["field", "type", "default"], rows)


# --- metrics ------------------------------------------------------------------------------------------------


def _scheduler_info_sample() -> Any:
    """A SchedulerInfo with every required field filled, for listing the gauges made from one."""
    from ringserve.bus.messages import SchedulerInfo

    values = {"str": "model", "int": 1, "float": 1.0, "bool": False}
    kwargs = {f.name: values.get(str(f.type), 1) for f in dataclasses.fields(SchedulerInfo)
              if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}  # type: ignore[misc]
    return SchedulerInfo(**kwargs)


def metrics() -> str:
    """The series of `GET /metrics`: the entry's request-level registry, then the scheduler's load gauges."""
    from ringserve.actors.entry.ops.metrics import RequestMetrics
    from ringserve.actors.entry.ops.metrics_route import scheduler_families

    families = list(RequestMetrics("model").registry.collect())
    families += scheduler_families(_scheduler_info_sample(), "model")
    rows = []
    for family in families:
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = sorted({label for sample in family.samples for label in sample.labels}
                        - {"model_name", "le", "quantile"})
        if labels:
            name += "{" + ",".join(labels) + "}"
        rows.append([code(name), family.type, cell(family.documentation)])
    return ("Every series has the label `model_name`: the served model, or the LoRA adapter a request named.\n\n"
            + table(["metric", "type", "what"], rows))


def metric_names() -> str:
    """The vLLM and SGLang names `GET /metrics?names=...` renders each series under."""
    from ringserve.actors.entry.ops.metric_names import MAPPINGS

    ours = sorted({name for table_ in MAPPINGS.values() for name in table_})
    rows = []
    for name in ours:
        cells = [code("ringserve:" + name)]
        for dialect in MAPPINGS:
            theirs, labels = MAPPINGS[dialect].get(name, (None, {}))
            renames = ", ".join(f"label `{a}` → `{b}`" for a, b in labels.items())
            cells.append("(ours)" if theirs is None else code(theirs) + (f" ({renames})" if renames else ""))
        rows.append(cells)
    return table(["ringserve", *(f"`?names={d}`" for d in MAPPINGS)], rows)


# --- the driver ---------------------------------------------------------------------------------------------


@dataclass
class Generated:
    name: str
    path: str  # relative to the repository root
    render: Callable[[], str]


TABLES = [
    Generated("serve-flags", "docs/engine.md", serve_flags),
    Generated("sampling-params", "docs/api.md", sampling_params),
    Generated("processor-options", "docs/api.md", processor_options),
    Generated("messages", "docs/protocol.md", messages),
    Generated("metrics", "docs/metrics.md", metrics),
    Generated("metric-names", "docs/metrics.md", metric_names),
]


def _region(name: str) -> re.Pattern[str]:
    return re.compile(rf"(^<!-- generated:{re.escape(name)} -->\n)(.*?)(^<!-- /generated:{re.escape(name)} -->$)",
                      re.M | re.S)


@dataclass
class Result:
    stale: list[str]  # "NAME (path): why"
    skipped: list[str]  # "NAME (path): why"
    written: list[str]  # paths rewritten


def generate(check: bool = False, root: Path = ROOT) -> Result:
    """Render every table; rewrite the files (or, with `check`, only compare). Stale tables name themselves."""
    result = Result([], [], [])
    texts: dict[str, str] = {}
    originals: dict[str, str] = {}
    for gen in TABLES:
        where = f"{gen.name} ({gen.path})"
        path = root / gen.path
        if gen.path not in texts:
            if not path.exists():
                result.stale.append(f"{where}: the file does not exist")
                continue
            texts[gen.path] = originals[gen.path] = path.read_text(encoding="utf-8")
        text = texts[gen.path]
        match = _region(gen.name).search(text)
        if match is None:
            result.stale.append(f"{where}: no <!-- generated:{gen.name} --> ... <!-- /generated:{gen.name} --> lines")
            continue
        try:
            body = gen.render().rstrip("\n") + "\n"
        except Skip as exc:
            result.skipped.append(f"{where}: {exc}; the table is left as it is")
            continue
        if match.group(2) != body:
            result.stale.append(f"{where}: out of date")
            texts[gen.path] = text[:match.start(2)] + body + text[match.end(2):]
    if not check:
        for rel, text in texts.items():
            if text != originals[rel]:
                (root / rel).write_text(text, encoding="utf-8")
                result.written.append(rel)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Regenerate the tables in docs/ that are read from the code.")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if any table is stale")
    args = parser.parse_args(argv)
    result = generate(check=args.check)
    for line in result.skipped:
        print(f"skipped {line}", file=sys.stderr)
    if args.check:
        for line in result.stale:
            print(f"stale: {line}")
        if result.stale:
            print(f"run `{REGEN_COMMAND}` to regenerate")
            return 1
        print("generated tables are up to date")
        return 0
    missing = [line for line in result.stale if not line.endswith("out of date")]
    for line in missing:
        print(f"cannot generate {line}", file=sys.stderr)
    for rel in result.written:
        print(f"rewrote {rel}")
    if not result.written and not missing:
        print("generated tables are up to date")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
