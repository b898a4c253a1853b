"""Does a JSON schema admit a finite value? Refused at compile if not, never found mid-stream.

A schema such as `{"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}`
compiles (llguidance builds its grammar lazily) but has no finite instance: every value
must hold another one inside it. Generation then runs into llguidance's parser limits a
token or two in and the request could only fail there. So `has_finite_instance` decides it
first, as a least fixed point, the way a grammar's productive nonterminals are found: a
subschema is inhabited once its conditions hold over subschemas already known to be, and
rounds repeat until nothing changes. The rules over-approximate (whatever is not
understood counts as satisfiable: `not`, `if`, patterns, remote `$ref`s, nested `$id`s), so
a schema is refused only when no finite value can exist; where the approximation is too
coarse, the engine still ends the request with an error naming the field (engine.py).
Iterative throughout: a schema may be as deep as its body allows.
"""

from __future__ import annotations

from typing import Any

_SCALARS = {"string", "number", "integer", "boolean", "null"}
_ALL_TYPES = [*_SCALARS, "object", "array"]
# Where subschemas sit: keyword -> how it holds them.
_ONE = ("additionalProperties", "items", "contains", "not", "if", "then", "else",
        "propertyNames", "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
MAX_ROUNDS = 64  # past this the schema is let through: the engine's own check stands


def has_finite_instance(schema: Any) -> bool:
    """False only when no finite JSON value can satisfy `schema`."""
    nodes = _subschemas(schema)
    if nodes is None:
        return True
    ok: set[int] = set()
    # Children were listed after their parents: walking backwards settles most schemas in
    # one round; a chain of $refs pointing forward takes one round per link.
    for _ in range(MAX_ROUNDS):
        grown = False
        for node in reversed(nodes):
            if id(node) not in ok and _holds(node, schema, ok):
                ok.add(id(node))
                grown = True
        if id(schema) in ok:
            return True
        if not grown:
            return False
    return True


def _subschemas(root: Any) -> list[Any] | None:
    """Every subschema of `root` (dicts and booleans reached through schema keywords),
    parents first; None when a nested `$id` moves the base of `$ref`s (not followed)."""
    out: list[Any] = []
    seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        out.append(node)
        if not isinstance(node, dict):
            continue
        if node is not root and "$id" in node:
            return None
        children: list[Any] = []
        for key in _ONE:
            children.append(node.get(key))
        for key in _LIST:
            if isinstance(node.get(key), list):
                children.extend(node[key])
        for key in _MAP:
            if isinstance(node.get(key), dict):
                children.extend(node[key].values())
        children.append(_resolve(node.get("$ref"), root))  # wherever it points
        stack.extend(c for c in reversed(children) if isinstance(c, dict | bool))
    return out


def _resolve(ref: Any, root: Any) -> Any:
    """The target of a local `$ref` ("#", "#/$defs/x"), or None (anchors, remote refs)."""
    if not isinstance(ref, str) or not ref.startswith("#") or (ref != "#" and
                                                              not ref.startswith("#/")):
        return None
    node = root
    for raw in ref[2:].split("/") if ref != "#" else ():
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if isinstance(node, dict | bool) else None


def _holds(node: Any, root: Any, ok: set[int]) -> bool:
    """Whether `node` has a finite instance, given the subschemas in `ok` that do."""
    if isinstance(node, bool):
        return node
    if not isinstance(node, dict):
        return True  # not a schema: the compiler says what is wrong with it

    def sat(sub: Any) -> bool:
        if isinstance(sub, bool):
            return sub
        return id(sub) in ok if isinstance(sub, dict) else True  # None: nothing asked

    if "$ref" in node and not sat(_resolve(node["$ref"], root)):
        return False
    all_of, any_of, one_of = (node.get(k) for k in ("allOf", "anyOf", "oneOf"))
    if isinstance(all_of, list) and not all(sat(s) for s in all_of):
        return False
    for alternatives in (any_of, one_of):
        if isinstance(alternatives, list) and alternatives and not any(
                sat(s) for s in alternatives):
            return False
    if "const" in node or "enum" in node:
        return True  # a literal value is offered (whether it fits the rest: approximated)
    types = node.get("type", _ALL_TYPES)
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list):
        return True
    return any(_type_holds(t, node, sat) for t in types)


def _type_holds(t: Any, node: dict[str, Any], sat: Any) -> bool:
    if t == "object":
        props, required = node.get("properties"), node.get("required")
        if not isinstance(props, dict) or not isinstance(required, list):
            return True
        return all(sat(props.get(p)) for p in required if isinstance(p, str))
    if t == "array":
        least = node.get("minItems", 0)
        least = least if isinstance(least, int) and not isinstance(least, bool) else 0
        prefix = node.get("prefixItems", node.get("items"))
        prefix = prefix if isinstance(prefix, list) else []
        rest = node.get("items") if isinstance(node.get("items"), dict | bool) else None
        if not all(sat(s) for s in prefix[:least]):
            return False
        if least > len(prefix) and not sat(rest):
            return False
        floor = node.get("minContains", 1)
        return "contains" not in node or floor == 0 or sat(node["contains"])
    return True  # a scalar type, or one this check does not know
