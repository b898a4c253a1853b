"""schema_finite.has_finite_instance: refuses a JSON schema only when no finite value can
satisfy it (a required property, minimum of items or `contains` that leads back into the
schema without a way out), and lets everything it cannot judge through."""

from __future__ import annotations

from typing import Any

import pytest

from nanoserve.sampling.schema_finite import has_finite_instance


def chain(n: int, *, closed: bool) -> dict[str, Any]:
    """n definitions, each requiring the next; the last loops to the first, or is a number."""
    defs: dict[str, Any] = {f"d{i}": {"type": "object", "required": ["n"], "properties": {
        "n": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
    defs[f"d{n}"] = {"$ref": "#/$defs/d0"} if closed else {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


SELF = {"$ref": "#"}
ENDLESS: list[Any] = [
    {"type": "object", "properties": {"a": SELF}, "required": ["a"]},
    {"type": "object", "properties": {"a": False}, "required": ["a"]},
    {"$defs": {"x": {"type": "array", "items": {"$ref": "#/$defs/x"}, "minItems": 1}},
     "$ref": "#/$defs/x"},
    {"type": "array", "prefixItems": [{"type": "integer"}, SELF], "minItems": 2},
    {"type": "array", "contains": SELF},
    {"oneOf": [{"type": "object", "properties": {"a": SELF}, "required": ["a"]}]},
    {"allOf": [{"type": "string"}, False]},
    SELF,
    False,
    chain(200, closed=True),
]
FINITE: list[Any] = [
    {}, True, {"type": "string"},
    {"type": "object", "properties": {"a": SELF}},  # optional: {} ends it
    {"properties": {"a": SELF}, "required": ["a"]},  # no type: any scalar satisfies it
    {"type": ["object", "null"], "properties": {"a": SELF}, "required": ["a"]},
    {"anyOf": [{"type": "object", "properties": {"a": SELF}, "required": ["a"]},
               {"type": "null"}]},
    {"$defs": {"x": {"type": "array", "items": {"$ref": "#/$defs/x"}}}, "$ref": "#/$defs/x"},
    {"$defs": {"tree": {"type": "object", "required": ["kids"], "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/tree"}}}}},
     "$ref": "#/$defs/tree"},
    {"type": "array", "prefixItems": [{"type": "integer"}, SELF], "minItems": 1},
    {"type": "array", "contains": SELF, "minContains": 0},
    {"type": "object", "properties": {"a": SELF}, "required": ["a"], "enum": [{"a": 1}]},
    # What it does not follow counts as satisfiable: the compiler or the engine judges.
    {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}, "required": ["a"]},
    {"type": "object", "properties": {"a": {"$ref": "https://example.com/s"}},
     "required": ["a"]},
    {"type": "object", "properties": {"a": {"$id": "inner", "$ref": "#"}}, "required": ["a"]},
    chain(200, closed=False),
    [1, 2], "not a schema",
]


@pytest.mark.parametrize("schema", ENDLESS)
def test_no_finite_instance(schema: Any) -> None:
    assert not has_finite_instance(schema)


@pytest.mark.parametrize("schema", FINITE)
def test_finite_or_not_judged(schema: Any) -> None:
    assert has_finite_instance(schema)


def test_deep_schemas_do_not_recurse() -> None:
    deep: dict[str, Any] = {"type": "integer"}
    for _ in range(5000):  # far past Python's recursion limit
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    assert has_finite_instance(deep)
    deep["properties"]["a"] = {"$ref": "#"}
    assert not has_finite_instance(deep)
