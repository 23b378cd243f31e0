"""The grammar compile worker: a child process that parses and compiles client grammars with xgrammar under a
hard memory cap, so that no grammar can take the process that serves with it (`python -m
kernels.grammar.compile_worker`, started and spoken to by `ringserve.kernels.grammar.compile_pool`).

Protocol: one JSON object per line. The parent's first line is the setup (`tokenizer_info`: xgrammar's
`TokenizerInfo.serialize_json()`, `memory_bytes`, `max_threads`, `any_whitespace`); once xgrammar is loaded the
worker caps its address space (`RLIMIT_AS`) at what it uses then plus `memory_bytes` and answers `{"ready": ...}`.
Then each request `{"op": "check" | "compile", "kind", "source"}` (a `GrammarSpec`'s kind and source) gets one
reply: `{"grammar": text}` (compile: xgrammar's `CompiledGrammar.serialize_json()`; check: none) or `{"error":
text, "reason": "invalid" | "memory" | "unbounded"}`, with `"stderr"`: what native code printed meanwhile
(bounded; the parent decides what to log).

The compiled grammar travels back as xgrammar's own JSON serialization, checked by `deserialize_json` against
the parent's tokenizer info; nothing is pickled. After compiling, the worker also computes the text the grammar
forces from its start (what the engine's jump-forward computes on the step path): a grammar that forces an
infinite text (a required recursion the schema check did not see, an EBNF rule that only calls itself) fails
here, under the cap, and not in the engine. Before that, `ebnf_productive` looks for rules no finite text
matches anywhere in the grammar (a dead branch whose forced text would never end once the model entered it);
`check` runs that too, so the tokenizer refuses such a grammar before admission. A worker that ran out of memory replies and exits (xgrammar's state
after a `bad_alloc` is not trusted); one that crashes or overruns its time is killed by the parent.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import threading
import time
from typing import Any, BinaryIO, TextIO

from ringserve.kernels.grammar.ebnf_productive import unproductive_rule

MAX_STDERR_CHARS = 2000


def _vm_size() -> int:
    """This process's address space in bytes (VmSize)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def _exit_with_parent() -> None:
    """End this process when its parent is gone (stdin's EOF is not read while a compile runs)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def _is_memory_error(exc: BaseException) -> bool:
    # under the cap a thread's stack cannot be mapped either: EAGAIN from the thread pool
    return isinstance(exc, MemoryError) or any(s in str(exc) for s in ("bad_alloc", "Resource temporarily unavailable"))


class Worker:
    """xgrammar behind the protocol: one compiler for the parent's tokenizer."""

    def __init__(self, setup: dict[str, Any]) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.any_whitespace = bool(setup.get("any_whitespace", False))
        info = xgr.TokenizerInfo.deserialize_json(setup["tokenizer_info"])
        self.compiler = xgr.GrammarCompiler(info, max_threads=int(setup.get("max_threads", 1)), cache_enabled=False)

    def check(self, kind: str, source: str) -> Any:
        """Parse `source` without compiling token masks (xgrammar raises on an invalid one): its Grammar."""
        if kind == "json_schema":
            return self.xgr.Grammar.from_json_schema(source, any_whitespace=self.any_whitespace, strict_mode=True)
        if kind == "regex":
            return self.xgr.Grammar.from_regex(source)
        if kind == "ebnf":
            return self.xgr.Grammar.from_ebnf(source, root_rule_name="root")
        if kind == "structural_tag":
            return self.xgr.Grammar.from_structural_tag(source)
        return None

    def compile(self, kind: str, source: str) -> Any:
        """The compiled grammar of `source` (json_object: any JSON object, as vLLM makes it)."""
        if kind == "json_object":
            return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=self.any_whitespace,
                                                     strict_mode=False)
        if kind == "json_schema":
            return self.compiler.compile_json_schema(source, any_whitespace=self.any_whitespace, strict_mode=True)
        if kind == "regex":
            return self.compiler.compile_regex(source)
        if kind == "structural_tag":
            return self.compiler.compile_structural_tag(source)
        return self.compiler.compile_grammar(source, root_rule_name="root")

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        """One request's reply (without stderr); raises MemoryError when the cap was hit."""
        kind, source = str(request["kind"]), str(request["source"])
        try:
            if request["op"] == "check":
                grammar = self.check(kind, source)
                rule = None if grammar is None else unproductive_rule(str(grammar))
                return {} if rule is None else _unbounded(rule)
            compiled = self.compile(kind, source)
        except (RuntimeError, ValueError) as exc:
            if _is_memory_error(exc):
                raise MemoryError from None
            return {"error": str(exc), "reason": "invalid"}
        rule = unproductive_rule(str(compiled.grammar))
        if rule is not None:
            return _unbounded(rule)
        try:
            self.xgr.GrammarMatcher(compiled).find_jump_forward_string()
        except (RuntimeError, MemoryError) as exc:
            if _is_memory_error(exc):
                return {"error": "the grammar forces an output of unbounded length", "reason": "unbounded",
                        "fatal": True}
            raise
        return {"grammar": compiled.serialize_json()}


def _unbounded(rule: str) -> dict[str, Any]:
    return {"error": "the grammar forces an output of unbounded length", "reason": "unbounded", "rule": rule}


def _reply(out: TextIO, capture: BinaryIO, message: dict[str, Any]) -> None:
    capture.seek(0)
    printed = capture.read(MAX_STDERR_CHARS * 4).decode("utf-8", "replace")[:MAX_STDERR_CHARS]
    capture.seek(0)
    capture.truncate()
    if printed:
        message["stderr"] = printed
    out.write(json.dumps(message) + "\n")
    out.flush()


def main() -> int:
    """Serve the parent's requests on stdin/stdout until stdin closes (or the memory cap is hit)."""
    out = os.fdopen(os.dup(1), "w")
    # whatever native code prints (xgrammar's warnings quote client text) lands here, never in the server's log
    capture = tempfile.TemporaryFile()
    os.dup2(capture.fileno(), 1)
    os.dup2(capture.fileno(), 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    _exit_with_parent()
    import xgrammar  # noqa: F401  # the cold start, before the setup: a prestarted worker does it while it waits

    setup = json.loads(sys.stdin.readline())
    worker = Worker(setup)
    limit = _vm_size() + int(setup["memory_bytes"])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    _reply(out, capture, {"ready": True, "limit_bytes": limit})
    for line in sys.stdin:
        try:
            message = worker.handle(json.loads(line))
        except MemoryError:
            message = {"error": "compiling it needs more memory than the limit", "reason": "memory", "fatal": True}
        _reply(out, capture, message)
        if message.get("fatal"):
            return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
