"""The fast schema check (server/tools/schema_check.py) says what `jsonschema`'s
`check_schema` says: yes or no on every generated schema, and on a no the same error."""

from __future__ import annotations

from typing import Any

import jsonschema
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.server.tools.schema_check import schema_error

KEYS = ["type", "properties", "required", "items", "minLength", "pattern", "enum", "const",
        "anyOf", "oneOf", "allOf", "not", "$ref", "$defs", "additionalProperties",
        "patternProperties", "format", "minimum", "prefixItems", "description", "$schema",
        "$id", "$anchor", "$dynamicRef", "if", "then", "dependentRequired",
        "unevaluatedProperties", "contains", "multipleOf", "uniqueItems", "propertyNames"]
LEAF = st.one_of(st.none(), st.booleans(), st.integers(-3, 3),
                 st.floats(allow_nan=False, allow_infinity=False, width=32),
                 st.sampled_from(["string", "object", "integer", "array", "null", "objec",
                                  "(", "a+", "[", "#/$defs/x", "#", "email", "http://x"]))
VALUE = st.recursive(LEAF, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.sampled_from([*KEYS, "a"]), inner,
                                                 max_size=4)), max_leaves=12)
# Half the keys typed as the metaschema wants them, so that valid schemas are common too.
TYPED = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["string", "object", "integer", "array"]),
    "required": st.lists(st.sampled_from(["a", "b"]), unique=True),
    "pattern": st.sampled_from(["^a+$", "(", "[a-z]{2}", "\\d"]),
    "minLength": st.integers(-1, 3), "description": st.text(max_size=5)})
SCHEMA = st.one_of(st.booleans(), st.dictionaries(st.sampled_from(KEYS), VALUE, max_size=5),
                   TYPED, st.builds(lambda t, p: {**t, "properties": {"a": p}}, TYPED, TYPED))


def judged(schema: Any) -> str | None:
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        return f"{list(exc.absolute_path)}: {exc.message}"
    return None


@settings(max_examples=1_500, deadline=None)
@given(SCHEMA)
def test_the_fast_check_agrees_with_jsonschema(schema: Any) -> None:
    exc = schema_error(schema)
    assert (None if exc is None else f"{list(exc.absolute_path)}: {exc.message}") == \
        judged(schema)


def test_a_pattern_must_compile_as_jsonschema_checks_it() -> None:
    exc = schema_error({"properties": {"a": {"type": "string", "pattern": "("}}})
    assert exc is not None
    assert list(exc.absolute_path) == ["properties", "a", "pattern"]
    assert exc.message == "'(' is not a 'regex'"
    assert schema_error({"$schema": "not a uri", "$id": "also not"}) is None  # unchecked
