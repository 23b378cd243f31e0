"""Finding JSON-schema parts that only an infinite value could satisfy (required recursion with no way out).

`{"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
"$ref": "#/$defs/n"}` asks for `{"c": {"c": ...}}` without end. xgrammar compiles it, but the text it forces
(jump-forward) is infinite, and computing it grows memory until the process dies. Such a schema is refused up
front, before any backend sees it.

The check is a least fixed point over the schema's subschemas: a subschema is *finite* when some finite JSON
value can satisfy its structure (a scalar type, an enum or const, an object whose required properties are all
finite, an array whose required items are, any branch of `anyOf`/`oneOf`, every part of `allOf`, the target of a
local `$ref`). Everything the check does not model counts as finite, so it can only miss a schema, never refuse a
satisfiable one: a subschema stays infinite only through a cycle. Every subschema reachable from the root is
checked, optional ones too: a model that enters an optional infinite branch would hit the same unbounded
jump-forward.
"""

from __future__ import annotations

from typing import Any

SCALAR_TYPES = {"string", "number", "integer", "boolean", "null"}
MAX_NODES = 20000  # a 64 KB schema has far fewer; past this the check gives up (the compile worker's cap holds)
MAX_PASSES = 500


def _pointer_token(key: Any) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


def _resolve(root: Any, ref: str) -> Any:
    """The subschema a local `$ref` ("#" or "#/a/b") points at, or None (remote or missing: not modelled)."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for raw in ref[2:].split("/"):
        token = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return None
    return node


def _children(root: Any, node: dict[str, Any]) -> list[tuple[str, Any]]:
    """(pointer suffix, subschema) of every subschema `node` uses, a `$ref`'s target as ("$ref", target)."""
    out: list[tuple[str, Any]] = []
    ref = node.get("$ref")
    if isinstance(ref, str):
        target = _resolve(root, ref)
        if isinstance(target, dict):
            out.append(("$ref", target))
    for key in ("allOf", "anyOf", "oneOf", "prefixItems"):
        if isinstance(node.get(key), list):
            out += [(f"{key}/{i}", v) for i, v in enumerate(node[key]) if isinstance(v, dict)]
    if isinstance(node.get("properties"), dict):
        out += [(f"properties/{_pointer_token(k)}", v) for k, v in node["properties"].items() if isinstance(v, dict)]
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            out.append((key, node[key]))
    return out


def _types(node: dict[str, Any]) -> set[str] | None:
    """The types `node` allows, or None when it does not say (and does not look like an object)."""
    kind = node.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list) and all(isinstance(k, str) for k in kind):
        return set(kind)
    if "properties" in node or "required" in node:
        return {"object"}  # xgrammar makes a typeless schema with properties an object
    return None


def _own_finite(root: Any, node: dict[str, Any], finite: dict[int, bool]) -> bool:
    """Whether `node` is finite, given the current verdicts of the subschemas it uses."""

    def ok(child: Any) -> bool:
        return not isinstance(child, dict) or finite.get(id(child), True)

    if "enum" in node or "const" in node:
        return True
    ref = node.get("$ref")
    if isinstance(ref, str) and not ok(_resolve(root, ref)):
        return False
    if isinstance(node.get("allOf"), list) and not all(ok(v) for v in node["allOf"]):
        return False
    for key in ("anyOf", "oneOf"):
        branches = node.get(key)
        if isinstance(branches, list) and branches and not any(ok(v) for v in branches):
            return False
    types = _types(node)
    if types is None or types & SCALAR_TYPES or not types & {"object", "array"}:
        return True
    if "object" in types and _object_finite(node, ok):
        return True
    return "array" in types and _array_finite(node, ok)


def _object_finite(node: dict[str, Any], ok: Any) -> bool:
    required = node.get("required")
    properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    if not isinstance(required, list):
        return True
    return all(ok(properties.get(name)) for name in required if isinstance(name, str))


def _array_finite(node: dict[str, Any], ok: Any) -> bool:
    least = node.get("minItems", 0)
    if not isinstance(least, int) or least <= 0:
        return True
    prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
    if not all(ok(item) for item in prefix[:least]):
        return False
    return least <= len(prefix) or ok(node.get("items"))


def infinite_subschema(schema: Any) -> str | None:
    """The JSON pointer ("#/$defs/n") of a subschema reachable from `schema` that only an infinite value could
    satisfy, or None when there is none (or the schema is too large to check)."""
    if not isinstance(schema, dict):
        return None
    nodes: dict[int, tuple[str, dict[str, Any]]] = {id(schema): ("#", schema)}
    stack = [("#", schema)]
    while stack:
        where, node = stack.pop()
        for suffix, child in _children(schema, node):
            if id(child) not in nodes:
                if len(nodes) >= MAX_NODES:
                    return None
                # a $ref's target is named by the ref itself, so the message points at the recursive definition
                path = node["$ref"] if suffix == "$ref" else f"{where}/{suffix}"
                nodes[id(child)] = (path, child)
                stack.append((path, child))
    finite = {key: False for key in nodes}
    for _ in range(MAX_PASSES):
        changed = False
        for key, (_, node) in nodes.items():
            if not finite[key] and _own_finite(schema, node, finite):
                finite[key] = changed = True
        if not changed:
            break
    else:
        return None
    bad = [where for key, (where, _) in nodes.items() if not finite[key]]
    return min(bad, key=lambda where: (where == "#", len(where))) if bad else None
